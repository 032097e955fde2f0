// How a rank sits in its tensor-parallel group.
#pragma once

namespace latentmoe {

struct ParallelConfig {
  int tp_size = 1;
  int rank = 0;
  // Sequence parallelism (each rank holds a slice of the tokens). The fused tails need every
  // rank to see all tokens, so with this set the runner always takes the native tier.
  bool sequence_parallel = false;
};

}  // namespace latentmoe

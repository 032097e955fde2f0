// The four tails (DESIGN section 2): how one rank turns its un-reduced partials L_r and S_r into the
// layer output that every rank holds. Written once against the Backend and Communicator interfaces, so
// the CPU reference proves the same orchestration the GPU runs. The layer's forward
// (core/layer_forward.h) calls them; so does the benchmark (src/bench_access.h), which times a tail alone.
#pragma once

#include <cstdint>

#include "core/backend.h"
#include "latentmoe/communicator.h"
#include "latentmoe/parallel.h"
#include "latentmoe/tensor.h"
#include "latentmoe/tier.h"

namespace latentmoe::detail {

// What a tail needs besides its tensors: the rank's backend and group, and the replicated weights.
struct TailOperands {
  Backend* backend = nullptr;
  Communicator* comm = nullptr;
  ParallelConfig parallel;
  int64_t hidden_size = 0;  // d
  TensorView latent_norm;   // gamma [l]; undefined: no latent norm
  TensorView up_proj;       // W_up [d, l], replicated
  float eps = 1e-5f;
};

// The tail's tensors for T tokens.
struct TailTensors {
  TensorView latent_partial;  // L_r [T, l]
  TensorView shared_partial;  // S_r [T, d]; undefined without a shared expert (native only).
                              // column_parallel, and native on one rank: `out` itself, which its tail
                              // accumulates into.
  TensorView latent_reduced;  // [T, l] workspace for Lhat
  TensorView hidden_shard;    // [T, d/tp] workspace (tail_fusion)
  TensorView out;             // [T, d]
};

// The rank context's scratch a tail works in, [max_T, ...] each (a layer's or a Tail's views of it).
struct TailScratch {
  TensorView latent_partial;  // [max_T, l]
  TensorView latent_reduced;  // [max_T, l]
  TensorView shared_partial;  // [max_T, d]; undefined: no shared expert
  TensorView hidden_shard;    // [max_T, d/tp]
};

// The tail's tensors for `num_tokens` tokens: the first rows of `scratch` and `out` (column_parallel, and
// native on a group of one rank: the shared partial is `out` itself, which its tail accumulates into, so no
// separate add runs). The layer's forward and the Tail both take them from here.
TailTensors tail_tensors(const TailScratch& scratch, TailTier tier, int tp_size, const TensorView& out,
                         int64_t num_tokens);

// Whether the tail of `tier` on a group of `tp_size` ranks takes `out` as the shared partial (tail_tensors).
bool shared_partial_is_out(TailTier tier, int tp_size);

// The tail of `tier` (DESIGN steps 5 and 8) on the backend's current stream. Nothing here checks the tier
// against what the rank supports (the callers do).
void run_tail(const TailOperands& operands, TailTier tier, const TailTensors& tensors);

}  // namespace latentmoe::detail

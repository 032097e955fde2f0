// The layer's forward pass on one rank after validation (DESIGN sections 1-2): routing, the latent
// down-projection, the routed and shared experts, the tail of the chosen tier (core/tails.h) and the
// zero experts. Runner::forward (runner.cpp) validates and then calls run_layer.
#pragma once

#include <cstdint>

#include "core/runner_state.h"
#include "core/tails.h"

namespace latentmoe::detail {

void run_layer(RunnerState& state, const ForwardInputs& inputs, const ForwardOutputs& outputs, TailTier tier,
               int64_t num_tokens);

// The tail's tensors for `num_tokens` tokens: the first rows of the layer's scratch and `out`
// (column_parallel: the shared partial is `out` itself, which its tail accumulates into). The benchmark
// (src/bench_access.h) times run_tail(state.tail_operands(), tier, tail_tensors(...)) alone.
TailTensors tail_tensors(RunnerState& state, TailTier tier, const TensorView& out, int64_t num_tokens);

}  // namespace latentmoe::detail

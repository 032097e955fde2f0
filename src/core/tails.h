// The forward pass of one rank after validation: routing, the routed and shared experts, and the
// tail of the chosen tier (DESIGN section 2).
#pragma once

#include "core/runner_state.h"

namespace latentmoe::detail {

void run_layer(RunnerState& state, const ForwardInputs& inputs, const ForwardOutputs& outputs, TailTier tier,
               int64_t num_tokens);

// What run_layer hands the tail: the rank's un-reduced partials, its workspaces and the output.
struct TailTensors {
  TensorView latent_partial;  // L_r [T, l]
  TensorView shared_partial;  // S_r [T, d]; undefined without a shared expert (native only)
  TensorView latent_reduced;  // [T, l] workspace for Lhat
  TensorView hidden_shard;    // [T, d/tp] workspace
  TensorView out;             // [T, d]
};

// The tail's tensors for `num_tokens` tokens: the first rows of the runner's workspaces and `out`
// (column_parallel: the shared partial is `out` itself, which its tail accumulates into).
TailTensors tail_tensors(RunnerState& state, TailTier tier, const TensorView& out, int64_t num_tokens);

// The tail of `tier` alone (steps 5 and 8) on the backend's current stream: run_layer calls it, and
// so does the benchmark (tools/bench_access.h), which times the tail alone on partials it wrote.
// Nothing here checks the tier against the runner's support (forward does).
void run_tail(RunnerState& state, TailTier tier, const TailTensors& tensors);

}  // namespace latentmoe::detail

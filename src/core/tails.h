// The forward pass of one rank after validation: routing, the routed and shared experts, and the
// tail of the chosen tier (DESIGN section 2).
#pragma once

#include "core/runner_state.h"

namespace latentmoe::detail {

void run_layer(RunnerState& state, const ForwardInputs& inputs, const ForwardOutputs& outputs, TailTier tier,
               int64_t num_tokens);

}  // namespace latentmoe::detail

// Routing on the CPU (DESIGN section 1 step 1): scores, group-limited top-k selection with the
// correction bias, and the weights. The exact rules (rounding, ties, NaN) are in docs/NUMERICS.md.
#pragma once

#include "core/backend.h"

namespace latentmoe::detail::cpu {

// Added to the sum of the chosen scores before renormalising (as DeepSeek-V3 does), so a token whose
// chosen scores are all zero gets zero weights instead of 0/0.
inline constexpr double kRenormEpsilon = 1e-20;

// logits [T, E+Z] f32; bias [E+Z] f32 or undefined; topk_ids [T, k] i32; topk_weights [T, k] f32;
// zero_weight_sum [T] f32. Throws Error on a wrong dtype or inconsistent routing parameters.
void route(const RoutingParams& params, const TensorView& logits, const TensorView& bias, const TensorView& topk_ids,
           const TensorView& topk_weights, const TensorView& zero_weight_sum);

}  // namespace latentmoe::detail::cpu

// Tier 0's pushing up-projection (CudaBackend::set_fused_up_projection_max_tokens): its bounds, in a
// header without CUDA so that the tools, built without the CUDA backend as well, state and check the
// same numbers as the backend.
#pragma once

#include "cuda/gemm/dense_push_bounds.h"  // kDensePushMaxRows: the backend's token bound may be set from 0 to it

namespace latentmoe::cuda {

// The backend's default token bound: tier 0's own default capacity (tail_fusion_max_tokens,
// docs/CONFIG.md).
inline constexpr int kDefaultFusedUpProjectionMaxTokens = 64;

}  // namespace latentmoe::cuda

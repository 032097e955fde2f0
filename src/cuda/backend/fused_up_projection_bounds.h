// Tier 0's pushing up-projection (CudaBackend::set_fused_up_projection_max_tokens): its bounds, in a
// header without CUDA so that the tools, built without the CUDA backend as well, state and check the
// same numbers as the backend.
#pragma once

namespace latentmoe::cuda {

// The most rows one dense_push_gemm call takes: the largest m-tile of the mma.sync kernel. The backend's
// token bound may be set from 0 to this.
inline constexpr int kDensePushMaxRows = 128;

// The backend's default token bound: tier 0's own default capacity (tail_fusion_max_tokens,
// docs/CONFIG.md).
inline constexpr int kDefaultFusedUpProjectionMaxTokens = 64;

}  // namespace latentmoe::cuda

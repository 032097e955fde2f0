// The pushing dense GEMM's row bound (dense_push_gemm.h), in a header without CUDA so that the backend's
// bounds (backend/fused_up_projection_bounds.h) and the tools, built without the CUDA backend as well,
// state the same number.
#pragma once

namespace latentmoe::cuda {

// The most rows one dense_push_gemm call takes: the largest m-tile of the mma.sync kernel.
inline constexpr int kDensePushMaxRows = 128;

}  // namespace latentmoe::cuda

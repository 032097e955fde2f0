// The Hopper grouped GEMM (sm_90a, warpgroup MMA): internal launcher used by grouped_gemm.cu.
#pragma once

#include <cuda_runtime.h>

#include "cuda/gemm/grouped_gemm_common.cuh"
#include "cuda/gemm/grouped_gemm_launch.cuh"
#include "latentmoe/dtype.h"

namespace latentmoe::cuda::gg {

// The tile shapes of the wgmma kernel (grouped_gemm_wgmma.cuh): expert rows x weight rows per tile.
enum class WgmmaShape {
  wide,    // up to 96 x 256, one CTA per SM (GemmVariant::wgmma)
  tall,    // up to 256 x 128, one CTA per SM (GemmVariant::wgmma_tall)
  narrow,  // up to 96 x 128, two CTAs per SM (GemmVariant::wgmma_narrow)
};

// Launches the wgmma kernel for bf16 or f16 (throws latentmoe::Error for other dtypes, or when
// detail::wgmma_available() is false). Same contract as the mma.sync kernels (grouped_gemm.h).
void launch_wgmma(DType dtype, WgmmaShape shape, Mode mode, KernelArgs args, const MmaLaunch& launch,
                  cudaStream_t stream);

// The same with MXFP4 weights: args.w0/w1 the codes, args.s0/s1 their scales (grouped_gemm_wgmma_mxfp4.cu).
void launch_wgmma_mxfp4(DType dtype, WgmmaShape shape, Mode mode, KernelArgs args, const MmaLaunch& launch,
                        cudaStream_t stream);

// The tile shapes of the persistent, warp-specialised kernel (grouped_gemm_wgmma_ws.cuh).
enum class WgmmaWsShape {
  wide,  // up to 160 expert rows x 256 weight rows (GemmVariant::wgmma_ws)
  tall,  // up to 256 expert rows x 128 weight rows (GemmVariant::wgmma_ws_tall)
};
// The most experts the persistent kernel takes (its per-expert prefix lives in shared memory): the automatic choice
// takes it only up to this many.
inline constexpr int kWgmmaWsMaxExperts = 4096;

// The persistent, warp-specialised kernel (GemmVariant::wgmma_ws, wgmma_ws_tall; grouped_gemm_wgmma_ws.cu), bf16
// or f16, the weights in the compute dtype (TMA loads) or MXFP4 (args.s0 set; decoded by the producer): one CTA per
// SM walking the tiles (launch.n_tiles_per_cta > 0: at least that many tiles per CTA, a smaller grid), no split-K.
// Throws latentmoe::Error for other dtypes, more than WgmmaWsCfg::kMaxExperts experts, or when
// detail::wgmma_available() is false.
void launch_wgmma_ws(DType dtype, WgmmaWsShape shape, Mode mode, const KernelArgs& args, const MmaLaunch& launch,
                     cudaStream_t stream);

// Per element type (grouped_gemm_wgmma.cu, grouped_gemm_wgmma_f16.cu).
void launch_wgmma_bf16(WgmmaShape shape, Mode mode, const KernelArgs& args, const MmaLaunch& launch,
                       cudaStream_t stream);
void launch_wgmma_f16(WgmmaShape shape, Mode mode, const KernelArgs& args, const MmaLaunch& launch,
                      cudaStream_t stream);

}  // namespace latentmoe::cuda::gg

// The Hopper grouped GEMM (sm_90a, warpgroup MMA): internal launcher used by grouped_gemm.cu.
#pragma once

#include <cuda_runtime.h>

#include "cuda/gemm/grouped_gemm_common.cuh"
#include "cuda/gemm/grouped_gemm_launch.cuh"
#include "latentmoe/dtype.h"

namespace latentmoe::cuda::gg {

// Launches the wgmma kernel for bf16 or f16 (throws latentmoe::Error for other dtypes, or when
// detail::wgmma_available() is false). Same contract as the mma.sync kernels (grouped_gemm.h). tall: tiles
// of up to 256 expert rows against 128 weight rows (GemmVariant::wgmma_tall), else up to 96 against 256.
void launch_wgmma(DType dtype, bool tall, Mode mode, KernelArgs args, const MmaLaunch& launch, cudaStream_t stream);

// The same with MXFP4 weights: args.w0/w1 the codes, args.s0/s1 their scales (grouped_gemm_wgmma_mxfp4.cu).
void launch_wgmma_mxfp4(DType dtype, bool tall, Mode mode, KernelArgs args, const MmaLaunch& launch,
                        cudaStream_t stream);

// Per element type (grouped_gemm_wgmma.cu, grouped_gemm_wgmma_f16.cu).
void launch_wgmma_bf16(bool tall, Mode mode, const KernelArgs& args, const MmaLaunch& launch, cudaStream_t stream);
void launch_wgmma_f16(bool tall, Mode mode, const KernelArgs& args, const MmaLaunch& launch, cudaStream_t stream);

}  // namespace latentmoe::cuda::gg

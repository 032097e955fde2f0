// MXFP4 routed experts at decode on the tensor cores (mma.sync m16n8k16, bf16 and f16 activations):
// the kernels behind mxfp4_routed_gate_up / mxfp4_routed_down (mxfp4_decode.h) wherever
// mxfp4_mma_supported() holds; the same contract as those, the same results within rounding.
// Design, numerics and measurements: mxfp4_decode_mma.cu, docs/MXFP4.md. Host interface.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/gemm/mxfp4_decode.h"

namespace latentmoe::cuda {

// True when the tensor-core kernels take the call: bf16 or f16, 1..8 tokens, tokens * top_k <= 256,
// the activations' rows (x, row stride ld_x elements) 16-byte aligned, compute capability 8.0 or later.
bool mxfp4_mma_supported(DType dtype, int64_t tokens, int top_k, const void* x, int64_t ld_x);

void mxfp4_mma_gate_up(const Mxfp4GateUpCall& call, cudaStream_t stream);
void mxfp4_mma_down(const Mxfp4DownCall& call, cudaStream_t stream);

}  // namespace latentmoe::cuda

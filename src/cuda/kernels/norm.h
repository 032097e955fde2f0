// RMSNorm on the device: out[r] = in[r] / sqrt(mean(in[r]^2) + eps) · gamma, in fp32, rounded once.
// Host launcher; includable from C++.
#pragma once

#include <cuda_runtime_api.h>

#include "cuda/kernels/elementwise.h"

namespace latentmoe::cuda {

// `in` and `out` [rows, cols] of any compute dtypes (out may alias in); gamma [cols] of any compute
// dtype. One block per row; 16-byte vector loads and stores where every row is aligned.
void launch_rms_norm(const RowMatrix& in, const void* gamma, DType gamma_dtype, float eps, const RowMatrix& out,
                     cudaStream_t stream);

}  // namespace latentmoe::cuda

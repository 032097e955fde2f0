// Element-wise and row-wise kernels of the CUDA backend: add, convert, add_scaled_rows, the dense
// MLP's activation and the routed experts' weighted combine. Host launchers; includable from C++.
// Every launcher enqueues on `stream`, checks the launch and never synchronises.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/backend.h"
#include "cuda/common/matrix.h"
#include "latentmoe/dtype.h"

namespace latentmoe::cuda {

// out = a + b (fp32 math, one rounding); out may alias a or b. Any compute dtypes.
void launch_add(const RowMatrix& a, const RowMatrix& b, const RowMatrix& out, cudaStream_t stream);

// out = in converted to out's dtype (rounded to nearest even). Any compute dtypes.
void launch_convert(const RowMatrix& in, const RowMatrix& out, cudaStream_t stream);

// out[r, :] += scale[r] · x[r, :] (fp32 math, one rounding); rows with scale 0 are left untouched.
void launch_add_scaled_rows(const RowMatrix& x, const float* scale, const RowMatrix& out, cudaStream_t stream);

// out[i] = act(gate[i], up[i]) for `count` contiguous elements of `dtype`, fp32 math, one rounding.
// `gate` is ignored (may be null) for relu2; `out` may alias gate or up.
void launch_gated_activation(const ::latentmoe::detail::ActivationParams& activation, DType dtype, const void* gate,
                             const void* up, void* out, int64_t count, cudaStream_t stream);

// out[t, :] = sum over j < top_k with pair_rows[t*top_k + j] >= 0 of weights[t*top_k + j] ·
// y_rows[pair_rows[t*top_k + j], :], accumulated in fp32 in j order and rounded once; rows of
// tokens with no real expert become 0. y_rows is contiguous [*, out.cols] of `y_dtype`.
void launch_combine(DType y_dtype, const void* y_rows, const int32_t* pair_rows, const float* weights, int top_k,
                    const RowMatrix& out, cudaStream_t stream);

}  // namespace latentmoe::cuda

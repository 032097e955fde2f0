// Element-wise and row-wise kernels of the CUDA backend: add, add_scaled_rows, the dense MLP's
// activation and the routed experts' weighted combine; plus the small device helpers (dtype
// conversion, vectors) the other kernel files share.
//
// The launchers are host functions and this header is includable from C++; the device helpers are
// only seen by nvcc. Every launcher enqueues on `stream`, checks the launch and never synchronises.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/backend.h"
#include "latentmoe/dtype.h"

namespace latentmoe::cuda {

// A row-major matrix on the device: element (r, c) at data[r * ld + c] of `dtype`.
struct RowMatrix {
  void* data = nullptr;
  DType dtype = DType::f32;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t ld = 0;
};

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

// Blocks for a grid-stride loop over `work_items` items with `threads` threads per block.
int grid_for(int64_t work_items, int threads);

}  // namespace latentmoe::cuda

#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <utility>

#include "cuda/convert.cuh"
#include "latentmoe/error.h"

namespace latentmoe::cuda {

// Element `index` of a compute-dtype buffer whose dtype is only known at run time.
__device__ __forceinline__ float load_as_float_dev(const void* data, DType dtype, int64_t index) {
  switch (dtype) {
    case DType::bf16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(data)[index]);
    case DType::f16:
      return __half2float(static_cast<const __half*>(data)[index]);
    default:
      return static_cast<const float*>(data)[index];
  }
}

__device__ __forceinline__ void store_from_float_dev(void* data, DType dtype, int64_t index, float value) {
  switch (dtype) {
    case DType::bf16:
      static_cast<__nv_bfloat16*>(data)[index] = __float2bfloat16_rn(value);
      break;
    case DType::f16:
      static_cast<__half*>(data)[index] = __float2half_rn(value);
      break;
    default:
      static_cast<float*>(data)[index] = value;
      break;
  }
}

// N elements of T moved as one aligned vector (16 bytes for the vectorised paths).
template <class T, int N>
struct alignas(sizeof(T) * N) Vec {
  T values[N];
};

// Calls f(T{}) with T the device type of a compute dtype; throws Error for any other dtype.
template <class F>
void dispatch_compute_dtype(DType dtype, const char* what, F&& f) {
  switch (dtype) {
    case DType::f32:
      f(float{});
      return;
    case DType::bf16:
      f(__nv_bfloat16{});
      return;
    case DType::f16:
      f(__half{});
      return;
    default:
      ::latentmoe::detail::throw_error("CUDA backend: ", what, " has dtype ", dtype_name(dtype),
                                       "; only F32, BF16 and F16 are supported");
  }
}

// True when `pointer` and every row start (`ld` elements apart) are aligned to `bytes`.
inline bool rows_aligned(const void* pointer, int64_t ld, size_t element_size, size_t bytes) {
  return reinterpret_cast<uintptr_t>(pointer) % bytes == 0 && (static_cast<size_t>(ld) * element_size) % bytes == 0;
}

__device__ __forceinline__ float warp_sum(float value) {
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

}  // namespace latentmoe::cuda
#endif  // __CUDACC__

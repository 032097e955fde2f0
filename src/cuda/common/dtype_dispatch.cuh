// Run-time dtype dispatch and element access for kernels written once over float, bf16 and f16.
// Device code (nvcc only).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <utility>

#include "cuda/common/convert.cuh"
#include "latentmoe/dtype.h"
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

}  // namespace latentmoe::cuda

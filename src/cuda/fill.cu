#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/cuda_check.h"
#include "cuda/fill.h"

namespace latentmoe::cuda {
namespace {

__device__ __forceinline__ float hash_uniform(uint64_t seed, uint64_t index) {
  uint64_t z = seed + 0x9e3779b97f4a7c15ull * (index + 1);  // splitmix64 of (seed, index)
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<float>(static_cast<double>(z >> 11) * 0x1.0p-53 * 2.0 - 1.0);
}

template <class T>
__device__ __forceinline__ T from_float(float value);
template <>
__device__ __forceinline__ float from_float<float>(float value) {
  return value;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float value) {
  return __float2bfloat16_rn(value);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float value) {
  return __float2half_rn(value);
}

template <class T>
__global__ void fill_uniform_kernel(T* data, int64_t count, uint64_t seed, float scale, float offset) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    data[i] = from_float<T>(offset + scale * hash_uniform(seed, static_cast<uint64_t>(i)));
  }
}

}  // namespace

void fill_uniform(void* data, DType dtype, int64_t count, uint64_t seed, float scale, float offset,
                  cudaStream_t stream) {
  if (count == 0) return;
  constexpr int kThreads = 256;
  const int blocks = static_cast<int>(std::min<int64_t>((count + kThreads - 1) / kThreads, 132 * 32));
  switch (dtype) {
    case DType::f32:
      fill_uniform_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<float*>(data), count, seed, scale, offset);
      break;
    case DType::bf16:
      fill_uniform_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<__nv_bfloat16*>(data), count, seed, scale,
                                                           offset);
      break;
    case DType::f16:
      fill_uniform_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<__half*>(data), count, seed, scale, offset);
      break;
    default:
      ::latentmoe::detail::throw_error("fill_uniform: unsupported dtype ", dtype_name(dtype));
  }
  LATENTMOE_CUDA_CHECK_LAUNCH("fill_uniform_kernel");
}

}  // namespace latentmoe::cuda

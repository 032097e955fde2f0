#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/cuda_check.h"
#include "cuda/elementwise.cuh"
#include "cuda/fill.h"
#include "latentmoe/random.h"

namespace latentmoe::cuda {
namespace {

template <class T>
__global__ void fill_uniform_kernel(T* data, int64_t count, uint64_t seed, float scale, float offset) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    data[i] = from_float<T>(offset + scale * indexed_uniform_pm1(seed, static_cast<uint64_t>(i)));
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

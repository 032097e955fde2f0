#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/common/cuda_check.h"
#include "cuda/common/device.h"
#include "cuda/common/dtype_dispatch.cuh"
#include "cuda/kernels/elementwise.h"
#include "cuda/kernels/fill.h"
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

__global__ void read_through_kernel(const uint4* buffer, int64_t words, uint32_t marker, uint32_t* sink) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  uint32_t acc = 0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < words; i += stride) {
    const uint4 v = __ldcg(buffer + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == marker) *sink = acc;  // a run-time value the compiler cannot see through
}

}  // namespace

void read_through(const void* buffer, size_t bytes, uint32_t* sink, cudaStream_t stream) {
  LATENTMOE_CHECK(bytes % 16 == 0 && reinterpret_cast<uintptr_t>(buffer) % 16 == 0,
                  "read_through: the buffer must be 16-byte aligned and a multiple of 16 bytes");
  const int64_t words = static_cast<int64_t>(bytes / 16);
  if (words == 0) return;
  read_through_kernel<<<current_sm_count() * 8, 256, 0, stream>>>(static_cast<const uint4*>(buffer), words, 0x9e3779b9u,
                                                                  sink);
  LATENTMOE_CUDA_CHECK_LAUNCH("read_through_kernel");
}

void fill_uniform(void* data, DType dtype, int64_t count, uint64_t seed, float scale, float offset,
                  cudaStream_t stream) {
  if (count == 0) return;
  constexpr int kThreads = 256;
  const int blocks =
      static_cast<int>(std::min<int64_t>((count + kThreads - 1) / kThreads, int64_t{32} * current_sm_count()));
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

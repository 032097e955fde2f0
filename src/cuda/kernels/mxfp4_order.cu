// MXFP4 codes into the kernel order on the device (mxfp4_order.h): one thread per 16 bytes where the buffer allows,
// a grid-stride loop, the permutation of core/mxfp4_kernel_order.h on every word.
#include <algorithm>

#include "core/mxfp4_kernel_order.h"
#include "cuda/common/cuda_check.h"
#include "cuda/common/device.h"
#include "cuda/kernels/mxfp4_order.h"
#include "latentmoe/error.h"

namespace latentmoe::cuda {
namespace {

__global__ void mxfp4_to_kernel_order_kernel16(uint4* words, int64_t count) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    uint4 v = words[i];
    v.x = ::latentmoe::detail::mxfp4_to_kernel_order(v.x);
    v.y = ::latentmoe::detail::mxfp4_to_kernel_order(v.y);
    v.z = ::latentmoe::detail::mxfp4_to_kernel_order(v.z);
    v.w = ::latentmoe::detail::mxfp4_to_kernel_order(v.w);
    words[i] = v;
  }
}

__global__ void mxfp4_to_kernel_order_kernel4(uint32_t* words, int64_t count) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    words[i] = ::latentmoe::detail::mxfp4_to_kernel_order(words[i]);
  }
}

}  // namespace

void mxfp4_codes_to_kernel_order(void* codes, size_t bytes, cudaStream_t stream) {
  const auto address = reinterpret_cast<uintptr_t>(codes);
  LATENTMOE_CHECK(bytes % 4 == 0 && address % 4 == 0, "MXFP4 codes to the kernel order: ", bytes,
                  " bytes at an address ", address % 4 == 0 ? "" : "not ",
                  "4-byte aligned; the conversion takes whole aligned 32-bit words (8 codes each)");
  if (bytes == 0) return;
  constexpr int kThreads = 256;
  const bool wide = bytes % 16 == 0 && address % 16 == 0;
  const int64_t count = static_cast<int64_t>(bytes / (wide ? 16 : 4));
  const int blocks =
      static_cast<int>(std::min<int64_t>((count + kThreads - 1) / kThreads, int64_t{32} * current_sm_count()));
  if (wide) {
    mxfp4_to_kernel_order_kernel16<<<blocks, kThreads, 0, stream>>>(static_cast<uint4*>(codes), count);
  } else {
    mxfp4_to_kernel_order_kernel4<<<blocks, kThreads, 0, stream>>>(static_cast<uint32_t*>(codes), count);
  }
  LATENTMOE_CUDA_CHECK_LAUNCH("mxfp4_to_kernel_order_kernel");
}

}  // namespace latentmoe::cuda

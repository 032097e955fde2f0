// l2_prefetch.h. On sm_90 each thread issues bulk prefetches (cp.async.bulk.prefetch.L2, one instruction per
// chunk, handled by the SM's copy engine); on older GPUs it prefetches the chunk's 128-byte lines one by one.
#include <algorithm>
#include <cstdint>

#include "cuda/common/cuda_check.h"
#include "cuda/common/device.h"
#include "cuda/kernels/l2_prefetch.h"

namespace latentmoe::cuda {
namespace {

constexpr int kThreads = 32;
constexpr int64_t kChunkBytes = 16 * 1024;  // one bulk prefetch

template <bool kEvictLast>
__device__ __forceinline__ void prefetch_chunk(const char* chunk, uint32_t bytes, uint64_t policy) {
#if __CUDA_ARCH__ >= 900
  if constexpr (kEvictLast) {
    asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;\n" ::"l"(chunk), "r"(bytes), "l"(policy)
                 : "memory");
  } else {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(chunk), "r"(bytes) : "memory");
  }
#else
  constexpr uint32_t kLineBytes = 128;
  (void)policy;
  for (uint32_t offset = 0; offset < bytes; offset += kLineBytes) {
    if constexpr (kEvictLast) {
      asm volatile("prefetch.global.L2::evict_last [%0];\n" ::"l"(chunk + offset));
    } else {
      asm volatile("prefetch.global.L2 [%0];\n" ::"l"(chunk + offset));
    }
  }
#endif
}

// Thread i of the grid takes chunks i, i + threads, ...; the last chunk holds the remaining bytes (a
// multiple of 16, as the bulk prefetch requires).
template <bool kEvictLast>
__global__ void l2_prefetch_kernel(const char* data, int64_t bytes) {
  uint64_t policy = 0;
  if constexpr (kEvictLast) asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(policy));
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x * kChunkBytes;
  for (int64_t offset = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kChunkBytes; offset < bytes;
       offset += stride) {
    const int64_t size = bytes - offset < kChunkBytes ? bytes - offset : kChunkBytes;
    prefetch_chunk<kEvictLast>(data + offset, static_cast<uint32_t>(size), policy);
  }
}

}  // namespace

void l2_prefetch(const void* data, size_t bytes, L2PrefetchPriority priority, cudaStream_t stream) {
  if (data == nullptr || bytes == 0) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + 15) / 16 * 16;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) / 16 * 16;
  if (end <= begin) return;
  const int64_t aligned = static_cast<int64_t>(end - begin);
  const int64_t chunks = (aligned + kChunkBytes - 1) / kChunkBytes;
  const int blocks = static_cast<int>(std::min<int64_t>((chunks + kThreads - 1) / kThreads, current_sm_count()));
  const char* first = reinterpret_cast<const char*>(begin);
  if (priority == L2PrefetchPriority::evict_last) {
    l2_prefetch_kernel<true><<<blocks, kThreads, 0, stream>>>(first, aligned);
  } else {
    l2_prefetch_kernel<false><<<blocks, kThreads, 0, stream>>>(first, aligned);
  }
  LATENTMOE_CUDA_CHECK_LAUNCH("l2_prefetch_kernel");
}

}  // namespace latentmoe::cuda

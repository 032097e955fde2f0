// Bulk L2 prefetch: a CTA asks the L2 for a whole range of weights when it starts, so that the bytes it
// will read are in flight at once instead of one register load's worth per warp at a time; the loads
// then hit in L2. A hint only: nothing waits for it, no register or shared memory holds the bytes, and
// a prefetch the L2 drops costs nothing but the request.
#pragma once

#include <cstddef>
#include <cstdint>

namespace latentmoe::cuda {

// Bytes one bulk prefetch asks for: a range is cut into pieces of this size, spread over the caller's
// threads.
inline constexpr uint32_t kL2PrefetchPiece = 4096;

// Asks the L2 to fetch [p, p + bytes) from device memory (sm_90 and later: cp.async.bulk.prefetch.L2;
// earlier GPUs: nothing). Thread `lane` of the `lanes` threads that make the same call issues pieces
// lane, lane + lanes, ... Only the whole 16-byte units inside the range are asked for (the instruction's
// alignment), so nothing outside it is touched; a few bytes at each end are left to the loads.
__device__ __forceinline__ void l2_prefetch(const void* p, size_t bytes, int lane, int lanes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const uintptr_t first = reinterpret_cast<uintptr_t>(p);
  const uintptr_t begin = (first + 15) & ~uintptr_t{15};
  const uintptr_t end = (first + bytes) & ~uintptr_t{15};
  for (uintptr_t at = begin + static_cast<uintptr_t>(lane) * kL2PrefetchPiece; at < end;
       at += static_cast<uintptr_t>(lanes) * kL2PrefetchPiece) {
    const uint32_t size = static_cast<uint32_t>(end - at < kL2PrefetchPiece ? end - at : kL2PrefetchPiece);
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(at), "r"(size));
  }
#else
  (void)p, (void)bytes, (void)lane, (void)lanes;
#endif
}

}  // namespace latentmoe::cuda

// Prefetch of read-only device memory into the L2 (the decode chain: the next phase's weights, which do not
// depend on the activations, brought in while the current phase leaves DRAM bandwidth unused).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace latentmoe::cuda {

// The L2 eviction priority the prefetched lines get: normal, or evict_last (evicted after normal and
// evict-first lines, so that a concurrent weight stream does not push them out before they are read).
enum class L2PrefetchPriority { normal, evict_last };

// Asks the L2 for the 16-byte words of [data, data + bytes) (the unaligned head and tail bytes are left out:
// a prefetch is a hint). Enqueued on `stream`; the kernel ends once the requests are issued, before the lines
// arrive. Nothing is read into registers or written, so no result of a later kernel can change.
void l2_prefetch(const void* data, size_t bytes, L2PrefetchPriority priority, cudaStream_t stream);

}  // namespace latentmoe::cuda

// Helpers for kernels whose CTAs may form a thread-block cluster along x (sm_90 and later) of `split`
// CTAs that share partial sums through distributed shared memory; with split == 1 (and on older GPUs,
// where the launcher never clusters) they reduce to the CTA's own barrier and shared memory. Used by the
// skinny GEMMs and the decode GEMV.
#pragma once

#include <cooperative_groups.h>

#include "cuda/common/device.h"
#include "latentmoe/error.h"

namespace latentmoe::cuda {

// Host side: checks a forced launch shape (0 = the launcher's choice) of such a kernel: warps in
// 0..max_warps, split 0, 1, or 2, 4, 8 on sm_90 and later (the portable cluster sizes), clusters >= 0.
// Throws latentmoe::Error naming `what` and the offending value.
inline void check_cluster_shape(const char* what, int warps, int max_warps, int split, int clusters) {
  LATENTMOE_CHECK(warps >= 0 && warps <= max_warps, what, ": ", warps, " warps (1..", max_warps, ")");
  const bool clusters_supported = current_compute_capability() >= 90;
  LATENTMOE_CHECK(split == 0 || split == 1 || ((split == 2 || split == 4 || split == 8) && clusters_supported), what,
                  ": split ", split, " (1, or 2, 4, 8 on sm_90 and later)");
  LATENTMOE_CHECK(clusters >= 0, what, ": ", clusters, " clusters");
}

// The barrier of the cluster (of the CTA when split == 1): shared-memory writes before it are visible
// to every CTA of the cluster after it.
__device__ __forceinline__ void cluster_barrier(int split) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (split > 1) {
    cooperative_groups::this_cluster().sync();
    return;
  }
#endif
  __syncthreads();
}

// `own` (an address in this CTA's shared memory) as seen in CTA `rank` of the cluster; `own` itself
// when split == 1.
__device__ __forceinline__ const float* cluster_shared(float* own, int rank, int split) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (split > 1) return cooperative_groups::this_cluster().map_shared_rank(own, rank);
#endif
  return own;
}

}  // namespace latentmoe::cuda

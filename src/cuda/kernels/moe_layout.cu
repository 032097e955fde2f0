// The MoE layout on the device (moe_layout.h): from topk_ids, the grouped rows of every real expert,
// built as a stable counting sort of the (token, slot) pairs without any host synchronisation.
//
// The pairs are cut into segments of kLayoutSegment = 2048. Inside a block, the segment's ids are
// staged in shared memory and `walkers` warps (at most 8, fewer when their histograms do not fit)
// each walk a contiguous sub-range of it in pair order, 32 pairs a step, lanes of one expert grouped
// with __match_any_sync, counting into a per-warp expert histogram hist [walkers, E]; the counts are
// turned into first rows and the same walk hands rows out. Kernels (256 threads unless said):
//   layout_fused_kernel    one block, when all pairs fit one segment and counts [E], hist and the ids
//                          fit the default 48 KB of shared memory (decode and small prefill): count,
//                          block scan of the expert totals, scatter. A programmatic dependent of the
//                          routing kernel (pdl.cuh).
//   layout_count_kernel    otherwise, pass 1: a block per segment; per-segment expert counts (shared
//                          counts [E], atomics: order-free) into segment_counts [segments, E].
//   layout_scan_kernel     pass 2: one block of 1024 threads; each expert's column of segment_counts
//                          scanned over segments in place, then the expert totals into
//                          expert_offsets (shared totals [E]).
//   layout_scatter_kernel  pass 3: a block per segment; counts its segment again and scatters from the
//                          scanned offsets (shared hist [walkers, E] and ids [kLayoutSegment]).
// Invariants: rows of one expert are in ascending pair order (stable) and the result does not depend
// on scheduling (deterministic); ids outside [0, E) (zero experts) get no row and pair_rows -1; every
// kernel stays within the default 48 KB of shared memory, so E <= kMaxLayoutExperts; pairs < INT_MAX;
// the workspace (moe_layout_workspace_bytes) holds expert_offsets [E+1], sorted_pairs and pair_rows
// [pairs] and segment_counts [segments, E], each 256-byte aligned.
#include <algorithm>
#include <climits>

#include "cuda/common/cuda_check.h"
#include "cuda/common/pdl.cuh"
#include "cuda/kernels/moe_layout.h"
#include "latentmoe/error.h"

namespace latentmoe::cuda {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr size_t kDefaultSharedBytes = 48 * 1024;

// Exclusive scan of data[0, count) in place by the whole block (blockDim a multiple of 32, at most
// 1024); returns the total. `scratch` holds 33 ints. Callers put a barrier before it when other
// threads wrote `data`; it ends with one.
__device__ int32_t block_exclusive_scan(int32_t* data, int64_t count, int32_t* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
  const int64_t per_thread = (count + blockDim.x - 1) / blockDim.x;
  const int64_t begin = std::min<int64_t>(threadIdx.x * per_thread, count);
  const int64_t end = std::min<int64_t>(begin + per_thread, count);
  int32_t local = 0;
  for (int64_t i = begin; i < end; ++i) local += data[i];
  int32_t inclusive = local;
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int32_t other = __shfl_up_sync(kFullMask, inclusive, offset);
    if (lane >= offset) inclusive += other;
  }
  if (lane == 31) scratch[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    const int32_t value = lane < num_warps ? scratch[lane] : 0;
    int32_t warp_inclusive = value;
    for (int offset = 1; offset < 32; offset <<= 1) {
      const int32_t other = __shfl_up_sync(kFullMask, warp_inclusive, offset);
      if (lane >= offset) warp_inclusive += other;
    }
    if (lane < num_warps) scratch[lane] = warp_inclusive - value;
    if (lane == 31) scratch[32] = warp_inclusive;
  }
  __syncthreads();
  int32_t running = scratch[warp] + inclusive - local;
  for (int64_t i = begin; i < end; ++i) {
    const int32_t value = data[i];
    data[i] = running;
    running += value;
  }
  const int32_t total = scratch[32];
  __syncthreads();
  return total;
}

// A segment of pairs is handled by one block: its ids are staged in shared memory, and `walkers`
// warps each walk a contiguous sub-range of it in pair order, 32 pairs a step, grouping lanes of
// one expert with __match_any_sync. hist[w * E + e] first counts warp w's pairs of expert e, then
// (after the caller turns it into first rows) hands out rows, so rows of one expert stay in
// ascending pair order across warps and steps: a stable, deterministic counting sort.
struct SegmentWalk {
  int begin = 0;  // the warp's sub-range of the segment
  int end = 0;
};

__device__ __forceinline__ SegmentWalk warp_sub_range(int count, int walkers) {
  const int warp = threadIdx.x >> 5;
  const int chunk = ((count + walkers - 1) / walkers + 31) / 32 * 32;
  SegmentWalk walk;
  walk.begin = warp < walkers ? std::min(warp * chunk, count) : count;
  walk.end = warp < walkers ? std::min(walk.begin + chunk, count) : count;
  return walk;
}

__device__ void walk_count(const int32_t* segment_ids, int count, int walkers, int num_experts, int32_t* hist) {
  const int lane = threadIdx.x & 31;
  const SegmentWalk walk = warp_sub_range(count, walkers);
  int32_t* mine = hist + static_cast<int64_t>(threadIdx.x >> 5) * num_experts;
  for (int base = walk.begin; base < walk.end; base += 32) {
    const int i = base + lane;
    const int expert = i < walk.end ? segment_ids[i] : -1;
    const bool real = expert >= 0 && expert < num_experts;
    const unsigned peers = __match_any_sync(kFullMask, real ? expert : -1);
    if (real && lane == __ffs(peers) - 1) mine[expert] += __popc(peers);
    __syncwarp();
  }
}

__device__ void walk_scatter(const int32_t* segment_ids, int count, int walkers, int num_experts, int64_t first_pair,
                             int32_t* hist, int32_t* sorted_pairs, int32_t* pair_rows) {
  const int lane = threadIdx.x & 31;
  const SegmentWalk walk = warp_sub_range(count, walkers);
  int32_t* mine = hist + static_cast<int64_t>(threadIdx.x >> 5) * num_experts;
  for (int base = walk.begin; base < walk.end; base += 32) {
    const int i = base + lane;
    const bool in_range = i < walk.end;
    const int expert = in_range ? segment_ids[i] : -1;
    const bool real = expert >= 0 && expert < num_experts;
    const unsigned peers = __match_any_sync(kFullMask, real ? expert : -1);
    const int leader = __ffs(peers) - 1;
    int start = 0;
    if (real && lane == leader) {
      start = mine[expert];
      mine[expert] = start + __popc(peers);
    }
    start = __shfl_sync(kFullMask, start, leader);
    const int64_t pair = first_pair + i;
    if (real) {
      const int32_t row = start + __popc(peers & ((1u << lane) - 1u));
      sorted_pairs[row] = static_cast<int32_t>(pair);
      pair_rows[pair] = row;
    } else if (in_range) {
      pair_rows[pair] = -1;
    }
    __syncwarp();
  }
}

// Zeroes hist [walkers, E] and stages ids[begin, begin + count) in shared memory.
__device__ void segment_prologue(const int32_t* ids, int64_t begin, int count, int walkers, int num_experts,
                                 int32_t* hist, int32_t* segment_ids) {
  const int64_t hist_size = static_cast<int64_t>(walkers) * num_experts;
  for (int64_t i = threadIdx.x; i < hist_size; i += blockDim.x) hist[i] = 0;
  for (int i = threadIdx.x; i < count; i += blockDim.x) segment_ids[i] = ids[begin + i];
  __syncthreads();
}

// hist[w][e] (counts) -> the first row of warp w's pairs of expert e, given the segment's first
// row of expert e.
__device__ __forceinline__ void hist_to_rows(int walkers, int num_experts, int expert, int32_t first_row,
                                             int32_t* hist) {
  int32_t running = first_row;
  for (int w = 0; w < walkers; ++w) {
    const int32_t count = hist[static_cast<int64_t>(w) * num_experts + expert];
    hist[static_cast<int64_t>(w) * num_experts + expert] = running;
    running += count;
  }
}

// All pairs in one block: count, scan and scatter. Shared memory: counts [E], hist [walkers, E],
// segment ids [num_pairs].
__global__ void layout_fused_kernel(const int32_t* ids, int num_pairs, int num_experts, int walkers,
                                    int32_t* expert_offsets, int32_t* sorted_pairs, int32_t* pair_rows) {
  extern __shared__ int32_t shared_ints[];
  __shared__ int32_t scratch[33];
  int32_t* counts = shared_ints;
  int32_t* hist = counts + num_experts;
  int32_t* segment_ids = hist + static_cast<int64_t>(walkers) * num_experts;
  pdl_wait();  // a programmatic dependent of the routing kernel (src/cuda/common/pdl.cuh)
  segment_prologue(ids, 0, num_pairs, walkers, num_experts, hist, segment_ids);
  walk_count(segment_ids, num_pairs, walkers, num_experts, hist);
  __syncthreads();
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    int32_t total = 0;
    for (int w = 0; w < walkers; ++w) total += hist[static_cast<int64_t>(w) * num_experts + e];
    counts[e] = total;
  }
  __syncthreads();
  const int32_t total = block_exclusive_scan(counts, num_experts, scratch);
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    expert_offsets[e] = counts[e];
    hist_to_rows(walkers, num_experts, e, counts[e], hist);
  }
  if (threadIdx.x == 0) expert_offsets[num_experts] = total;
  __syncthreads();
  walk_scatter(segment_ids, num_pairs, walkers, num_experts, 0, hist, sorted_pairs, pair_rows);
  pdl_trigger();
}

// Pass 1: segment_counts[s * E + e] = pairs of segment s routed to expert e.
__global__ void layout_count_kernel(const int32_t* ids, int64_t num_pairs, int num_experts, int32_t* segment_counts) {
  extern __shared__ int32_t shared_ints[];
  int32_t* counts = shared_ints;
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kLayoutSegment;
  const int64_t end = std::min(begin + kLayoutSegment, num_pairs);
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) counts[e] = 0;
  __syncthreads();
  for (int64_t pair = begin + threadIdx.x; pair < end; pair += blockDim.x) {
    const int expert = ids[pair];
    if (expert >= 0 && expert < num_experts) atomicAdd(&counts[expert], 1);
  }
  __syncthreads();
  int32_t* out = segment_counts + static_cast<int64_t>(blockIdx.x) * num_experts;
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) out[e] = counts[e];
}

// Pass 2, one block: per expert, an exclusive scan over segments in place (segment_counts becomes
// the first row of each (segment, expert) relative to the expert's first row), then an exclusive
// scan of the expert totals into expert_offsets. Shared memory: totals [E].
__global__ void layout_scan_kernel(int32_t* segment_counts, int num_experts, int num_segments,
                                   int32_t* expert_offsets) {
  extern __shared__ int32_t shared_ints[];
  __shared__ int32_t scratch[33];
  int32_t* totals = shared_ints;
  constexpr int kBatch = 8;  // loads in flight per thread (the column is read and written in place)
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    int32_t running = 0;
    for (int s0 = 0; s0 < num_segments; s0 += kBatch) {
      int32_t value[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        value[b] = s0 + b < num_segments ? segment_counts[static_cast<int64_t>(s0 + b) * num_experts + e] : 0;
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        if (s0 + b < num_segments) segment_counts[static_cast<int64_t>(s0 + b) * num_experts + e] = running;
        running += value[b];
      }
    }
    totals[e] = running;
  }
  __syncthreads();
  const int32_t total = block_exclusive_scan(totals, num_experts, scratch);
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) expert_offsets[e] = totals[e];
  if (threadIdx.x == 0) expert_offsets[num_experts] = total;
}

// Pass 3: one block per segment scatters its pairs, stably, from the scanned offsets.
// Shared memory: hist [walkers, E], segment ids [kLayoutSegment].
__global__ void layout_scatter_kernel(const int32_t* ids, int64_t num_pairs, int num_experts, int walkers,
                                      const int32_t* segment_offsets, const int32_t* expert_offsets,
                                      int32_t* sorted_pairs, int32_t* pair_rows) {
  extern __shared__ int32_t shared_ints[];
  int32_t* hist = shared_ints;
  int32_t* segment_ids = hist + static_cast<int64_t>(walkers) * num_experts;
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kLayoutSegment;
  const int count = static_cast<int>(std::min(begin + kLayoutSegment, num_pairs) - begin);
  segment_prologue(ids, begin, count, walkers, num_experts, hist, segment_ids);
  walk_count(segment_ids, count, walkers, num_experts, hist);
  __syncthreads();
  const int32_t* offsets = segment_offsets + static_cast<int64_t>(blockIdx.x) * num_experts;
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    hist_to_rows(walkers, num_experts, e, expert_offsets[e] + offsets[e], hist);
  }
  __syncthreads();
  walk_scatter(segment_ids, count, walkers, num_experts, begin, hist, sorted_pairs, pair_rows);
}

constexpr size_t align_up(size_t bytes) { return (bytes + 255) / 256 * 256; }

int64_t num_segments_for(int64_t num_pairs) {
  return std::max<int64_t>(1, (num_pairs + kLayoutSegment - 1) / kLayoutSegment);
}

// Shared memory of the layout kernels, in int32: within the default 48 KB (no opt-in needed).
constexpr int64_t kLayoutSharedInts = static_cast<int64_t>(kDefaultSharedBytes / sizeof(int32_t));
constexpr int kLayoutThreads = 256;
constexpr int kLayoutMaxWalkers = kLayoutThreads / 32;
// The scatter kernel needs at least one walker's histogram next to a whole segment of ids.
static_assert(kMaxLayoutExperts == kLayoutSharedInts - kLayoutSegment);

// Walking warps for `count` pairs when `fixed_ints` of the shared memory are taken and each walker
// needs E ints; 0 when not even one fits.
int layout_walkers(int64_t count, int num_experts, int64_t fixed_ints) {
  const int64_t fit = (kLayoutSharedInts - fixed_ints) / num_experts;
  const int64_t useful = std::max<int64_t>(1, (count + 31) / 32);
  return static_cast<int>(std::clamp<int64_t>(std::min<int64_t>(fit, useful), 0, kLayoutMaxWalkers));
}

}  // namespace

size_t moe_layout_workspace_bytes(int64_t max_tokens, int top_k, int num_experts) {
  const int64_t num_pairs = max_tokens * top_k;
  const int64_t num_segments = num_segments_for(num_pairs);
  return align_up((num_experts + 1) * sizeof(int32_t)) + 2 * align_up(num_pairs * sizeof(int32_t)) +
         align_up(static_cast<size_t>(num_experts) * num_segments * sizeof(int32_t));
}

MoeLayout build_moe_layout(const int32_t* topk_ids, int64_t num_tokens, int top_k, int num_experts, void* workspace,
                           size_t workspace_bytes, cudaStream_t stream) {
  LATENTMOE_CHECK(num_experts >= 1 && num_experts <= kMaxLayoutExperts, "CUDA MoE layout: ", num_experts,
                  " experts is outside 1..", kMaxLayoutExperts);
  LATENTMOE_CHECK(top_k >= 1, "CUDA MoE layout: top_k ", top_k, " must be positive");
  const size_t needed = moe_layout_workspace_bytes(num_tokens, top_k, num_experts);
  LATENTMOE_CHECK(workspace_bytes >= needed, "CUDA MoE layout: workspace of ", workspace_bytes, " bytes, ", needed,
                  " needed for ", num_tokens, " tokens");
  const int64_t num_pairs = num_tokens * top_k;
  LATENTMOE_CHECK(num_pairs < INT_MAX, "CUDA MoE layout: ", num_pairs, " (token, expert) pairs exceed int32");
  const int64_t num_segments = num_segments_for(num_pairs);
  auto* base = static_cast<char*>(workspace);
  auto* expert_offsets = reinterpret_cast<int32_t*>(base);
  base += align_up((num_experts + 1) * sizeof(int32_t));
  auto* sorted_pairs = reinterpret_cast<int32_t*>(base);
  base += align_up(num_pairs * sizeof(int32_t));
  auto* pair_rows = reinterpret_cast<int32_t*>(base);
  base += align_up(num_pairs * sizeof(int32_t));
  auto* segment_counts = reinterpret_cast<int32_t*>(base);

  MoeLayout layout;
  layout.expert_offsets = expert_offsets;
  layout.sorted_pairs = sorted_pairs;
  layout.pair_rows = pair_rows;
  layout.num_experts = num_experts;
  layout.top_k = top_k;
  layout.num_tokens = num_tokens;

  if (num_pairs == 0) {
    LATENTMOE_CUDA_CHECK(cudaMemsetAsync(expert_offsets, 0, (num_experts + 1) * sizeof(int32_t), stream));
    return layout;
  }
  // One block when the pairs fit one segment and counts, histograms and ids fit shared memory.
  // (+64: room for the kernel's 33 ints of static shared memory.)
  const int fused_walkers =
      num_segments == 1 ? layout_walkers(num_pairs, num_experts, num_experts + num_pairs + 64) : 0;
  if (fused_walkers >= 1) {
    const size_t shared_bytes =
        static_cast<size_t>((1 + fused_walkers) * static_cast<int64_t>(num_experts) + num_pairs) * sizeof(int32_t);
    launch_dependent("layout_fused_kernel", layout_fused_kernel, 1, kLayoutThreads, shared_bytes, stream, topk_ids,
                     static_cast<int>(num_pairs), num_experts, fused_walkers, expert_offsets, sorted_pairs, pair_rows);
    return layout;
  }
  const auto segments = static_cast<unsigned>(num_segments);
  const size_t counts_bytes = static_cast<size_t>(num_experts) * sizeof(int32_t);
  layout_count_kernel<<<segments, kLayoutThreads, counts_bytes, stream>>>(topk_ids, num_pairs, num_experts,
                                                                          segment_counts);
  LATENTMOE_CUDA_CHECK_LAUNCH("layout_count_kernel");
  layout_scan_kernel<<<1, 1024, counts_bytes, stream>>>(segment_counts, num_experts, static_cast<int>(num_segments),
                                                        expert_offsets);
  LATENTMOE_CUDA_CHECK_LAUNCH("layout_scan_kernel");
  const int walkers = layout_walkers(kLayoutSegment, num_experts, kLayoutSegment);
  const size_t scatter_bytes =
      static_cast<size_t>(walkers * static_cast<int64_t>(num_experts) + kLayoutSegment) * sizeof(int32_t);
  layout_scatter_kernel<<<segments, kLayoutThreads, scatter_bytes, stream>>>(
      topk_ids, num_pairs, num_experts, walkers, segment_counts, expert_offsets, sorted_pairs, pair_rows);
  LATENTMOE_CUDA_CHECK_LAUNCH("layout_scatter_kernel");
  return layout;
}

}  // namespace latentmoe::cuda

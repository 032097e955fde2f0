#include <algorithm>
#include <climits>
#include <cmath>

#include "cuda/common/cuda_check.h"
#include "cuda/common/debug_check.h"
#include "cuda/common/pdl.cuh"
#include "cuda/kernels/routing.h"
#include "latentmoe/error.h"

namespace latentmoe::cuda {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr size_t kDefaultSharedBytes = 48 * 1024;

// --- route --------------------------------------------------------------------------------------

struct RouteKernelParams {
  RouteArgs args;
  int num_outputs = 0;  // E + Z
  int num_experts = 0;  // E
  int top_k = 0;
  int n_group = 1;
  int topk_group = 1;
  bool softmax = false;
  bool renormalize = true;
  float scaling = 1.0f;
  int floats_per_warp = 0;
};

__device__ __forceinline__ float finite_order(float value) { return isnan(value) ? -INFINITY : value; }

// a ranks before b: the higher value, the lower index on a tie; NaN never ranks before anything.
__device__ __forceinline__ bool ranks_before(float value_a, int a, float value_b, int b) {
  return value_a > value_b || (value_a == value_b && a < b);
}

// Every lane ends with the warp's best (value, index); NaN entries are never chosen.
__device__ __forceinline__ void warp_best(float& value, int& index) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float other_value = __shfl_xor_sync(kFullMask, value, offset);
    const int other_index = __shfl_xor_sync(kFullMask, index, offset);
    if (ranks_before(other_value, other_index, value, index)) {
      value = other_value;
      index = other_index;
    }
  }
}

// The best of entries[lane], entries[lane + 32], ... (NaN = not a candidate).
__device__ __forceinline__ int warp_argmax(const float* entries, int count, int lane) {
  float best_value = -INFINITY;
  int best_index = INT_MAX;
  for (int i = lane; i < count; i += 32) {
    const float value = entries[i];
    if (ranks_before(value, i, best_value, best_index)) {
      best_value = value;
      best_index = i;
    }
  }
  warp_best(best_value, best_index);
  return best_index;
}

// One warp per token. Shared memory per warp: scores [n], biased [n], group scores [n_group].
__global__ void route_kernel(RouteKernelParams p) {
  extern __shared__ float shared[];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + warp;
  if (t >= p.args.num_tokens) return;  // whole warps leave; the kernel has no block barrier
  const int n = p.num_outputs;
  float* score = shared + static_cast<int64_t>(warp) * p.floats_per_warp;
  float* biased = score + n;
  float* group_score = biased + n;
  const float* logits = p.args.logits + t * p.args.ld_logits;

  // 1. Scores, each computed in double and rounded once (NaN logits count as -inf).
  if (p.softmax) {
    float largest = -INFINITY;
    for (int i = lane; i < n; i += 32) largest = fmaxf(largest, finite_order(logits[i]));
    for (int offset = 16; offset > 0; offset >>= 1)
      largest = fmaxf(largest, __shfl_xor_sync(kFullMask, largest, offset));
    if (largest == -INFINITY) {
      for (int i = lane; i < n; i += 32) score[i] = 0.0f;
    } else if (isinf(largest)) {
      int num_inf = 0;
      for (int i = lane; i < n; i += 32) num_inf += logits[i] == largest ? 1 : 0;
      for (int offset = 16; offset > 0; offset >>= 1) num_inf += __shfl_xor_sync(kFullMask, num_inf, offset);
      const float share = 1.0f / static_cast<float>(num_inf);
      for (int i = lane; i < n; i += 32) score[i] = logits[i] == largest ? share : 0.0f;
    } else {
      double sum = 0.0;
      for (int i = lane; i < n; i += 32) {
        const float x = logits[i];
        sum += isnan(x) ? 0.0 : exp(static_cast<double>(x) - static_cast<double>(largest));
      }
      for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(kFullMask, sum, offset);
      for (int i = lane; i < n; i += 32) {
        const float x = logits[i];
        const double e = isnan(x) ? 0.0 : exp(static_cast<double>(x) - static_cast<double>(largest));
        score[i] = static_cast<float>(e / sum);
      }
    }
  } else {
    for (int i = lane; i < n; i += 32) {
      const float x = logits[i];
      const double xd = isnan(x) ? -INFINITY : static_cast<double>(x);
      score[i] = static_cast<float>(1.0 / (1.0 + exp(-xd)));
    }
  }
  // Selection scores in fp32 (each lane reads back only what it wrote).
  for (int i = lane; i < n; i += 32) {
    const float value = p.args.bias != nullptr ? score[i] + p.args.bias[i] : score[i];
    biased[i] = finite_order(value);
  }
  __syncwarp();

  // 2. Group limit: keep the topk_group groups whose two best biased scores sum highest; the
  // others' experts are marked NaN (never chosen). A kept group's score is marked NaN too.
  if (p.n_group > 1 && p.topk_group < p.n_group) {
    const int group_size = n / p.n_group;
    for (int g = lane; g < p.n_group; g += 32) {
      const float* member = biased + static_cast<int64_t>(g) * group_size;
      float first = -INFINITY, second = -INFINITY;
      for (int i = 0; i < group_size; ++i) {
        const float value = member[i];
        if (value > first) {
          second = first;
          first = value;
        } else if (value > second) {
          second = value;
        }
      }
      group_score[g] = finite_order(group_size == 1 ? first : first + second);
    }
    __syncwarp();
    for (int s = 0; s < p.topk_group; ++s) {
      const int best = warp_argmax(group_score, p.n_group, lane);
      __syncwarp();
      if (lane == 0 && best < p.n_group) group_score[best] = NAN;
      __syncwarp();
    }
    for (int i = lane; i < n; i += 32) {
      if (!isnan(group_score[i / group_size])) biased[i] = NAN;
    }
    __syncwarp();
  }

  // 3. Top-k in selection order; lane j keeps the j-th choice.
  int my_id = 0;
  for (int j = 0; j < p.top_k; ++j) {
    const int best = warp_argmax(biased, n, lane);
    if (lane == j) my_id = best;
    __syncwarp();
    if (lane == 0 && best < n) biased[best] = NAN;
    __syncwarp();
  }

  // 4. Weights: the unbiased scores, renormalised in double (sum in choice order), scaled.
  const float my_score = lane < p.top_k ? score[my_id] : 0.0f;
  double sum = 0.0;
  for (int j = 0; j < p.top_k; ++j) sum += static_cast<double>(__shfl_sync(kFullMask, my_score, j));
  const double denominator = p.renormalize ? sum + 1e-20 : 1.0;
  const float weight = static_cast<float>(static_cast<double>(my_score) / denominator * static_cast<double>(p.scaling));
  double zero_sum = 0.0;
  for (int j = 0; j < p.top_k; ++j) {
    const float w = __shfl_sync(kFullMask, weight, j);
    const int id = __shfl_sync(kFullMask, my_id, j);
    if (id >= p.num_experts) zero_sum += static_cast<double>(w);
  }
  if (lane < p.top_k) {
    p.args.topk_ids[t * p.top_k + lane] = my_id;
    p.args.topk_weights[t * p.top_k + lane] = weight;
  }
  if (lane == 0) p.args.zero_weight_sum[t] = static_cast<float>(zero_sum);
}

// --- route, one block per token ------------------------------------------------------------------
//
// The decode path: the token's E+Z outputs are spread over the block (kSlots per thread, output
// i = s * blockDim + thread), scores live in registers, and the top-k is found without k dependent
// arg-max rounds: the k-th largest selection key is built bit by bit (32 rounds of one
// __syncthreads_count each), ties on that key are cut at the lowest indices by a second bit-wise
// search, and the k chosen entries are ordered by rank among themselves in one warp.

// A total order on fp32 selection scores as unsigned keys (bigger key = ranks first). -0 counts as
// +0 (the reference compares with ==); NaN was already mapped to -inf. Key 0 is below every score
// (-inf has key 0x007fffff) and marks "not a candidate".
__device__ __forceinline__ uint32_t order_key(float value) {
  const uint32_t bits = __float_as_uint(value == 0.0f ? 0.0f : value);
  return (bits & 0x80000000u) != 0 ? ~bits : (bits | 0x80000000u);
}

// Block reductions: every thread gets the result (warps combined in warp order: deterministic).
// Each call site passes its own scratch so that no trailing barrier is needed.
__device__ __forceinline__ float block_max(float value, float* scratch) {
  for (int offset = 16; offset > 0; offset >>= 1) value = fmaxf(value, __shfl_xor_sync(kFullMask, value, offset));
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = value;
  __syncthreads();
  float result = scratch[0];
  for (int w = 1; w < static_cast<int>(blockDim.x >> 5); ++w) result = fmaxf(result, scratch[w]);
  return result;
}

__device__ __forceinline__ double block_sum(double value, double* scratch) {
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(kFullMask, value, offset);
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = value;
  __syncthreads();
  double result = 0.0;
  for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) result += scratch[w];
  return result;
}

template <int kSlots>
__global__ void __launch_bounds__(1024) route_block_kernel(RouteKernelParams p) {
  extern __shared__ float shared[];  // group-limited only: biased [n], group scores [n_group], kept [n_group]
  __shared__ float max_scratch[32];
  __shared__ double sum_scratch[32];
  __shared__ uint32_t chosen_key[kMaxRouteTopK];
  __shared__ int chosen_index[kMaxRouteTopK];
  __shared__ float chosen_score[kMaxRouteTopK];
  __shared__ int ordered_index[kMaxRouteTopK];
  __shared__ float ordered_score[kMaxRouteTopK];
  __shared__ int num_chosen;

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int n = p.num_outputs;
  const int64_t t = blockIdx.x;
  const float* logits = p.args.logits + t * p.args.ld_logits;
  if (tid == 0) num_chosen = 0;  // read after many barriers below
  pdl_wait();  // a programmatic dependent (src/cuda/common/pdl.cuh); the logits may come from the kernel before

  float x[kSlots];
#pragma unroll
  for (int s = 0; s < kSlots; ++s) {
    const int i = s * blockDim.x + tid;
    x[s] = i < n ? logits[i] : NAN;  // past the end: NaN, which counts as -inf / score 0
  }

  // 1. Scores in double, rounded once (as the warp kernel and the reference).
  float score[kSlots];
  if (p.softmax) {
    float local = -INFINITY;
#pragma unroll
    for (int s = 0; s < kSlots; ++s) local = fmaxf(local, finite_order(x[s]));
    const float largest = block_max(local, max_scratch);
    if (largest == -INFINITY) {
#pragma unroll
      for (int s = 0; s < kSlots; ++s) score[s] = 0.0f;
    } else if (isinf(largest)) {
      int num_inf = 0;
#pragma unroll
      for (int s = 0; s < kSlots; ++s) num_inf += __syncthreads_count(x[s] == largest);
      const float share = 1.0f / static_cast<float>(num_inf);
#pragma unroll
      for (int s = 0; s < kSlots; ++s) score[s] = x[s] == largest ? share : 0.0f;
    } else {
      double e[kSlots];
      double local_sum = 0.0;
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        e[s] = isnan(x[s]) ? 0.0 : exp(static_cast<double>(x[s]) - static_cast<double>(largest));
        local_sum += e[s];
      }
      const double sum = block_sum(local_sum, sum_scratch);
#pragma unroll
      for (int s = 0; s < kSlots; ++s) score[s] = static_cast<float>(e[s] / sum);
    }
  } else {
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      const double xd = isnan(x[s]) ? -INFINITY : static_cast<double>(x[s]);
      score[s] = static_cast<float>(1.0 / (1.0 + exp(-xd)));
    }
  }

  // 2. Selection keys (0 = not a candidate).
  float biased[kSlots];
  uint32_t key[kSlots];
#pragma unroll
  for (int s = 0; s < kSlots; ++s) {
    const int i = s * blockDim.x + tid;
    biased[s] = i < n ? finite_order(p.args.bias != nullptr ? score[s] + p.args.bias[i] : score[s]) : -INFINITY;
    key[s] = i < n ? order_key(biased[s]) : 0u;
  }
  if (p.n_group > 1 && p.topk_group < p.n_group) {
    float* biased_s = shared;
    float* group_score = biased_s + n;
    int* kept = reinterpret_cast<int*>(group_score + p.n_group);
    const int group_size = n / p.n_group;
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      const int i = s * blockDim.x + tid;
      if (i < n) biased_s[i] = biased[s];
    }
    __syncthreads();
    // A group's score: the sum of its two highest biased scores (a multiset top-2, so the order
    // members are visited in does not matter), one warp per group.
    const int warp = tid >> 5, num_warps = blockDim.x >> 5;
    for (int g = warp; g < p.n_group; g += num_warps) {
      const float* member = biased_s + static_cast<int64_t>(g) * group_size;
      float first = -INFINITY, second = -INFINITY;
      for (int i = lane; i < group_size; i += 32) {
        const float value = member[i];
        if (value > first) {
          second = first;
          first = value;
        } else if (value > second) {
          second = value;
        }
      }
      for (int offset = 16; offset > 0; offset >>= 1) {
        const float other_first = __shfl_xor_sync(kFullMask, first, offset);
        const float other_second = __shfl_xor_sync(kFullMask, second, offset);
        const float top = fmaxf(first, other_first);
        second = fmaxf(fminf(first, other_first), fmaxf(second, other_second));
        first = top;
      }
      if (lane == 0) group_score[g] = finite_order(group_size == 1 ? first : first + second);
    }
    __syncthreads();
    // A group is kept when fewer than topk_group groups rank before it (ties to the lower group).
    for (int g = tid; g < p.n_group; g += blockDim.x) {
      const float mine = group_score[g];
      int rank = 0;
      for (int h = 0; h < p.n_group; ++h) rank += ranks_before(group_score[h], h, mine, g) ? 1 : 0;
      kept[g] = rank < p.topk_group ? 1 : 0;
    }
    __syncthreads();
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      const int i = s * blockDim.x + tid;
      if (i < n && kept[i / group_size] == 0) key[s] = 0u;
    }
  }

  // 3. The k-th largest key, built from the top bit down: keep a bit when at least k keys are >= it.
  const int k = p.top_k;
  uint32_t threshold = 0;
  for (int bit = 31; bit >= 0; --bit) {
    const uint32_t candidate = threshold | (1u << bit);
    int count = 0;
#pragma unroll
    for (int s = 0; s < kSlots; ++s) count += __syncthreads_count(key[s] >= candidate);
    if (count >= k) threshold = candidate;
  }
  int greater = 0, tied = 0;
#pragma unroll
  for (int s = 0; s < kSlots; ++s) {
    greater += __syncthreads_count(key[s] > threshold);
    tied += __syncthreads_count(key[s] == threshold);
  }
  // Of the entries tied at the threshold, the `needed` lowest indices are chosen: find the largest
  // index bound whose count of tied indices below it stays under `needed` (the needed-th index).
  const int needed = k - greater;
  int last_index = INT_MAX;
  if (needed < tied) {
    int bound = 0;
    for (int bit = 31 - __clz(n); bit >= 0; --bit) {
      const int candidate = bound | (1 << bit);
      int count = 0;
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        count += __syncthreads_count(key[s] == threshold && static_cast<int>(s * blockDim.x + tid) < candidate);
      }
      if (count < needed) bound = candidate;
    }
    last_index = bound;
  }

  // 4. The k chosen entries, in any order, then each one's rank among them.
#pragma unroll
  for (int s = 0; s < kSlots; ++s) {
    const int i = s * blockDim.x + tid;
    if (key[s] > threshold || (key[s] == threshold && i <= last_index)) {
      const int slot = atomicAdd(&num_chosen, 1);
      chosen_key[slot] = key[s];
      chosen_index[slot] = i;
      chosen_score[slot] = score[s];
    }
  }
  __syncthreads();
  pdl_trigger();  // the rest is one warp's ranking and stores
  if (tid >= 32) return;
  {
    const uint32_t my_key = lane < k ? chosen_key[lane] : 0u;
    const int my_index = lane < k ? chosen_index[lane] : INT_MAX;
    int rank = 0;
    for (int m = 0; m < k; ++m) {
      const uint32_t other = chosen_key[m];
      rank += (other > my_key || (other == my_key && chosen_index[m] < my_index)) ? 1 : 0;
    }
    if (lane < k) {
      ordered_index[rank] = my_index;
      ordered_score[rank] = chosen_score[lane];
    }
  }
  __syncwarp();
  const int my_id = lane < k ? ordered_index[lane] : 0;
  const float my_score = lane < k ? ordered_score[lane] : 0.0f;

  // 5. Weights, exactly as the warp kernel.
  double sum = 0.0;
  for (int j = 0; j < k; ++j) sum += static_cast<double>(__shfl_sync(kFullMask, my_score, j));
  const double denominator = p.renormalize ? sum + 1e-20 : 1.0;
  const float weight = static_cast<float>(static_cast<double>(my_score) / denominator * static_cast<double>(p.scaling));
  double zero_sum = 0.0;
  for (int j = 0; j < k; ++j) {
    const float w = __shfl_sync(kFullMask, weight, j);
    const int id = __shfl_sync(kFullMask, my_id, j);
    if (id >= p.num_experts) zero_sum += static_cast<double>(w);
  }
  if (lane < k) {
    p.args.topk_ids[t * k + lane] = my_id;
    p.args.topk_weights[t * k + lane] = weight;
  }
  if (lane == 0) p.args.zero_weight_sum[t] = static_cast<float>(zero_sum);
}

// --- layout -------------------------------------------------------------------------------------

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

void launch_route(const ::latentmoe::detail::RoutingParams& params, const RouteArgs& args, size_t max_shared_bytes,
                  cudaStream_t stream, RoutePath path) {
  const int64_t num_outputs = params.num_experts + params.num_zero_experts;
  // The runner validated the config (LayerConfig::validate); debug builds check it again.
  LATENTMOE_DEBUG_CHECK(
      params.num_experts >= 0 && params.num_zero_experts >= 0 && num_outputs >= 1 && num_outputs <= INT_MAX / 4,
      "CUDA routing: invalid expert counts E=", params.num_experts, " Z=", params.num_zero_experts);
  // The kernels' limit (kMaxRouteTopK), which the config does not know.
  LATENTMOE_CHECK(params.top_k >= 1 && params.top_k <= std::min<int64_t>(num_outputs, kMaxRouteTopK),
                  "CUDA routing: top_k ", params.top_k, " is outside 1..",
                  std::min<int64_t>(num_outputs, kMaxRouteTopK));
  const int64_t n_group = std::max<int64_t>(params.n_group, 1);
  if (n_group > 1) {
    LATENTMOE_DEBUG_CHECK(num_outputs % n_group == 0, "CUDA routing: n_group ", n_group,
                          " does not divide E+Z = ", num_outputs);
    LATENTMOE_DEBUG_CHECK(params.topk_group >= 1 && params.topk_group <= n_group, "CUDA routing: topk_group ",
                          params.topk_group, " is outside 1..", n_group);
    LATENTMOE_DEBUG_CHECK(params.top_k <= params.topk_group * (num_outputs / n_group), "CUDA routing: top_k ",
                          params.top_k, " exceeds the experts of ", params.topk_group, " groups");
  }
  const bool group_limited = n_group > 1 && params.topk_group < n_group;
  // The block kernel's dynamic shared memory (group-limited only: biased [n], group scores and kept
  // flags [n_group] each), next to about 1.2 KB of static shared memory, within the default 48 KB.
  const size_t block_shared_bytes = group_limited ? static_cast<size_t>(num_outputs + 2 * n_group) * sizeof(float) : 0;
  const bool block_fits = num_outputs <= kRouteBlockMaxOutputs && block_shared_bytes + 2048 <= kDefaultSharedBytes;
  if (path == RoutePath::block) {
    LATENTMOE_CHECK(block_fits, "CUDA routing: the block kernel takes at most ", kRouteBlockMaxOutputs,
                    " router outputs (and fewer with many groups), not ", num_outputs, " in ", n_group, " groups");
  }
  if (args.num_tokens == 0) return;

  RouteKernelParams p;
  p.args = args;
  p.num_outputs = static_cast<int>(num_outputs);
  p.num_experts = static_cast<int>(params.num_experts);
  p.top_k = static_cast<int>(params.top_k);
  p.n_group = static_cast<int>(n_group);
  p.topk_group = static_cast<int>(n_group > 1 ? params.topk_group : 1);
  p.softmax = params.scoring == ScoringFunc::softmax;
  p.renormalize = params.norm_topk_prob;
  p.scaling = params.routed_scaling_factor;

  const bool use_block = path == RoutePath::block ||
                         (path == RoutePath::automatic && block_fits && args.num_tokens <= kRouteBlockMaxTokens);
  if (use_block) {
    const int slots = static_cast<int>((num_outputs + 1023) / 1024);
    const int threads = static_cast<int>(((num_outputs + slots - 1) / slots + 31) / 32 * 32);
    const size_t shared_bytes = block_shared_bytes;
    const auto blocks = static_cast<unsigned>(args.num_tokens);
    auto* kernel = slots == 1   ? route_block_kernel<1>
                   : slots == 2 ? route_block_kernel<2>
                   : slots == 3 ? route_block_kernel<3>
                                : route_block_kernel<4>;
    launch_dependent("route_block_kernel", kernel, blocks, threads, shared_bytes, stream, p);
    return;
  }

  p.floats_per_warp = static_cast<int>(2 * num_outputs + (n_group > 1 ? n_group : 0));
  const size_t bytes_per_warp = static_cast<size_t>(p.floats_per_warp) * sizeof(float);
  const size_t limit = std::max(max_shared_bytes, kDefaultSharedBytes);
  LATENTMOE_CHECK(bytes_per_warp <= limit, "CUDA routing: E+Z = ", num_outputs,
                  " router outputs need more shared memory (", bytes_per_warp, " bytes) than a block may use (", limit,
                  ")");
  int warps = static_cast<int>(std::min<int64_t>(4, args.num_tokens));
  while (warps > 1 && warps * bytes_per_warp > kDefaultSharedBytes) --warps;
  const size_t shared_bytes = warps * bytes_per_warp;
  if (shared_bytes > kDefaultSharedBytes) {
    LATENTMOE_CUDA_CHECK(cudaFuncSetAttribute(route_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              static_cast<int>(shared_bytes)));
  }
  const auto blocks = static_cast<unsigned>((args.num_tokens + warps - 1) / warps);
  route_kernel<<<blocks, warps * 32, shared_bytes, stream>>>(p);
  LATENTMOE_CUDA_CHECK_LAUNCH("route_kernel");
}

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

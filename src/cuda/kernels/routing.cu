// Top-k routing on the device: from one token's router logits, the scores (sigmoid or softmax, in
// double, rounded once to fp32), the biased selection scores (fp32, NaN ordered as -inf), the group
// limit (keep the topk_group groups whose two best biased scores sum highest), the top-k experts in
// selection order (ties to the lower group or expert index), their weights (the unbiased scores,
// renormalised in double with +1e-20, scaled) and the summed weights of the zero experts (ids >= E).
// The rules are src/cpu/routing.cpp's: both kernels choose its ids, ties included, and its weights
// to within 1e-6 relative (tests/cuda/test_cuda_backend.cpp checks each kernel against it).
//
// Two kernels, chosen by launch_route (routing.h: kRouteBlockMaxOutputs, kRouteBlockMaxTokens):
//   route_block_kernel<kSlots>  one block per token (grid = tokens), kSlots = ceil(n / 1024) outputs
//                               per thread in registers (n = E+Z <= 4096, so 1..4), threads = ceil(n /
//                               kSlots) rounded up to a warp. Dynamic shared memory only when
//                               group-limited (biased [n], group scores and kept flags [n_group]), next
//                               to about 1 KB of static scratch, within the default 48 KB. The k-th largest
//                               selection key is built bit by bit with __syncthreads_count (its latency
//                               does not grow with k), ties at that key cut at the lowest indices, and
//                               one warp orders the k chosen. A programmatic dependent (pdl.cuh): it
//                               reads the logits only after pdl_wait and triggers once the k are chosen.
//   route_kernel                one warp per token, up to 4 warps a block (fewer when their shared
//                               memory would pass 48 KB); per warp 2 n floats of dynamic shared memory
//                               (scores, biased scores), plus n_group (group scores) when n_group > 1,
//                               opted in above 48 KB up to the device's limit (else an Error); k
//                               dependent arg-max rounds. A plain launch (<<<>>>). No block barrier:
//                               a warp past the last token leaves whole.
// Invariants of both: top_k <= kMaxRouteTopK = 32, so one warp holds the choices (lane j the j-th,
// which also orders the sums in double); every reduction combines in a fixed order (deterministic);
// NaN logits count as -inf and are never chosen ahead of a number; the launch shapes depend only on
// the routing parameters and the token count, never on the data.
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

struct TopTwo {
  float first;
  float second;
};

// The two largest of values[begin], values[begin + stride], ... below values[end], as a multiset (a
// value present twice is both; -inf where fewer than two are visited): the members of a group one
// thread scans, its score being the sum of its two best biased scores. Written with local floats:
// updating a TopTwo (or floats by reference) in the loop made nvcc 13.0 compile route_block_kernel
// differently (branches for selects, a 24-byte stack frame at kSlots = 3); as written, the route
// kernels' SASS is what it was with the loop written out in each kernel.
__device__ __forceinline__ TopTwo top_two(const float* values, int begin, int end, int stride) {
  float first = -INFINITY, second = -INFINITY;
  for (int i = begin; i < end; i += stride) {
    const float value = values[i];
    if (value > first) {
      second = first;
      first = value;
    } else if (value > second) {
      second = value;
    }
  }
  return {first, second};
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
      const TopTwo best = top_two(biased + static_cast<int64_t>(g) * group_size, 0, group_size, 1);
      group_score[g] = finite_order(group_size == 1 ? best.first : best.first + best.second);
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
      const TopTwo mine = top_two(biased_s + static_cast<int64_t>(g) * group_size, lane, group_size, 32);
      float first = mine.first, second = mine.second;
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

}  // namespace latentmoe::cuda

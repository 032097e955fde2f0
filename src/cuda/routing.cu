#include <algorithm>
#include <climits>
#include <cmath>

#include "cuda/cuda_check.h"
#include "cuda/routing.cuh"
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
    for (int offset = 16; offset > 0; offset >>= 1) largest = fmaxf(largest, __shfl_xor_sync(kFullMask, largest, offset));
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

// --- layout -------------------------------------------------------------------------------------

// Exclusive scan of data[0, count) in place by the whole block (blockDim a multiple of 32, at most
// 1024); returns the total. `scratch` holds 33 ints.
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

// One warp walks pairs [begin, end) in order, 32 at a time; `cursor[e]` is the next grouped row of
// expert e. Lanes of one expert in a step take consecutive rows in lane (= pair) order.
__device__ void scatter_pairs(const int32_t* ids, int64_t begin, int64_t end, int num_experts, int32_t* cursor,
                              int32_t* sorted_pairs, int32_t* pair_rows) {
  const int lane = threadIdx.x & 31;
  for (int64_t base = begin; base < end; base += 32) {
    const int64_t pair = base + lane;
    const bool in_range = pair < end;
    const int expert = in_range ? ids[pair] : -1;
    const bool real = in_range && expert >= 0 && expert < num_experts;
    const unsigned peers = __match_any_sync(kFullMask, real ? expert : -1);
    const int leader = __ffs(peers) - 1;
    const int rank = __popc(peers & ((1u << lane) - 1u));
    int start = 0;
    if (real && lane == leader) start = cursor[expert];
    start = __shfl_sync(kFullMask, start, leader);
    __syncwarp();
    if (real && lane == leader) cursor[expert] = start + __popc(peers);
    __syncwarp();
    if (real) {
      const int32_t row = start + rank;
      sorted_pairs[row] = static_cast<int32_t>(pair);
      pair_rows[pair] = row;
    } else if (in_range) {
      pair_rows[pair] = -1;
    }
  }
}

__device__ void count_pairs(const int32_t* ids, int64_t begin, int64_t end, int num_experts, int32_t* counts) {
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) counts[e] = 0;
  __syncthreads();
  for (int64_t pair = begin + threadIdx.x; pair < end; pair += blockDim.x) {
    const int expert = ids[pair];
    if (expert >= 0 && expert < num_experts) atomicAdd(&counts[expert], 1);
  }
  __syncthreads();
}

// All pairs in one segment: count, scan and scatter in one block.
__global__ void layout_fused_kernel(const int32_t* ids, int64_t num_pairs, int num_experts, int32_t* expert_offsets,
                                    int32_t* sorted_pairs, int32_t* pair_rows) {
  extern __shared__ int32_t counts[];
  __shared__ int32_t scratch[33];
  count_pairs(ids, 0, num_pairs, num_experts, counts);
  const int32_t total = block_exclusive_scan(counts, num_experts, scratch);
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) expert_offsets[e] = counts[e];
  if (threadIdx.x == 0) expert_offsets[num_experts] = total;
  __syncthreads();  // every read of counts above happens before warp 0 moves the cursors
  if (threadIdx.x < 32) scatter_pairs(ids, 0, num_pairs, num_experts, counts, sorted_pairs, pair_rows);
}

// Pass 1: segment_counts[e * num_segments + s] = pairs of segment s routed to expert e.
__global__ void layout_count_kernel(const int32_t* ids, int64_t num_pairs, int num_experts, int num_segments,
                                    int32_t* segment_counts) {
  extern __shared__ int32_t counts[];
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kLayoutSegment;
  const int64_t end = std::min(begin + kLayoutSegment, num_pairs);
  count_pairs(ids, begin, end, num_experts, counts);
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    segment_counts[static_cast<int64_t>(e) * num_segments + blockIdx.x] = counts[e];
  }
}

// Pass 2: exclusive scan over (expert, segment) in place; expert_offsets from it.
__global__ void layout_scan_kernel(int32_t* segment_counts, int num_experts, int num_segments,
                                   int32_t* expert_offsets) {
  __shared__ int32_t scratch[33];
  const int32_t total =
      block_exclusive_scan(segment_counts, static_cast<int64_t>(num_experts) * num_segments, scratch);
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    expert_offsets[e] = segment_counts[static_cast<int64_t>(e) * num_segments];
  }
  if (threadIdx.x == 0) expert_offsets[num_experts] = total;
}

// Pass 3: one warp per segment scatters its pairs from the segment's scanned offsets.
__global__ void layout_scatter_kernel(const int32_t* ids, int64_t num_pairs, int num_experts, int num_segments,
                                      const int32_t* segment_offsets, int32_t* sorted_pairs, int32_t* pair_rows) {
  extern __shared__ int32_t cursor[];
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    cursor[e] = segment_offsets[static_cast<int64_t>(e) * num_segments + blockIdx.x];
  }
  __syncwarp();
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kLayoutSegment;
  const int64_t end = std::min(begin + kLayoutSegment, num_pairs);
  scatter_pairs(ids, begin, end, num_experts, cursor, sorted_pairs, pair_rows);
}

constexpr size_t align_up(size_t bytes) { return (bytes + 255) / 256 * 256; }

int64_t num_segments_for(int64_t num_pairs) { return std::max<int64_t>(1, (num_pairs + kLayoutSegment - 1) / kLayoutSegment); }

constexpr int kMaxLayoutExperts = static_cast<int>(kDefaultSharedBytes / sizeof(int32_t));

}  // namespace

void launch_route(const ::latentmoe::detail::RoutingParams& params, const RouteArgs& args, size_t max_shared_bytes,
                  cudaStream_t stream) {
  const int64_t num_outputs = params.num_experts + params.num_zero_experts;
  LATENTMOE_CHECK(params.num_experts >= 0 && params.num_zero_experts >= 0 && num_outputs >= 1 &&
                      num_outputs <= INT_MAX / 4,
                  "CUDA routing: invalid expert counts E=", params.num_experts, " Z=", params.num_zero_experts);
  LATENTMOE_CHECK(params.top_k >= 1 && params.top_k <= std::min<int64_t>(num_outputs, kMaxRouteTopK),
                  "CUDA routing: top_k ", params.top_k, " is outside 1..", std::min<int64_t>(num_outputs, kMaxRouteTopK));
  const int64_t n_group = std::max<int64_t>(params.n_group, 1);
  if (n_group > 1) {
    LATENTMOE_CHECK(num_outputs % n_group == 0, "CUDA routing: n_group ", n_group, " does not divide E+Z = ",
                    num_outputs);
    LATENTMOE_CHECK(params.topk_group >= 1 && params.topk_group <= n_group, "CUDA routing: topk_group ",
                    params.topk_group, " is outside 1..", n_group);
    LATENTMOE_CHECK(params.top_k <= params.topk_group * (num_outputs / n_group), "CUDA routing: top_k ", params.top_k,
                    " exceeds the experts of ", params.topk_group, " groups");
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

  const size_t counts_bytes = static_cast<size_t>(num_experts) * sizeof(int32_t);
  if (num_pairs == 0) {
    LATENTMOE_CUDA_CHECK(cudaMemsetAsync(expert_offsets, 0, (num_experts + 1) * sizeof(int32_t), stream));
  } else if (num_segments == 1) {
    layout_fused_kernel<<<1, 256, counts_bytes, stream>>>(topk_ids, num_pairs, num_experts, expert_offsets,
                                                          sorted_pairs, pair_rows);
    LATENTMOE_CUDA_CHECK_LAUNCH("layout_fused_kernel");
  } else {
    const auto segments = static_cast<unsigned>(num_segments);
    layout_count_kernel<<<segments, 256, counts_bytes, stream>>>(topk_ids, num_pairs, num_experts,
                                                                 static_cast<int>(num_segments), segment_counts);
    LATENTMOE_CUDA_CHECK_LAUNCH("layout_count_kernel");
    layout_scan_kernel<<<1, 1024, 0, stream>>>(segment_counts, num_experts, static_cast<int>(num_segments),
                                               expert_offsets);
    LATENTMOE_CUDA_CHECK_LAUNCH("layout_scan_kernel");
    layout_scatter_kernel<<<segments, 32, counts_bytes, stream>>>(topk_ids, num_pairs, num_experts,
                                                                  static_cast<int>(num_segments), segment_counts,
                                                                  sorted_pairs, pair_rows);
    LATENTMOE_CUDA_CHECK_LAUNCH("layout_scatter_kernel");
  }
  return layout;
}

}  // namespace latentmoe::cuda

// Routing and the MoE layout on the device. Host launchers; includable from C++.
//
// route: one warp per token (DESIGN section 1 step 1, the rules of src/cpu/routing.cpp): scores in
// double rounded once to fp32, biased selection scores in fp32 with NaN ordered as -inf,
// group-limited top-k (a group's score is the sum of its two best biased scores) with ties to the
// lower group or expert index, weights renormalised in double (+1e-20) and scaled, and the summed
// weights of the zero experts. The token's scores live in shared memory, so E+Z is bounded only by
// the shared memory a block may use (about 28 000 outputs on an H100/H200).
//
// build_moe_layout: the MoeLayout of cuda/moe_layout.h from topk_ids, as a stable counting sort
// over segments of kLayoutSegment pairs: per-segment expert counts, one exclusive scan over
// (expert, segment), then a scatter in which one warp walks its segment in pair order (so the rows
// of one expert are in ascending pair order, deterministically). A single fused kernel does all
// three when the pairs fit one segment (decode).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "core/backend.h"
#include "cuda/moe_layout.h"

namespace latentmoe::cuda {

inline constexpr int kMaxRouteTopK = 32;
inline constexpr int64_t kLayoutSegment = 1024;

struct RouteArgs {
  const float* logits = nullptr;  // [num_tokens, ld_logits] f32, the first E+Z columns used
  int64_t ld_logits = 0;
  const float* bias = nullptr;    // [E+Z] f32 or null
  int32_t* topk_ids = nullptr;    // [num_tokens, top_k] contiguous
  float* topk_weights = nullptr;  // [num_tokens, top_k] contiguous
  float* zero_weight_sum = nullptr;  // [num_tokens]
  int64_t num_tokens = 0;
};

// Throws Error for parameters the kernel cannot run (top_k > 32, n_group not dividing E+Z, ...).
// `max_shared_bytes` is the device's opt-in shared memory per block.
void launch_route(const ::latentmoe::detail::RoutingParams& params, const RouteArgs& args, size_t max_shared_bytes,
                  cudaStream_t stream);

// Device bytes build_moe_layout needs for up to `max_tokens` tokens.
size_t moe_layout_workspace_bytes(int64_t max_tokens, int top_k, int num_experts);

// Builds the layout of `num_tokens` tokens in `workspace` (moe_layout_workspace_bytes of at least
// num_tokens); the returned pointers point into it. Ids outside [0, E) get no row (pair_rows -1).
MoeLayout build_moe_layout(const int32_t* topk_ids, int64_t num_tokens, int top_k, int num_experts, void* workspace,
                           size_t workspace_bytes, cudaStream_t stream);

}  // namespace latentmoe::cuda

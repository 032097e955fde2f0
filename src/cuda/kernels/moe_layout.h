// The device-side layout of one forward's routed (token, slot) pairs, grouped by expert, and its
// builder (moe_layout.cu). Built from topk_ids without any host synchronisation, read by the grouped
// expert GEMMs and the combine. Host declarations; includable from C++.
//
//   pair p = t * top_k + j           the j-th choice of token t (0 <= p < num_tokens * top_k)
//   expert_offsets[e] .. [e+1]       the grouped rows of real expert e (ids >= E are zero experts
//                                    and get no rows); expert_offsets[E] = number of real pairs
//   sorted_pairs[i]                  the pair at grouped row i (rows of one expert in ascending p)
//   pair_rows[p]                     the grouped row of pair p, or -1 for a zero-expert pair
//
// Every array is sized on the host for the upper bound num_tokens * top_k; rows past
// expert_offsets[E] are unused.
//
// build_moe_layout: a stable, deterministic counting sort over segments of kLayoutSegment pairs, in
// one block when the pairs fit one segment and in three kernels otherwise (moe_layout.cu says how).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace latentmoe::cuda {

struct MoeLayout {
  const int32_t* expert_offsets = nullptr;  // [E + 1]
  const int32_t* sorted_pairs = nullptr;    // [num_tokens * top_k]
  const int32_t* pair_rows = nullptr;       // [num_tokens * top_k]
  int num_experts = 0;                      // E
  int top_k = 0;
  int64_t num_tokens = 0;  // T (host-known); the row bound is T * top_k
};

inline constexpr int64_t kLayoutSegment = 2048;
// The layout kernels keep per-warp expert histograms and a segment of ids in the default 48 KB of
// shared memory, so E is at most 48 KB / 4 - kLayoutSegment.
inline constexpr int kMaxLayoutExperts = static_cast<int>(48 * 1024 / 4 - kLayoutSegment);

// Device bytes build_moe_layout needs for up to `max_tokens` tokens.
size_t moe_layout_workspace_bytes(int64_t max_tokens, int top_k, int num_experts);

// Builds the layout of `num_tokens` tokens in `workspace` (moe_layout_workspace_bytes of at least
// num_tokens); the returned pointers point into it. Ids outside [0, E) get no row (pair_rows -1).
MoeLayout build_moe_layout(const int32_t* topk_ids, int64_t num_tokens, int top_k, int num_experts, void* workspace,
                           size_t workspace_bytes, cudaStream_t stream);

}  // namespace latentmoe::cuda

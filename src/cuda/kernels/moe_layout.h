// The device-side layout of one forward's routed (token, slot) pairs, grouped by expert. Built by
// the routing/permute kernels from topk_ids without any host synchronisation, read by the grouped
// expert GEMMs and the combine.
//
//   pair p = t * top_k + j           the j-th choice of token t (0 <= p < num_tokens * top_k)
//   expert_offsets[e] .. [e+1]       the grouped rows of real expert e (ids >= E are zero experts
//                                    and get no rows); expert_offsets[E] = number of real pairs
//   sorted_pairs[i]                  the pair at grouped row i (rows of one expert in ascending p)
//   pair_rows[p]                     the grouped row of pair p, or -1 for a zero-expert pair
//
// Every array is sized on the host for the upper bound num_tokens * top_k; rows past
// expert_offsets[E] are unused.
#pragma once

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

}  // namespace latentmoe::cuda

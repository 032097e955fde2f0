// Top-k routing on the device (routing.cu). Host launchers; includable from C++.
//
// route (DESIGN section 1 step 1, the rules of src/cpu/routing.cpp): scores in double rounded once
// to fp32, biased selection scores in fp32 with NaN ordered as -inf, group-limited top-k (a group's
// score is the sum of its two best biased scores) with ties to the lower group or expert index,
// weights renormalised in double (+1e-20) and scaled, and the summed weights of the zero experts.
// Two kernels with identical results: one block per token (E+Z <= kRouteBlockMaxOutputs; scores in
// registers, the k-th largest selection key found by a bit-wise search with __syncthreads_count, so
// its latency does not grow with k), used up to kRouteBlockMaxTokens tokens; and one warp per token
// with the scores in shared memory (k arg-max rounds; E+Z bounded only by shared memory, about
// 28 000 outputs on an H100/H200), used above that.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "core/backend.h"

namespace latentmoe::cuda {

inline constexpr int kMaxRouteTopK = 32;
// The block-per-token route kernel takes up to this many router outputs (4 per thread) ...
inline constexpr int64_t kRouteBlockMaxOutputs = 4096;
// ... and runs up to this many tokens; above, the warp-per-token kernel (less synchronisation per
// token when the whole GPU is busy). A first estimate, to be tuned by measurement.
inline constexpr int64_t kRouteBlockMaxTokens = 1024;

// Which route kernel runs: `automatic` picks by the limits above; tests force one to compare them.
enum class RoutePath { automatic, warp, block };

struct RouteArgs {
  const float* logits = nullptr;  // [num_tokens, ld_logits] f32, the first E+Z columns used
  int64_t ld_logits = 0;
  const float* bias = nullptr;       // [E+Z] f32 or null
  int32_t* topk_ids = nullptr;       // [num_tokens, top_k] contiguous
  float* topk_weights = nullptr;     // [num_tokens, top_k] contiguous
  float* zero_weight_sum = nullptr;  // [num_tokens]
  int64_t num_tokens = 0;
};

// Throws Error for parameters the kernel cannot run (top_k > 32, n_group not dividing E+Z, ...).
// `max_shared_bytes` is the device's opt-in shared memory per block.
void launch_route(const ::latentmoe::detail::RoutingParams& params, const RouteArgs& args, size_t max_shared_bytes,
                  cudaStream_t stream, RoutePath path = RoutePath::automatic);

}  // namespace latentmoe::cuda

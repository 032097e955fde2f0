#include "core/gpu_tier_support.h"

#include <algorithm>
#include <string>

namespace latentmoe::detail {

void apply_gpu_group_limits(TierSupport& support, const LayerConfig& config, DType dtype, int tp_size,
                            const GpuGroupLimits& group) {
  support.peers_reachable = group.one_shot;
  support.collectives =
      group.one_shot
          ? (group.fallback_elements > 0
                 ? "one-shot Lamport collectives on the GPU (ranks load/store each other's buffers), NCCL above "
                   "their capacity"
                 : "one-shot Lamport collectives on the GPU (ranks load/store each other's buffers)")
          : "NCCL collectives (not every rank can load/store its peers' buffers, or the one-shot path is off)";
  if (group.dtype != dtype) {
    const std::string reason = "cannot run: the GPU group carries " + std::string(dtype_name(group.dtype)) +
                               " but this layer runs in " + std::string(dtype_name(dtype));
    for (TailTier tier : kAllTailTiers) support.refuse(tier, reason);
    return;
  }
  if (!group.one_shot) {
    support.refuse(TailTier::tail_fusion,
                   "cannot run: its fused collective needs every rank to load and store its peers' buffers, and this "
                   "group's collectives go through NCCL");
  }
  const int64_t element = static_cast<int64_t>(dtype_size(dtype));
  const int64_t d = config.hidden_size, l = config.latent_size;
  // The widest tensor a tier's collectives carry per token: the all-reduces of L_r [T, l] and, with a
  // shared expert, S_r or out [T, d]; tier 0's reduce-scatter input S_r [T, d] too.
  const int64_t widest = config.has_shared_expert() ? std::max(d, l) : l;
  auto bound = [&](TailTier tier, int64_t one_shot_cols, const char* message) {
    const int64_t one_shot_tokens = group.one_shot ? group.capacity_bytes / (one_shot_cols * element) : 0;
    const int64_t nccl_tokens = group.fallback_elements / std::max<int64_t>(widest, 1);
    std::string reason;
    if (one_shot_tokens >= nccl_tokens) {
      reason = "the GPU group's one-shot buffer holds " + std::to_string(group.capacity_bytes) +
               " bytes per rank, and " + message + " is " + std::to_string(one_shot_cols) + " " +
               std::string(dtype_name(dtype)) + " per token (GpuGroupOptions::capacity_elements)";
    } else {
      reason = "the GPU group's NCCL path carries at most " + std::to_string(group.fallback_elements) +
               " elements, and its widest tensor is " + std::to_string(widest) +
               " per token (GpuGroupOptions::max_elements)";
    }
    const int64_t max_tokens = std::max(one_shot_tokens, nccl_tokens);
    if (max_tokens < 1) {
      support.refuse(tier, "cannot run: " + reason);
    } else {
      support.bound(tier, max_tokens, reason);
    }
  };
  bound(TailTier::native, widest, "its widest all-reduce");
  bound(TailTier::tail_fusion, l + d / tp_size, "its collective (L_r and a 1/tp shard of S_r)");
  bound(TailTier::allreduce_overlap, widest, "its widest all-reduce");
  bound(TailTier::column_parallel, widest, "its widest all-reduce");
}

}  // namespace latentmoe::detail

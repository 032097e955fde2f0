// The tail tiers and the policy that picks one by token count (DESIGN section 2).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

namespace latentmoe {

enum class TailTier { native, tail_fusion, allreduce_overlap, column_parallel };

std::string_view to_string(TailTier tier);
// Parses "native", "tail_fusion", "allreduce_overlap", "column_parallel"; throws on anything else.
TailTier parse_tail_tier(std::string_view name);

// The knobs of the selection policy. Each can be set by an environment variable, read once per
// process by TierPolicy::from_environment():
//   LATENTMOE_TAIL_FUSION_MAX_TOKENS         tail_fusion_max_tokens
//   LATENTMOE_SHARED_STREAM_TOKEN_THRESHOLD  shared_stream_token_threshold
//   LATENTMOE_DISABLE_SHARED_STREAM          disable_shared_stream (0/1/true/false)
//   LATENTMOE_DISABLE_TAIL_FUSION            disable_tail_fusion   (0/1/true/false)
struct TierPolicy {
  static constexpr int64_t kDefaultTailFusionMaxTokens = 64;
  static constexpr int64_t kDefaultSharedStreamTokenThreshold = 256;

  int64_t tail_fusion_max_tokens = kDefaultTailFusionMaxTokens;
  int64_t shared_stream_token_threshold = kDefaultSharedStreamTokenThreshold;
  bool disable_shared_stream = false;
  bool disable_tail_fusion = false;

  // The defaults overridden by the LATENTMOE_* variables; parsed on the first call and cached.
  // A malformed value throws Error naming the variable (on every call).
  static TierPolicy from_environment();
  // Same parsing from any lookup (tests pass a map); `lookup` returns nullopt for an unset name.
  static TierPolicy from_lookup(const std::function<std::optional<std::string>(std::string_view)>& lookup);
  // The same over `base` (a tuned table's entry): unset variables keep base's values.
  static TierPolicy from_lookup(const std::function<std::optional<std::string>(std::string_view)>& lookup,
                                const TierPolicy& base);
};

// What decides whether the fused tails (tiers 0-2) apply at all.
struct FusedPathConditions {
  int tp_size = 1;
  bool has_shared_expert = false;
  bool partials_unreduced = true;  // the experts' outputs are per-rank partial sums
  bool sequence_parallel = false;
  bool tail_fusion_supported = true;  // the backend implements tier 0 on this device
};

// tp > 1, a shared expert, un-reduced partials and no sequence parallelism.
bool fused_path_applies(const FusedPathConditions& conditions);

// The automatic choice for `num_tokens` tokens.
TailTier select_tail_tier(const TierPolicy& policy, const FusedPathConditions& conditions, int64_t num_tokens);

// Throws Error explaining why `tier` cannot run under `conditions` (forcing a tier overrides the
// policy's knobs but not these structural requirements). native is always possible.
void check_tier_possible(TailTier tier, const FusedPathConditions& conditions);

}  // namespace latentmoe

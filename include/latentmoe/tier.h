// The tail tiers and the policy that picks one by token count (DESIGN section 2).
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <string_view>

namespace latentmoe {

enum class TailTier { native, tail_fusion, allreduce_overlap, column_parallel };

// Every tier, in the enum's order (the order of tables and reports).
inline constexpr std::array<TailTier, 4> kAllTailTiers{TailTier::native, TailTier::tail_fusion,
                                                       TailTier::allreduce_overlap, TailTier::column_parallel};

std::string_view to_string(TailTier tier);
// Parses "native", "tail_fusion", "allreduce_overlap", "column_parallel"; throws on anything else.
TailTier parse_tail_tier(std::string_view name);

// The knobs of the selection policy. Each can be set by an environment variable, read once per
// process by TierPolicy::from_environment() and at every call of tuned_policy() (latentmoe/tune.h;
// docs/CONFIG.md, "Environment variables"):
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
  // The backend implements tier 0 on this device. A Runner ignores it: it asks its backend for a
  // TierSupport (Runner::tier_support()); this flag serves callers of the policy without a runner.
  bool tail_fusion_supported = true;
};

// What one tier can run for a given layout (layer shapes, dtype, tp, communicator).
struct TierLimit {
  static constexpr int64_t kUnbounded = std::numeric_limits<int64_t>::max();

  bool supported = true;
  // The most tokens one forward may carry on this tier (e.g. a fused collective's buffer capacity).
  int64_t max_tokens = kUnbounded;
  // Not supported: why not, worded to follow "tier <name> " ("needs tp > 1 (tp is 1)"). Bounded:
  // what bounds max_tokens. Empty otherwise.
  std::string reason;
};

// Every tier's limits for one layout: reported by the backend for its communicator, combined with
// the structural requirements below by the Runner (Runner::tier_support()). The automatic policy
// stays inside it; a forced tier outside it is an Error naming why.
struct TierSupport {
  std::array<TierLimit, 4> tiers;  // indexed by TailTier
  // Every rank can load and store its peers' buffers, so the collective steps run as fused kernels
  // (false: the communicator's own collectives, composed).
  bool peers_reachable = false;
  // How the collectives run, for people (tools print it); may be empty.
  std::string collectives;

  TierLimit& operator[](TailTier tier) { return tiers[static_cast<size_t>(tier)]; }
  const TierLimit& operator[](TailTier tier) const { return tiers[static_cast<size_t>(tier)]; }

  // Supported and num_tokens <= max_tokens. Allocates nothing (forward calls it).
  bool allows(TailTier tier, int64_t num_tokens) const;
  // Throws Error "tier <name> <reason>" when `tier` is not supported, or names its token bound when
  // num_tokens exceeds it. Allocates nothing when the tier can run.
  void check(TailTier tier, int64_t num_tokens) const;
  // Marks `tier` unsupported; a tier already refused keeps its first reason.
  void refuse(TailTier tier, std::string reason);
  // Lowers `tier`'s max_tokens to `max_tokens` (with its reason) when that is tighter.
  void bound(TailTier tier, int64_t max_tokens, std::string reason);
  // Keeps what both allow: a tier refused by either is refused (this one's reason first), the tighter
  // token bound wins; peers_reachable and collectives are taken from `other` when it sets them.
  void restrict_to(const TierSupport& other);
};

// tp > 1, a shared expert, un-reduced partials and no sequence parallelism.
bool fused_path_applies(const FusedPathConditions& conditions);

// The structural requirements as a TierSupport: native always supported and every tier unbounded;
// tiers 0-2 refused with the reason check_tier_possible gives.
TierSupport structural_tier_support(const FusedPathConditions& conditions);

// The automatic choice for `num_tokens` tokens.
TailTier select_tail_tier(const TierPolicy& policy, const FusedPathConditions& conditions, int64_t num_tokens);
// The same inside `support`: the policy's choice when `support` allows it for num_tokens, else the
// next allowed of its fall-backs in order (tail_fusion -> allreduce_overlap -> column_parallel ->
// native; e.g. above tier 0's token capacity the tier the policy takes without tier 0). native when
// nothing is allowed (a forward then fails, naming why).
TailTier select_tail_tier(const TierPolicy& policy, const TierSupport& support, int64_t num_tokens);

// Throws Error explaining why `tier` cannot run under `conditions` (forcing a tier overrides the
// policy's knobs but not these structural requirements). native is always possible.
void check_tier_possible(TailTier tier, const FusedPathConditions& conditions);

}  // namespace latentmoe

// Tail-tier names, the selection policy and its environment knobs (DESIGN section 2, docs/CONFIG.md).
#include "latentmoe/tier.h"

#include <string>
#include <utility>
#include <variant>

#include "core/settings.h"
#include "latentmoe/error.h"

namespace latentmoe {

std::string_view to_string(TailTier tier) {
  switch (tier) {
    case TailTier::native:
      return "native";
    case TailTier::tail_fusion:
      return "tail_fusion";
    case TailTier::allreduce_overlap:
      return "allreduce_overlap";
    case TailTier::column_parallel:
      return "column_parallel";
  }
  return "unknown";
}

TailTier parse_tail_tier(std::string_view name) {
  for (TailTier tier : kAllTailTiers) {
    if (to_string(tier) == name) return tier;
  }
  detail::throw_error("unknown tail tier '", name,
                      "'; accepted: native, tail_fusion, allreduce_overlap, column_parallel");
}

TierPolicy TierPolicy::from_lookup(const std::function<std::optional<std::string>(std::string_view)>& lookup) {
  return from_lookup(lookup, TierPolicy{});
}

TierPolicy TierPolicy::from_lookup(const std::function<std::optional<std::string>(std::string_view)>& lookup,
                                   const TierPolicy& base) {
  // Parsed as the settings registry declares them (core/settings.h); an unset or empty one keeps base's value.
  using detail::Setting;
  TierPolicy policy = base;
  if (auto value = detail::read_integer(Setting::tail_fusion_max_tokens, lookup)) {
    policy.tail_fusion_max_tokens = *value;
  }
  if (auto value = detail::read_integer(Setting::shared_stream_token_threshold, lookup)) {
    policy.shared_stream_token_threshold = *value;
  }
  if (auto value = detail::read_boolean(Setting::disable_shared_stream, lookup)) policy.disable_shared_stream = *value;
  if (auto value = detail::read_boolean(Setting::disable_tail_fusion, lookup)) policy.disable_tail_fusion = *value;
  return policy;
}

TierPolicy TierPolicy::from_environment() {
  // Parsed once (a thread-safe static); a malformed variable is remembered and reported on every call.
  static const std::variant<TierPolicy, std::string> cached = []() -> std::variant<TierPolicy, std::string> {
    try {
      return from_lookup(detail::environment_value);
    } catch (const Error& error) {
      return std::string(error.what());
    }
  }();
  if (const auto* message = std::get_if<std::string>(&cached)) throw Error(*message);
  return std::get<TierPolicy>(cached);
}

bool fused_path_applies(const FusedPathConditions& conditions) {
  return conditions.tp_size > 1 && conditions.has_shared_expert && conditions.partials_unreduced &&
         !conditions.sequence_parallel;
}

bool TierSupport::allows(TailTier tier, int64_t num_tokens) const {
  const TierLimit& limit = (*this)[tier];
  return limit.supported && num_tokens <= limit.max_tokens;
}

void TierSupport::check(TailTier tier, int64_t num_tokens) const {
  const TierLimit& limit = (*this)[tier];
  if (!limit.supported) detail::throw_error("tier ", to_string(tier), " ", limit.reason);
  if (num_tokens > limit.max_tokens) {
    detail::throw_error("tier ", to_string(tier), " carries at most ", limit.max_tokens, " tokens here (", limit.reason,
                        "); this call has ", num_tokens);
  }
}

void TierSupport::refuse(TailTier tier, std::string reason) {
  TierLimit& limit = (*this)[tier];
  if (!limit.supported) return;
  limit.supported = false;
  limit.reason = std::move(reason);
}

void TierSupport::bound(TailTier tier, int64_t max_tokens, std::string reason) {
  TierLimit& limit = (*this)[tier];
  if (!limit.supported || max_tokens >= limit.max_tokens) return;
  limit.max_tokens = max_tokens;
  limit.reason = std::move(reason);
}

void TierSupport::restrict_to(const TierSupport& other) {
  for (TailTier tier : kAllTailTiers) {
    const TierLimit& limit = other[tier];
    if (!limit.supported) {
      refuse(tier, limit.reason);
    } else if (limit.max_tokens != TierLimit::kUnbounded) {
      bound(tier, limit.max_tokens, limit.reason);
    }
  }
  peers_reachable = peers_reachable || other.peers_reachable;
  if (!other.collectives.empty()) collectives = other.collectives;
}

TierSupport structural_tier_support(const FusedPathConditions& conditions) {
  TierSupport support;
  // In the order check_tier_possible has always reported them: the first failed requirement wins.
  for (TailTier tier : {TailTier::tail_fusion, TailTier::allreduce_overlap, TailTier::column_parallel}) {
    if (conditions.tp_size <= 1) {
      support.refuse(tier, "needs tp > 1 (tp is " + std::to_string(conditions.tp_size) + ")");
    } else if (!conditions.has_shared_expert) {
      support.refuse(tier, "needs a shared expert (this layer has none: shared_expert_intermediate_size is 0)");
    } else if (!conditions.partials_unreduced) {
      support.refuse(tier, "needs un-reduced per-rank partials (the experts' outputs are already reduced)");
    } else if (conditions.sequence_parallel) {
      support.refuse(tier, "needs every rank to hold all tokens (it does not support sequence parallelism)");
    }
  }
  if (!conditions.tail_fusion_supported)
    support.refuse(TailTier::tail_fusion, "is not supported by this backend/device");
  return support;
}

TailTier select_tail_tier(const TierPolicy& policy, const FusedPathConditions& conditions, int64_t num_tokens) {
  return select_tail_tier(policy, structural_tier_support(conditions), num_tokens);
}

TailTier select_tail_tier(const TierPolicy& policy, const TierSupport& support, int64_t num_tokens) {
  LATENTMOE_CHECK(num_tokens >= 0, "select_tail_tier: num_tokens must be >= 0, got ", num_tokens);
  // T == 0 never takes tier 0 (as the reference): an empty batch has nothing to fuse.
  const bool tail_fusion_wanted = !policy.disable_tail_fusion && policy.tail_fusion_max_tokens > 0 && num_tokens > 0 &&
                                  num_tokens <= policy.tail_fusion_max_tokens;
  if (tail_fusion_wanted && support.allows(TailTier::tail_fusion, num_tokens)) return TailTier::tail_fusion;
  const bool overlap_wanted = num_tokens <= policy.shared_stream_token_threshold && !policy.disable_shared_stream;
  if (overlap_wanted && support.allows(TailTier::allreduce_overlap, num_tokens)) return TailTier::allreduce_overlap;
  if (support.allows(TailTier::column_parallel, num_tokens)) return TailTier::column_parallel;
  return TailTier::native;
}

void check_tier_possible(TailTier tier, const FusedPathConditions& conditions) {
  structural_tier_support(conditions).check(tier, 0);
}

}  // namespace latentmoe

// Tail-tier names, the selection policy and its environment knobs (DESIGN section 2, docs/CONFIG.md).
#include "latentmoe/tier.h"

#include <array>
#include <cctype>
#include <charconv>
#include <cstdlib>
#include <limits>
#include <string>
#include <variant>

#include "latentmoe/error.h"

namespace latentmoe {
namespace {

constexpr std::array<TailTier, 4> kTiers{TailTier::native, TailTier::tail_fusion, TailTier::allreduce_overlap,
                                         TailTier::column_parallel};

constexpr std::string_view kTailFusionMaxTokensVar = "LATENTMOE_TAIL_FUSION_MAX_TOKENS";
constexpr std::string_view kSharedStreamTokenThresholdVar = "LATENTMOE_SHARED_STREAM_TOKEN_THRESHOLD";
constexpr std::string_view kDisableSharedStreamVar = "LATENTMOE_DISABLE_SHARED_STREAM";
constexpr std::string_view kDisableTailFusionVar = "LATENTMOE_DISABLE_TAIL_FUSION";

// Digits only: no sign, no spaces, no trailing characters; must fit in int64.
int64_t parse_count(std::string_view name, const std::string& text) {
  bool digits_only = !text.empty();
  for (char c : text) digits_only = digits_only && std::isdigit(static_cast<unsigned char>(c));
  LATENTMOE_CHECK(digits_only, name, "='", text, "' is not an integer >= 0");
  int64_t value = 0;
  const char* last = text.data() + text.size();
  auto [end, ec] = std::from_chars(text.data(), last, value);
  LATENTMOE_CHECK(ec == std::errc() && end == last, name, "='", text, "' is out of range (at most ",
                  std::numeric_limits<int64_t>::max(), ")");
  return value;
}

bool parse_flag(std::string_view name, const std::string& text) {
  std::string lower;
  for (char c : text) lower.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  if (lower == "1" || lower == "true" || lower == "yes" || lower == "on") return true;
  if (lower == "0" || lower == "false" || lower == "no" || lower == "off") return false;
  detail::throw_error(name, "='", text, "' is not a boolean; accepted: 0/1, true/false, yes/no, on/off");
}

}  // namespace

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
  for (TailTier tier : kTiers) {
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
  TierPolicy policy = base;
  // An empty value counts as unset, so `LATENTMOE_X= cmd` restores the default.
  auto get = [&lookup](std::string_view name) -> std::optional<std::string> {
    std::optional<std::string> value = lookup(name);
    if (value.has_value() && value->empty()) return std::nullopt;
    return value;
  };
  if (auto value = get(kTailFusionMaxTokensVar)) {
    policy.tail_fusion_max_tokens = parse_count(kTailFusionMaxTokensVar, *value);
  }
  if (auto value = get(kSharedStreamTokenThresholdVar)) {
    policy.shared_stream_token_threshold = parse_count(kSharedStreamTokenThresholdVar, *value);
  }
  if (auto value = get(kDisableSharedStreamVar)) {
    policy.disable_shared_stream = parse_flag(kDisableSharedStreamVar, *value);
  }
  if (auto value = get(kDisableTailFusionVar)) {
    policy.disable_tail_fusion = parse_flag(kDisableTailFusionVar, *value);
  }
  return policy;
}

TierPolicy TierPolicy::from_environment() {
  // Parsed once (a thread-safe static); a malformed variable is remembered and reported on every call.
  static const std::variant<TierPolicy, std::string> cached = []() -> std::variant<TierPolicy, std::string> {
    try {
      return from_lookup([](std::string_view name) -> std::optional<std::string> {
        const char* value = std::getenv(std::string(name).c_str());
        if (value == nullptr) return std::nullopt;
        return std::string(value);
      });
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

TailTier select_tail_tier(const TierPolicy& policy, const FusedPathConditions& conditions, int64_t num_tokens) {
  LATENTMOE_CHECK(num_tokens >= 0, "select_tail_tier: num_tokens must be >= 0, got ", num_tokens);
  if (!fused_path_applies(conditions)) return TailTier::native;
  const bool tail_fusion_enabled =
      !policy.disable_tail_fusion && conditions.tail_fusion_supported && policy.tail_fusion_max_tokens > 0;
  // T == 0 never takes tier 0 (as the reference): an empty batch has nothing to fuse.
  if (tail_fusion_enabled && num_tokens > 0 && num_tokens <= policy.tail_fusion_max_tokens) {
    return TailTier::tail_fusion;
  }
  if (num_tokens <= policy.shared_stream_token_threshold && !policy.disable_shared_stream) {
    return TailTier::allreduce_overlap;
  }
  return TailTier::column_parallel;
}

void check_tier_possible(TailTier tier, const FusedPathConditions& conditions) {
  if (tier == TailTier::native) return;
  const std::string_view name = to_string(tier);
  LATENTMOE_CHECK(conditions.tp_size > 1, "tier ", name, " needs tp > 1 (tp is ", conditions.tp_size, ")");
  LATENTMOE_CHECK(conditions.has_shared_expert, "tier ", name,
                  " needs a shared expert (this layer has none: shared_expert_intermediate_size is 0)");
  LATENTMOE_CHECK(conditions.partials_unreduced, "tier ", name,
                  " needs un-reduced per-rank partials (the experts' outputs are already reduced)");
  LATENTMOE_CHECK(!conditions.sequence_parallel, "tier ", name,
                  " needs every rank to hold all tokens (it does not support sequence parallelism)");
  LATENTMOE_CHECK(tier != TailTier::tail_fusion || conditions.tail_fusion_supported,
                  "tier tail_fusion is not supported by this backend/device");
}

}  // namespace latentmoe

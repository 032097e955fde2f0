#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "latentmoe/error.h"
#include "latentmoe/tier.h"

namespace latentmoe {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// tp 8, a shared expert, un-reduced partials, no sequence parallelism, tier 0 supported.
FusedPathConditions fused(int tp_size = 8) {
  FusedPathConditions conditions;
  conditions.tp_size = tp_size;
  conditions.has_shared_expert = true;
  return conditions;
}

struct Knobs {
  int64_t max_tokens = TierPolicy::kDefaultTailFusionMaxTokens;        // 64
  int64_t threshold = TierPolicy::kDefaultSharedStreamTokenThreshold;  // 256
  bool disable_shared_stream = false;
  bool disable_tail_fusion = false;

  TierPolicy policy() const {
    TierPolicy policy;
    policy.tail_fusion_max_tokens = max_tokens;
    policy.shared_stream_token_threshold = threshold;
    policy.disable_shared_stream = disable_shared_stream;
    policy.disable_tail_fusion = disable_tail_fusion;
    return policy;
  }
};

Knobs knobs(int64_t max_tokens, int64_t threshold, bool disable_shared_stream = false,
            bool disable_tail_fusion = false) {
  return Knobs{max_tokens, threshold, disable_shared_stream, disable_tail_fusion};
}

FusedPathConditions with_tp(int tp) { return fused(tp); }
FusedPathConditions no_shared() {
  FusedPathConditions c = fused();
  c.has_shared_expert = false;
  return c;
}
FusedPathConditions reduced() {
  FusedPathConditions c = fused();
  c.partials_unreduced = false;
  return c;
}
FusedPathConditions sequence_parallel() {
  FusedPathConditions c = fused();
  c.sequence_parallel = true;
  return c;
}
FusedPathConditions unsupported() {
  FusedPathConditions c = fused();
  c.tail_fusion_supported = false;
  return c;
}

struct Row {
  const char* what;
  Knobs knobs;
  FusedPathConditions conditions;
  int64_t num_tokens;
  TailTier expected;
};

constexpr auto kNative = TailTier::native;
constexpr auto kTail = TailTier::tail_fusion;
constexpr auto kOverlap = TailTier::allreduce_overlap;
constexpr auto kColumn = TailTier::column_parallel;

const std::vector<Row>& table() {
  static const std::vector<Row> rows = {
      // Defaults (max 64, threshold 256) on the fused path.
      {"T=0 never takes tail fusion", Knobs{}, fused(), 0, kOverlap},
      {"T=1", Knobs{}, fused(), 1, kTail},
      {"T=max-1", Knobs{}, fused(), 63, kTail},
      {"T=max", Knobs{}, fused(), 64, kTail},
      {"T=max+1", Knobs{}, fused(), 65, kOverlap},
      {"T=threshold-1", Knobs{}, fused(), 255, kOverlap},
      {"T=threshold", Knobs{}, fused(), 256, kOverlap},
      {"T=threshold+1", Knobs{}, fused(), 257, kColumn},
      {"prefill", Knobs{}, fused(), 1 << 20, kColumn},
      {"tp 2 is enough", Knobs{}, with_tp(2), 1, kTail},
      {"tp 3 (any tp > 1)", Knobs{}, with_tp(3), 200, kOverlap},
      // Tail fusion switched off three ways.
      {"disable_tail_fusion T=1", knobs(64, 256, false, true), fused(), 1, kOverlap},
      {"disable_tail_fusion T=max", knobs(64, 256, false, true), fused(), 64, kOverlap},
      {"disable_tail_fusion T=threshold+1", knobs(64, 256, false, true), fused(), 257, kColumn},
      {"max_tokens 0 T=1", knobs(0, 256), fused(), 1, kOverlap},
      {"max_tokens 0 T=0", knobs(0, 256), fused(), 0, kOverlap},
      {"unsupported T=1", Knobs{}, unsupported(), 1, kOverlap},
      {"unsupported T=max", Knobs{}, unsupported(), 64, kOverlap},
      {"unsupported T=threshold+1", Knobs{}, unsupported(), 257, kColumn},
      // The aux stream switched off.
      {"disable_shared_stream T=0", knobs(64, 256, true), fused(), 0, kColumn},
      {"disable_shared_stream T=1", knobs(64, 256, true), fused(), 1, kTail},
      {"disable_shared_stream T=max+1", knobs(64, 256, true), fused(), 65, kColumn},
      {"disable_shared_stream T=threshold", knobs(64, 256, true), fused(), 256, kColumn},
      {"both disabled T=1", knobs(64, 256, true, true), fused(), 1, kColumn},
      // Moved thresholds.
      {"threshold 0 T=0", knobs(64, 0), fused(), 0, kOverlap},
      {"threshold 0 T=1", knobs(64, 0), fused(), 1, kTail},
      {"threshold 0 T=max+1", knobs(64, 0), fused(), 65, kColumn},
      {"max 1 T=1", knobs(1, 256), fused(), 1, kTail},
      {"max 1 T=2", knobs(1, 256), fused(), 2, kOverlap},
      {"max == threshold T=max", knobs(128, 128), fused(), 128, kTail},
      {"max == threshold T=max+1", knobs(128, 128), fused(), 129, kColumn},
      {"max above threshold T=threshold+1", knobs(512, 256), fused(), 257, kTail},
      {"max above threshold T=max", knobs(512, 256), fused(), 512, kTail},
      {"max above threshold T=max+1", knobs(512, 256), fused(), 513, kColumn},
      // The fused path does not apply: native whatever T and the knobs say.
      {"tp 1 T=1", Knobs{}, with_tp(1), 1, kNative},
      {"tp 1 T=0", Knobs{}, with_tp(1), 0, kNative},
      {"tp 1 T=prefill", Knobs{}, with_tp(1), 4096, kNative},
      {"tp 0 (invalid) is not > 1", Knobs{}, with_tp(0), 1, kNative},
      {"no shared expert T=1", Knobs{}, no_shared(), 1, kNative},
      {"no shared expert T=threshold+1", Knobs{}, no_shared(), 257, kNative},
      {"reduced partials T=1", Knobs{}, reduced(), 1, kNative},
      {"reduced partials T=100", Knobs{}, reduced(), 100, kNative},
      {"sequence parallel T=1", Knobs{}, sequence_parallel(), 1, kNative},
      {"sequence parallel T=threshold+1", Knobs{}, sequence_parallel(), 257, kNative},
  };
  return rows;
}

TEST(TierPolicy, selection_table) {
  ASSERT_GE(table().size(), 30u);
  for (const Row& row : table()) {
    EXPECT_EQ(select_tail_tier(row.knobs.policy(), row.conditions, row.num_tokens), row.expected)
        << row.what << ": got " << to_string(select_tail_tier(row.knobs.policy(), row.conditions, row.num_tokens))
        << ", expected " << to_string(row.expected);
  }
}

TEST(TierPolicy, defaults_match_the_reference) {
  TierPolicy policy;
  EXPECT_EQ(policy.tail_fusion_max_tokens, 64);
  EXPECT_EQ(policy.shared_stream_token_threshold, 256);
  EXPECT_FALSE(policy.disable_shared_stream);
  EXPECT_FALSE(policy.disable_tail_fusion);
  FusedPathConditions conditions;
  EXPECT_EQ(conditions.tp_size, 1);
  EXPECT_FALSE(conditions.has_shared_expert);
  EXPECT_TRUE(conditions.partials_unreduced);
  EXPECT_FALSE(conditions.sequence_parallel);
  EXPECT_TRUE(conditions.tail_fusion_supported);
}

TEST(TierPolicy, negative_token_count_is_an_error) { EXPECT_THROW(select_tail_tier(TierPolicy{}, fused(), -1), Error); }

TEST(TierPolicy, fused_path_applies_needs_all_four) {
  EXPECT_TRUE(fused_path_applies(fused()));
  EXPECT_TRUE(fused_path_applies(with_tp(2)));
  EXPECT_TRUE(fused_path_applies(unsupported()));  // tier 0 support does not matter here
  EXPECT_FALSE(fused_path_applies(with_tp(1)));
  EXPECT_FALSE(fused_path_applies(no_shared()));
  EXPECT_FALSE(fused_path_applies(reduced()));
  EXPECT_FALSE(fused_path_applies(sequence_parallel()));
  EXPECT_FALSE(fused_path_applies(FusedPathConditions{}));
}

std::string possible_error(TailTier tier, const FusedPathConditions& conditions) {
  try {
    check_tier_possible(tier, conditions);
  } catch (const Error& error) {
    return error.what();
  }
  return "";
}

TEST(TierPolicy, check_tier_possible_explains_each_requirement) {
  for (TailTier tier : {kTail, kOverlap, kColumn}) {
    const std::string name(to_string(tier));
    SCOPED_TRACE(name);
    EXPECT_EQ(possible_error(tier, fused()), "");
    EXPECT_EQ(possible_error(tier, with_tp(2)), "");
    EXPECT_EQ(possible_error(tier, with_tp(1)), "tier " + name + " needs tp > 1 (tp is 1)");
    EXPECT_THAT(possible_error(tier, no_shared()), HasSubstr("tier " + name + " needs a shared expert"));
    EXPECT_THAT(possible_error(tier, reduced()), HasSubstr("tier " + name + " needs un-reduced per-rank partials"));
    EXPECT_THAT(possible_error(tier, sequence_parallel()),
                AllOf(HasSubstr("tier " + name), HasSubstr("sequence parallelism")));
  }
  EXPECT_EQ(possible_error(kTail, unsupported()), "tier tail_fusion is not supported by this backend/device");
  EXPECT_EQ(possible_error(kOverlap, unsupported()), "");
  EXPECT_EQ(possible_error(kColumn, unsupported()), "");
  // The structural requirement is reported before the backend one.
  FusedPathConditions tp1_unsupported = unsupported();
  tp1_unsupported.tp_size = 1;
  EXPECT_EQ(possible_error(kTail, tp1_unsupported), "tier tail_fusion needs tp > 1 (tp is 1)");
}

TEST(TierPolicy, native_is_always_possible) {
  FusedPathConditions worst;
  worst.tp_size = 1;
  worst.has_shared_expert = false;
  worst.partials_unreduced = false;
  worst.sequence_parallel = true;
  worst.tail_fusion_supported = false;
  EXPECT_NO_THROW(check_tier_possible(kNative, worst));
  EXPECT_NO_THROW(check_tier_possible(kNative, fused()));
}

TEST(TierPolicy, selected_tier_is_always_possible) {
  for (const Row& row : table()) {
    if (row.conditions.tp_size < 1) continue;
    TailTier tier = select_tail_tier(row.knobs.policy(), row.conditions, row.num_tokens);
    EXPECT_NO_THROW(check_tier_possible(tier, row.conditions)) << row.what;
  }
}

TEST(TierNames, round_trip) {
  const std::vector<std::pair<TailTier, std::string>> names = {
      {kNative, "native"},
      {kTail, "tail_fusion"},
      {kOverlap, "allreduce_overlap"},
      {kColumn, "column_parallel"},
  };
  for (const auto& [tier, name] : names) {
    EXPECT_EQ(to_string(tier), name);
    EXPECT_EQ(parse_tail_tier(name), tier);
    EXPECT_EQ(parse_tail_tier(to_string(tier)), tier);
  }
}

TEST(TierNames, unknown_names_list_the_accepted_ones) {
  for (const char* bad : {"auto", "", "Native", "tail-fusion", "0", "column_parallel ", "tier1"}) {
    SCOPED_TRACE(bad);
    try {
      parse_tail_tier(bad);
      FAIL() << "expected Error";
    } catch (const Error& error) {
      EXPECT_THAT(error.what(), AllOf(HasSubstr(std::string("'") + bad + "'"),
                                      HasSubstr("accepted: native, tail_fusion, allreduce_overlap, column_parallel")));
    }
  }
}

constexpr const char* kMaxTokensVar = "LATENTMOE_TAIL_FUSION_MAX_TOKENS";
constexpr const char* kThresholdVar = "LATENTMOE_SHARED_STREAM_TOKEN_THRESHOLD";
constexpr const char* kDisableSharedVar = "LATENTMOE_DISABLE_SHARED_STREAM";
constexpr const char* kDisableTailVar = "LATENTMOE_DISABLE_TAIL_FUSION";

TierPolicy from_map(const std::map<std::string, std::string>& values) {
  return TierPolicy::from_lookup([&values](std::string_view name) -> std::optional<std::string> {
    auto it = values.find(std::string(name));
    if (it == values.end()) return std::nullopt;
    return it->second;
  });
}

std::string lookup_error(const std::map<std::string, std::string>& values) {
  try {
    from_map(values);
  } catch (const Error& error) {
    return error.what();
  }
  return "";
}

TEST(TierPolicyLookup, unset_gives_defaults_and_reads_the_four_names) {
  std::set<std::string> asked;
  TierPolicy policy = TierPolicy::from_lookup([&asked](std::string_view name) -> std::optional<std::string> {
    asked.insert(std::string(name));
    return std::nullopt;
  });
  EXPECT_EQ(asked, (std::set<std::string>{kMaxTokensVar, kThresholdVar, kDisableSharedVar, kDisableTailVar}));
  EXPECT_EQ(policy.tail_fusion_max_tokens, TierPolicy::kDefaultTailFusionMaxTokens);
  EXPECT_EQ(policy.shared_stream_token_threshold, TierPolicy::kDefaultSharedStreamTokenThreshold);
  EXPECT_FALSE(policy.disable_shared_stream);
  EXPECT_FALSE(policy.disable_tail_fusion);
}

TEST(TierPolicyLookup, good_integers) {
  EXPECT_EQ(from_map({{kMaxTokensVar, "0"}}).tail_fusion_max_tokens, 0);
  EXPECT_EQ(from_map({{kMaxTokensVar, "128"}}).tail_fusion_max_tokens, 128);
  EXPECT_EQ(from_map({{kMaxTokensVar, "007"}}).tail_fusion_max_tokens, 7);
  EXPECT_EQ(from_map({{kThresholdVar, "0"}}).shared_stream_token_threshold, 0);
  EXPECT_EQ(from_map({{kThresholdVar, "1024"}}).shared_stream_token_threshold, 1024);
  EXPECT_EQ(from_map({{kThresholdVar, "9223372036854775807"}}).shared_stream_token_threshold,
            std::numeric_limits<int64_t>::max());
  // Setting one leaves the others at their defaults.
  TierPolicy policy = from_map({{kThresholdVar, "512"}});
  EXPECT_EQ(policy.tail_fusion_max_tokens, TierPolicy::kDefaultTailFusionMaxTokens);
  EXPECT_EQ(policy.shared_stream_token_threshold, 512);
  // An empty value counts as unset.
  EXPECT_EQ(from_map({{kMaxTokensVar, ""}}).tail_fusion_max_tokens, TierPolicy::kDefaultTailFusionMaxTokens);
}

TEST(TierPolicyLookup, bad_integers_name_variable_and_value) {
  for (const char* var : {kMaxTokensVar, kThresholdVar}) {
    for (const char* bad : {"-1", "abc", "12abc", " 12", "12 ", "+5", "1.5", "0x10", "1e3", "9223372036854775808",
                            "99999999999999999999999"}) {
      SCOPED_TRACE(std::string(var) + "=" + bad);
      EXPECT_THAT(lookup_error({{var, bad}}), HasSubstr(std::string(var) + "='" + bad + "'"));
    }
    EXPECT_EQ(lookup_error({{var, "-1"}}),
              std::string(var) + "='-1' is not an integer; expected an integer >= 0 (tokens)");
    EXPECT_EQ(lookup_error({{var, "9223372036854775808"}}),
              std::string(var) + "='9223372036854775808' is out of range; expected an integer >= 0 (tokens)");
  }
}

TEST(TierPolicyLookup, good_booleans) {
  const std::vector<std::pair<std::string, bool>> cases = {
      {"1", true},    {"0", false},   {"true", true},   {"false", false}, {"yes", true}, {"no", false}, {"on", true},
      {"off", false}, {"TRUE", true}, {"False", false}, {"YeS", true},    {"nO", false}, {"ON", true},  {"Off", false},
  };
  for (const auto& [text, expected] : cases) {
    SCOPED_TRACE(text);
    EXPECT_EQ(from_map({{kDisableSharedVar, text}}).disable_shared_stream, expected);
    EXPECT_EQ(from_map({{kDisableTailVar, text}}).disable_tail_fusion, expected);
  }
  TierPolicy both = from_map({{kDisableSharedVar, "1"}, {kDisableTailVar, "yes"}});
  EXPECT_TRUE(both.disable_shared_stream);
  EXPECT_TRUE(both.disable_tail_fusion);
  EXPECT_FALSE(from_map({{kDisableTailVar, ""}}).disable_tail_fusion);
}

TEST(TierPolicyLookup, bad_booleans_name_variable_and_value) {
  for (const char* var : {kDisableSharedVar, kDisableTailVar}) {
    for (const char* bad : {"2", "-1", "tru", "yess", " 1", "1 ", "enable", "y", "n", "00"}) {
      SCOPED_TRACE(std::string(var) + "=" + bad);
      EXPECT_EQ(lookup_error({{var, bad}}),
                std::string(var) + "='" + bad + "' is not a boolean; expected 0/1, true/false, yes/no or on/off");
    }
  }
}

TierPolicy policy_from_getenv() {
  return TierPolicy::from_lookup([](std::string_view name) -> std::optional<std::string> {
    const char* value = std::getenv(std::string(name).c_str());
    if (value == nullptr) return std::nullopt;
    return std::string(value);
  });
}

bool same_policy(const TierPolicy& a, const TierPolicy& b) {
  return a.tail_fusion_max_tokens == b.tail_fusion_max_tokens &&
         a.shared_stream_token_threshold == b.shared_stream_token_threshold &&
         a.disable_shared_stream == b.disable_shared_stream && a.disable_tail_fusion == b.disable_tail_fusion;
}

TEST(TierPolicyEnvironment, parsed_once_and_cached) {
  // The first call in this process fixes the result; later environment changes are not seen.
  std::optional<TierPolicy> first;
  std::string first_error;
  try {
    first = TierPolicy::from_environment();
  } catch (const Error& error) {
    first_error = error.what();
  }
  const char* saved = std::getenv(kMaxTokensVar);
  std::optional<std::string> saved_value = saved ? std::optional<std::string>(saved) : std::nullopt;
  ASSERT_EQ(setenv(kMaxTokensVar, "not-a-number", 1), 0);
  for (int i = 0; i < 2; ++i) {
    if (first.has_value()) {
      EXPECT_TRUE(same_policy(TierPolicy::from_environment(), *first));
    } else {
      try {
        TierPolicy::from_environment();
        FAIL() << "expected the cached error again";
      } catch (const Error& error) {
        EXPECT_EQ(std::string(error.what()), first_error);
      }
    }
  }
  if (saved_value.has_value()) {
    setenv(kMaxTokensVar, saved_value->c_str(), 1);
  } else {
    unsetenv(kMaxTokensVar);
  }
  // Unless the environment changed before the first call, the cached value is what getenv gives now.
  if (first.has_value()) {
    EXPECT_TRUE(same_policy(*first, policy_from_getenv()));
  }
}

}  // namespace
}  // namespace latentmoe

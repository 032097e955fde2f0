// Tier support (latentmoe/tier.h TierSupport, Runner::tier_support()): what the CPU backend reports,
// the structural requirements folded in, the automatic policy staying inside the support, and a
// forced tier outside it failing with an Error that names the tier and why.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "error_test_util.h"
#include "latentmoe/error.h"
#include "latentmoe/in_process_group.h"
#include "latentmoe/local_group.h"
#include "latentmoe/runner.h"
#include "latentmoe/tier.h"
#include "latentmoe/weights.h"
#include "layer_test_util.h"

namespace latentmoe {
namespace {

using ::testing::HasSubstr;

constexpr TailTier kAllTiers[] = {TailTier::native, TailTier::tail_fusion, TailTier::allreduce_overlap,
                                  TailTier::column_parallel};

using testing::message_of;

// Rank 0's runner of a tp group on the CPU backend (built only: no forward, so no peer is needed).
struct RankZero {
  RankZero(const LayerConfig& config, int tp_size, TierPolicy policy = {})
      : group(make_in_process_group(tp_size)),
        full(make_random_layer_weights(config, DType::f32, /*seed=*/3, /*with_gate=*/false)) {
    RunnerOptions options;
    options.backend = BackendKind::cpu;
    options.policy = policy;
    options.max_tokens = 64;
    const ParallelConfig parallel{tp_size, 0, false};
    runner =
        std::make_unique<Runner>(config, parallel, shard_layer_weights(full, config, parallel), *group[0], options);
  }
  std::vector<std::unique_ptr<Communicator>> group;
  LayerWeights full;
  std::unique_ptr<Runner> runner;
};

TEST(TierSupport, cpu_backend_supports_every_tier_unbounded_at_tp_above_one) {
  for (int tp : {2, 4, 8}) {
    RankZero rank(testing::kimi_like_config(), tp);
    const TierSupport& support = rank.runner->tier_support();
    for (TailTier tier : kAllTiers) {
      SCOPED_TRACE(std::string(to_string(tier)) + " tp " + std::to_string(tp));
      EXPECT_TRUE(support[tier].supported) << support[tier].reason;
      EXPECT_EQ(support[tier].max_tokens, TierLimit::kUnbounded);
      EXPECT_TRUE(support.allows(tier, 1 << 20));
    }
    EXPECT_FALSE(support.peers_reachable);  // composed collectives of the in-process group
    EXPECT_FALSE(support.collectives.empty());
  }
}

TEST(TierSupport, runner_folds_in_the_structural_requirements) {
  RankZero single(testing::kimi_like_config(), 1);
  const TierSupport& one = single.runner->tier_support();
  EXPECT_TRUE(one[TailTier::native].supported);
  for (TailTier tier : {TailTier::tail_fusion, TailTier::allreduce_overlap, TailTier::column_parallel}) {
    EXPECT_FALSE(one[tier].supported);
    EXPECT_EQ(one[tier].reason, "needs tp > 1 (tp is 1)");
  }

  LayerConfig no_shared = testing::kimi_like_config();
  no_shared.shared_intermediate_size = 0;
  no_shared.num_shared_experts = 0;
  RankZero plain(no_shared, 2);
  const TierSupport& two = plain.runner->tier_support();
  EXPECT_TRUE(two[TailTier::native].supported);
  for (TailTier tier : {TailTier::tail_fusion, TailTier::allreduce_overlap, TailTier::column_parallel}) {
    EXPECT_THAT(two[tier].reason, HasSubstr("needs a shared expert"));
  }
}

TEST(TierSupport, forced_unsupported_tier_is_an_error_naming_the_tier_and_why) {
  RankZero single(testing::kimi_like_config(), 1);
  const LayerConfig config = testing::kimi_like_config();
  const LocalGroupInputs inputs = testing::random_inputs(config, 3, DType::f32, 11);
  HostTensor output(DType::f32, {3, config.hidden_size});
  for (TailTier tier : {TailTier::tail_fusion, TailTier::allreduce_overlap, TailTier::column_parallel}) {
    ForwardInputs forward{inputs.hidden_states.view(), inputs.router_logits.view(), {}, tier};
    EXPECT_EQ(message_of([&] {
                single.runner->forward(forward, {output.view(), {}, {}});
              }),
              "tier " + std::string(to_string(tier)) + " needs tp > 1 (tp is 1)");
  }
  // The same through the local group; with skip_unsupported_tier the tier is skipped, not run.
  LocalGroupOptions options;
  options.tp_size = 1;
  options.tier = TailTier::column_parallel;
  auto shard = [&](const ParallelConfig& p) { return shard_layer_weights(single.full, config, p); };
  EXPECT_EQ(message_of([&] { run_local_group(config, shard, inputs, options); }),
            "tier column_parallel needs tp > 1 (tp is 1)");
  options.skip_unsupported_tier = true;
  const std::vector<RankResult> skipped = run_local_group(config, shard, inputs, options);
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_FALSE(skipped[0].ran);
  EXPECT_FALSE(skipped[0].tier_support[TailTier::column_parallel].supported);
  options.tier = TailTier::native;
  EXPECT_TRUE(run_local_group(config, shard, inputs, options)[0].ran);
}

TEST(TierSupport, check_names_the_token_bound) {
  TierSupport support;
  support.bound(TailTier::tail_fusion, 12, "the buffer holds 12 tokens");
  EXPECT_TRUE(support.allows(TailTier::tail_fusion, 12));
  EXPECT_FALSE(support.allows(TailTier::tail_fusion, 13));
  EXPECT_NO_THROW(support.check(TailTier::tail_fusion, 12));
  EXPECT_EQ(message_of([&] { support.check(TailTier::tail_fusion, 13); }),
            "tier tail_fusion carries at most 12 tokens here (the buffer holds 12 tokens); this call has 13");
  // A looser bound does not widen it; a refusal keeps its first reason.
  support.bound(TailTier::tail_fusion, 100, "looser");
  EXPECT_EQ(support[TailTier::tail_fusion].max_tokens, 12);
  support.refuse(TailTier::column_parallel, "first");
  support.refuse(TailTier::column_parallel, "second");
  EXPECT_EQ(message_of([&] { support.check(TailTier::column_parallel, 0); }), "tier column_parallel first");
}

TEST(TierSupport, restrict_to_keeps_what_both_allow_structural_reasons_first) {
  FusedPathConditions tp1;
  tp1.tp_size = 1;
  tp1.has_shared_expert = true;
  TierSupport support = structural_tier_support(tp1);
  TierSupport backend;
  backend.refuse(TailTier::tail_fusion, "cannot run: the backend says no");
  backend.bound(TailTier::native, 7, "seven");
  backend.peers_reachable = true;
  backend.collectives = "fused";
  support.restrict_to(backend);
  EXPECT_EQ(support[TailTier::tail_fusion].reason, "needs tp > 1 (tp is 1)");
  EXPECT_EQ(support[TailTier::native].max_tokens, 7);
  EXPECT_TRUE(support.peers_reachable);
  EXPECT_EQ(support.collectives, "fused");

  FusedPathConditions fused;
  fused.tp_size = 2;
  fused.has_shared_expert = true;
  TierSupport two = structural_tier_support(fused);
  two.restrict_to(backend);
  EXPECT_EQ(message_of([&] { two.check(TailTier::tail_fusion, 1); }),
            "tier tail_fusion cannot run: the backend says no");
}

// Every policy x support x token count: the automatic tier is allowed (or native when nothing is),
// and it is the policy's own choice whenever that one is allowed.
TEST(TierSupport, policy_never_picks_an_unsupported_tier) {
  FusedPathConditions fused;
  fused.tp_size = 4;
  fused.has_shared_expert = true;
  std::vector<TierSupport> supports;
  supports.push_back(structural_tier_support(fused));
  for (TailTier tier : kAllTiers) {
    TierSupport refused = supports[0];
    refused.refuse(tier, "no");
    supports.push_back(refused);
    for (int64_t bound : {0, 1, 5, 40}) {
      TierSupport bounded = supports[0];
      bounded.bound(tier, bound, "bounded");
      supports.push_back(bounded);
    }
  }
  TierSupport nothing = supports[0];
  for (TailTier tier : kAllTiers) nothing.refuse(tier, "no");
  supports.push_back(nothing);

  std::vector<TierPolicy> policies(4);
  policies[1].tail_fusion_max_tokens = 8;
  policies[1].shared_stream_token_threshold = 16;
  policies[2].disable_tail_fusion = true;
  policies[3].disable_shared_stream = true;
  policies[3].tail_fusion_max_tokens = 0;
  for (const TierSupport& support : supports) {
    for (const TierPolicy& policy : policies) {
      for (int64_t tokens = 0; tokens <= 300; ++tokens) {
        const TailTier tier = select_tail_tier(policy, support, tokens);
        const TailTier unrestricted = select_tail_tier(policy, fused, tokens);
        const bool any = support.allows(TailTier::native, tokens) || support.allows(TailTier::tail_fusion, tokens) ||
                         support.allows(TailTier::allreduce_overlap, tokens) ||
                         support.allows(TailTier::column_parallel, tokens);
        if (any) {
          EXPECT_TRUE(support.allows(tier, tokens)) << to_string(tier) << " at " << tokens;
        } else {
          EXPECT_EQ(tier, TailTier::native);
        }
        if (support.allows(unrestricted, tokens)) EXPECT_EQ(tier, unrestricted) << tokens;
      }
    }
  }
}

TEST(TierSupport, above_tier0_capacity_the_policy_takes_the_next_tier) {
  FusedPathConditions fused;
  fused.tp_size = 8;
  fused.has_shared_expert = true;
  TierSupport support = structural_tier_support(fused);
  support.bound(TailTier::tail_fusion, 16, "capacity");
  const TierPolicy policy;  // tier 0 up to 64, overlap up to 256
  EXPECT_EQ(select_tail_tier(policy, support, 16), TailTier::tail_fusion);
  EXPECT_EQ(select_tail_tier(policy, support, 17), TailTier::allreduce_overlap);
  EXPECT_EQ(select_tail_tier(policy, support, 257), TailTier::column_parallel);
  support.refuse(TailTier::allreduce_overlap, "no aux stream");
  EXPECT_EQ(select_tail_tier(policy, support, 17), TailTier::column_parallel);
  support.bound(TailTier::column_parallel, 100, "capacity");
  EXPECT_EQ(select_tail_tier(policy, support, 101), TailTier::native);
}

TEST(TierSupport, runner_select_tier_matches_the_policy_inside_its_support) {
  TierPolicy policy;
  policy.tail_fusion_max_tokens = 2;
  policy.shared_stream_token_threshold = 5;
  RankZero rank(testing::nemotron_like_config(), 2, policy);
  EXPECT_EQ(rank.runner->select_tier(0), TailTier::allreduce_overlap);
  EXPECT_EQ(rank.runner->select_tier(2), TailTier::tail_fusion);
  EXPECT_EQ(rank.runner->select_tier(5), TailTier::allreduce_overlap);
  EXPECT_EQ(rank.runner->select_tier(6), TailTier::column_parallel);
}

}  // namespace
}  // namespace latentmoe

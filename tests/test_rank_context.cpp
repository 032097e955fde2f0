// Layers of different shapes sharing one per-rank context (issue 13 points 1a and 6): run alternately
// at tp 2 with varying token counts and forced tiers, each layer's output is bit-identical to the same
// layer on a standalone Runner; the context grows to the largest layer before the first forward and
// refuses to grow after it; a layer sharded for another rank is refused.
#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <vector>

#include "error_test_util.h"
#include "latentmoe/compare.h"
#include "latentmoe/in_process_group.h"
#include "latentmoe/rank_context.h"
#include "latentmoe/runner.h"
#include "layer_test_util.h"

namespace latentmoe {
namespace {

using testing::kimi_like_config;
using testing::message_of;
using testing::nemotron_like_config;
using testing::random_host_tensor;

using Step = latentmoe::testing::AlternatingStep;

struct StepResult {
  HostTensor output, topk_ids, topk_weights;
  TailTier tier = TailTier::native;
};

StepResult make_outputs(Runner& runner, const LayerConfig& config, const HostTensor& x) {
  const int64_t num_tokens = x.size(0);
  StepResult result;
  result.output = HostTensor(runner.dtype(), {num_tokens, config.hidden_size});
  result.topk_ids = HostTensor(DType::i32, {num_tokens, config.top_k});
  result.topk_weights = HostTensor(DType::f32, {num_tokens, config.top_k});
  return result;
}

TEST(RankContextTest, layers_of_different_shapes_share_a_context_bit_identically) {
  constexpr int kTp = 2;
  constexpr DType kDtype = DType::bf16;
  const std::vector<LayerConfig> configs = {kimi_like_config(), nemotron_like_config()};
  // Different d, l and E, and neither is larger in every dimension: the context holds the maximum.
  ASSERT_NE(configs[0].hidden_size, configs[1].hidden_size);
  ASSERT_NE(configs[0].latent_size, configs[1].latent_size);
  ASSERT_NE(configs[0].num_experts, configs[1].num_experts);
  // The kimi-like layer computes its router logits from its gate (the logits scratch); the
  // nemotron-like layer is given them.
  std::vector<LayerWeights> full;
  full.push_back(make_random_layer_weights(configs[0], kDtype, 11, /*with_gate=*/true));
  full.push_back(make_random_layer_weights(configs[1], kDtype, 12, /*with_gate=*/false));
  const std::vector<Step> steps = latentmoe::testing::alternating_schedule(64);
  std::vector<HostTensor> hidden, logits;
  for (size_t i = 0; i < steps.size(); ++i) {
    const LayerConfig& config = configs[steps[i].layer];
    hidden.push_back(random_host_tensor(kDtype, {steps[i].num_tokens, config.hidden_size}, 100 + i));
    logits.push_back(random_host_tensor(DType::f32, {steps[i].num_tokens, config.num_router_outputs()}, 200 + i, 3.0f));
  }

  // results[shared][rank][step]
  std::vector<std::vector<std::vector<StepResult>>> results(2);
  for (auto& per_rank : results) per_rank.resize(kTp);
  for (int shared = 0; shared < 2; ++shared) {
    auto group = make_in_process_group(kTp);
    run_ranks(group, [&](int rank) {
      const ParallelConfig parallel{kTp, rank};
      RunnerOptions options;
      options.max_tokens = 64;
      std::unique_ptr<RankContext> context;
      std::vector<std::unique_ptr<Runner>> layers;
      for (int layer = 0; layer < 2; ++layer) {
        const LayerWeights weights = shard_layer_weights(full[layer], configs[layer], parallel);
        if (shared == 1) {
          if (context == nullptr) {
            RankContextOptions context_options;
            context_options.max_tokens = options.max_tokens;
            context = std::make_unique<RankContext>(parallel, *group[rank], context_options);
          }
          layers.push_back(std::make_unique<Runner>(*context, configs[layer], parallel, weights));
        } else {
          layers.push_back(std::make_unique<Runner>(configs[layer], parallel, weights, *group[rank], options));
        }
      }
      if (shared == 1) {
        EXPECT_EQ(context->num_layers(), 2);
        EXPECT_FALSE(context->frozen());
      }
      for (size_t i = 0; i < steps.size(); ++i) {
        const Step& step = steps[i];
        const LayerConfig& config = configs[step.layer];
        StepResult result = make_outputs(*layers[step.layer], config, hidden[i]);
        ForwardInputs inputs;
        inputs.hidden_states = hidden[i].view();
        if (step.layer == 1) inputs.router_logits = logits[i].view();
        inputs.tier = step.tier;
        ForwardOutputs outputs{result.output.view(), result.topk_ids.view(), result.topk_weights.view()};
        result.tier = layers[step.layer]->forward_host(inputs, outputs);
        results[shared][rank].push_back(std::move(result));
      }
      if (shared == 1) EXPECT_TRUE(context->frozen());
    });
  }

  for (int rank = 0; rank < kTp; ++rank) {
    for (size_t i = 0; i < steps.size(); ++i) {
      const StepResult& standalone = results[0][rank][i];
      const StepResult& shared = results[1][rank][i];
      SCOPED_TRACE("rank " + std::to_string(rank) + ", step " + std::to_string(i));
      if (steps[i].tier.has_value()) EXPECT_EQ(shared.tier, *steps[i].tier);
      EXPECT_EQ(shared.tier, standalone.tier);
      EXPECT_TRUE(bitwise_equal(shared.output.view(), standalone.output.view()));
      EXPECT_TRUE(bitwise_equal(shared.topk_ids.view(), standalone.topk_ids.view()));
      EXPECT_TRUE(bitwise_equal(shared.topk_weights.view(), standalone.topk_weights.view()));
      EXPECT_TRUE(bitwise_equal(shared.output.view(), results[1][0][i].output.view())) << "ranks disagree";
    }
  }
}

// A layer larger than every one before it grows the context before the first forward; after it, one
// that fits is accepted and one that does not is refused (never a silent reallocation).
TEST(RankContextTest, grows_before_the_first_forward_and_refuses_to_after_it) {
  const LayerConfig small = kimi_like_config();
  const LayerConfig large = resized(kimi_k3_config(), {64, 32, 16, 4, 32, 48});
  auto group = make_in_process_group(1);
  const ParallelConfig parallel{1, 0};
  RankContextOptions options;
  options.max_tokens = 8;
  RankContext context(parallel, *group[0], options);
  EXPECT_EQ(context.scratch_bytes(), 0u);

  const LayerWeights small_weights = make_random_layer_weights(small, DType::f32, 1);
  const LayerWeights large_weights = make_random_layer_weights(large, DType::f32, 2);
  auto first = std::make_unique<Runner>(context, small, parallel, small_weights);
  const size_t small_bytes = context.scratch_bytes();
  EXPECT_GT(small_bytes, 0u);
  {
    Runner grown(context, large, parallel, large_weights);
    EXPECT_GT(context.scratch_bytes(), small_bytes);
    EXPECT_EQ(context.num_layers(), 2);
  }
  EXPECT_EQ(context.num_layers(), 1);
  const size_t grown_bytes = context.scratch_bytes();

  // The first layer still runs after the context grew under it (its views follow the buffers).
  const HostTensor x = random_host_tensor(DType::f32, {5, small.hidden_size}, 3);
  HostTensor out(DType::f32, {5, small.hidden_size}), reference_out(DType::f32, {5, small.hidden_size});
  first->forward({x.view()}, {out.view()});
  EXPECT_TRUE(context.frozen());
  Runner standalone(small, parallel, small_weights, *group[0], RunnerOptions{BackendKind::cpu, {}, 8});
  standalone.forward({x.view()}, {reference_out.view()});
  EXPECT_TRUE(bitwise_equal(out.view(), reference_out.view()));

  // Fits what the context holds: accepted after the forward, and runs.
  Runner second(context, small, parallel, small_weights);
  HostTensor second_out(DType::f32, {5, small.hidden_size});
  second.forward({x.view()}, {second_out.view()});
  EXPECT_TRUE(bitwise_equal(second_out.view(), reference_out.view()));
  // Larger than anything registered before the forward: refused, the context unchanged.
  const LayerConfig larger = resized(kimi_k3_config(), {80, 32, 16, 4, 32, 48});
  const LayerWeights larger_weights = make_random_layer_weights(larger, DType::f32, 4);
  const std::string message = message_of([&] { Runner refused(context, larger, parallel, larger_weights); });
  EXPECT_NE(message.find("construct every layer before the first forward"), std::string::npos) << message;
  EXPECT_NE(message.find("shared_partial"), std::string::npos) << message;
  EXPECT_EQ(context.scratch_bytes(), grown_bytes);
  EXPECT_EQ(context.num_layers(), 2);
  // The earlier layers are untouched by the refusal.
  first->forward({x.view()}, {out.view()});
  EXPECT_TRUE(bitwise_equal(out.view(), reference_out.view()));
}

TEST(RankContextTest, refuses_a_layer_sharded_for_another_rank) {
  const LayerConfig config = kimi_like_config();
  const LayerWeights full = make_random_layer_weights(config, DType::f32, 5);
  auto group = make_in_process_group(2);
  RankContext context({2, 0}, *group[0]);
  const LayerWeights rank1 = shard_layer_weights(full, config, {2, 1});
  EXPECT_NE(message_of([&] {
              Runner layer(context, config, {2, 1}, rank1);
            }).find("sharded for rank 1 of tp 2 but its rank context is rank 0 of tp 2"),
            std::string::npos);
  EXPECT_NE(message_of([&] {
              Runner layer(context, config, {1, 0}, full);
            }).find("sharded for rank 0 of tp 1 but its rank context is rank 0 of tp 2"),
            std::string::npos);
  EXPECT_NE(message_of([&] {
              Runner layer(context, config, {2, 0, /*sequence_parallel=*/true}, rank1);
            }).find("(sequence parallel)"),
            std::string::npos);
  EXPECT_EQ(context.num_layers(), 0);
  EXPECT_EQ(context.scratch_bytes(), 0u);
  // The context itself checks its communicator.
  EXPECT_NE(message_of([&] {
              RankContext wrong({2, 1}, *group[0]);
            }).find("the communicator is rank 0 of 2"),
            std::string::npos);
}

}  // namespace
}  // namespace latentmoe

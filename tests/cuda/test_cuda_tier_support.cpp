// The CUDA backend's tier support over a GPU group (src/cuda/backend/tier_support.cpp): every tier
// bounded by the tokens its widest one-shot message fits in the group's buffer, the policy stepping
// past tier 0 above its bound, a forced tier above it failing before any collective is launched, and
// a group of another dtype refusing every tier.
#include <gtest/gtest.h>

#include <string>

#include "cuda_test_util.h"
#include "error_test_util.h"
#include "latentmoe/error.h"
#include "latentmoe/gpu_group.h"
#include "latentmoe/runner.h"
#include "latentmoe/weights.h"
#include "layer_test_util.h"

namespace latentmoe::cuda::testing {
namespace {

using ::latentmoe::testing::message_of;

struct RankZeroOnGpu {
  RankZeroOnGpu(const LayerConfig& config, DType layer_dtype, DType group_dtype, int64_t capacity_elements) {
    GpuGroupOptions group_options;
    group_options.dtype = group_dtype;
    group_options.capacity_elements = capacity_elements;
    group = make_simulated_gpu_group(2, group_options);
    full = make_random_layer_weights(config, layer_dtype, /*seed=*/5, /*with_gate=*/false);
    RunnerOptions options;
    options.backend = BackendKind::cuda;
    options.device_ordinal = 0;
    options.max_tokens = 16;
    options.host_staging = true;
    const ParallelConfig parallel{2, 0, false};
    runner =
        std::make_unique<Runner>(config, parallel, shard_layer_weights(full, config, parallel), *group[0], options);
  }
  std::vector<std::unique_ptr<Communicator>> group;
  LayerWeights full;
  std::unique_ptr<Runner> runner;
};

TEST(CudaTierSupport, bounds_every_tier_by_the_group_capacity) {
  LATENTMOE_REQUIRE_GPU();
  const LayerConfig config = ::latentmoe::testing::kimi_like_config();  // d 40, l 24
  ASSERT_EQ(config.hidden_size, 40);
  ASSERT_EQ(config.latent_size, 24);
  // 320 bf16 = 640 bytes per source region: tier 0 sends l + d/2 = 44 per token (7 tokens), the others
  // at most max(d, l) = 40 (8 tokens).
  RankZeroOnGpu rank(config, DType::bf16, DType::bf16, 320);
  const TierSupport& support = rank.runner->tier_support();
  EXPECT_TRUE(support.peers_reachable);
  EXPECT_EQ(support[TailTier::tail_fusion].max_tokens, 7);
  for (TailTier tier : {TailTier::native, TailTier::allreduce_overlap, TailTier::column_parallel}) {
    EXPECT_TRUE(support[tier].supported);
    EXPECT_EQ(support[tier].max_tokens, 8) << to_string(tier);
  }
  EXPECT_EQ(rank.runner->select_tier(7), TailTier::tail_fusion);
  EXPECT_EQ(rank.runner->select_tier(8), TailTier::allreduce_overlap);

  // A forced tier above its bound fails in forward's check, before anything is launched (so the
  // peer, which never runs here, is not waited for).
  const LocalGroupInputs inputs = ::latentmoe::testing::random_inputs(config, 8, DType::bf16, 3);
  HostTensor output(DType::bf16, {8, config.hidden_size});
  ForwardInputs forward{inputs.hidden_states.view(), inputs.router_logits.view(), {}, TailTier::tail_fusion};
  const std::string message = message_of([&] { rank.runner->forward_host(forward, {output.view(), {}, {}}); });
  EXPECT_NE(message.find("tier tail_fusion carries at most 7 tokens here"), std::string::npos) << message;
  EXPECT_NE(message.find("this call has 8"), std::string::npos) << message;
}

TEST(CudaTierSupport, a_group_of_another_dtype_refuses_every_tier) {
  LATENTMOE_REQUIRE_GPU();
  const LayerConfig config = ::latentmoe::testing::kimi_like_config();
  RankZeroOnGpu rank(config, DType::bf16, DType::f32, 1024);
  for (TailTier tier :
       {TailTier::native, TailTier::tail_fusion, TailTier::allreduce_overlap, TailTier::column_parallel}) {
    EXPECT_FALSE(rank.runner->tier_support()[tier].supported);
    EXPECT_NE(rank.runner->tier_support()[tier].reason.find("carries F32 but this layer runs in BF16"),
              std::string::npos)
        << rank.runner->tier_support()[tier].reason;
  }
}

}  // namespace
}  // namespace latentmoe::cuda::testing

// Two layers of different shapes sharing one per-rank context on the GPU (issue 13 point 6): at tp 2
// on ranks simulated on one GPU, run alternately with different token counts and forced tiers, each
// layer's output is bit-identical to the same layer on a standalone Runner; both layers' forwards,
// captured into one CUDA graph per rank, replay to the same outputs.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <functional>
#include <optional>
#include <thread>

#include "cuda_test_util.h"
#include "latentmoe/compare.h"
#include "latentmoe/gpu_group.h"
#include "latentmoe/rank_context.h"
#include "latentmoe/runner.h"
#include "latentmoe/weights.h"
#include "layer_test_util.h"

namespace latentmoe::cuda::testing {
namespace {

using Step = latentmoe::testing::AlternatingStep;

TEST(CudaRankContext, two_layers_share_a_context_alternately_and_in_one_graph) {
  LATENTMOE_REQUIRE_GPU();
  constexpr int kTp = 2;
  constexpr int64_t kMaxTokens = 33;
  constexpr DType kDtype = DType::bf16;
  const std::vector<LayerConfig> configs = {latentmoe::testing::kimi_like_config(),
                                            latentmoe::testing::nemotron_like_config()};
  std::vector<LayerWeights> full;
  full.push_back(make_random_layer_weights(configs[0], kDtype, 21, /*with_gate=*/true));
  full.push_back(make_random_layer_weights(configs[1], kDtype, 22, /*with_gate=*/false));
  const std::vector<Step> steps = latentmoe::testing::alternating_schedule(kMaxTokens);
  const int num_steps = static_cast<int>(steps.size());

  GpuGroupOptions group_options;
  group_options.dtype = kDtype;
  int64_t widest = 0;
  for (const LayerConfig& config : configs) widest = std::max(widest, config.hidden_size + config.latent_size);
  group_options.capacity_elements = kMaxTokens * widest;
  group_options.timeout = std::chrono::milliseconds(5000);
  auto group = make_simulated_gpu_group(kTp, group_options);

  // Everything device-side is made before any rank runs.
  struct Rank {
    std::unique_ptr<Backend> device = detail::make_cuda_backend(0);
    cudaStream_t stream = nullptr;
    std::unique_ptr<RankContext> context;
    std::vector<std::unique_ptr<Runner>> shared, standalone;
    std::vector<DeviceTensor> x, logits, out_standalone, out_shared, out_graph;
    cudaGraphExec_t graph = nullptr;
    Rank() { EXPECT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess); }
    ~Rank() {
      if (graph != nullptr) cudaGraphExecDestroy(graph);
      cudaStreamDestroy(stream);
    }
  };
  std::vector<std::unique_ptr<Rank>> ranks;
  for (int r = 0; r < kTp; ++r) {
    auto rank = std::make_unique<Rank>();
    const ParallelConfig parallel{kTp, r, false};
    RankContextOptions context_options;
    context_options.backend = BackendKind::cuda;
    context_options.device_ordinal = 0;
    context_options.max_tokens = kMaxTokens;
    rank->context = std::make_unique<RankContext>(parallel, *group[r], context_options);
    RunnerOptions options;
    options.backend = BackendKind::cuda;
    options.device_ordinal = 0;
    options.max_tokens = kMaxTokens;
    for (int layer = 0; layer < 2; ++layer) {
      const LayerWeights shard = shard_layer_weights(full[layer], configs[layer], parallel);
      rank->shared.push_back(std::make_unique<Runner>(*rank->context, configs[layer], parallel, shard));
      rank->standalone.push_back(std::make_unique<Runner>(configs[layer], parallel, shard, *group[r], options));
    }
    EXPECT_EQ(rank->context->num_layers(), 2);
    for (int i = 0; i < num_steps; ++i) {
      const LayerConfig& config = configs[steps[i].layer];
      const int64_t tokens = steps[i].num_tokens;
      rank->x.push_back(
          upload(*rank->device, latentmoe::testing::random_host_tensor(kDtype, {tokens, config.hidden_size}, 300 + i)));
      rank->logits.push_back(upload(
          *rank->device,
          latentmoe::testing::random_host_tensor(DType::f32, {tokens, config.num_router_outputs()}, 400 + i, 3.0f)));
      for (auto* outs : {&rank->out_standalone, &rank->out_shared, &rank->out_graph}) {
        outs->push_back(poisoned(*rank->device, kDtype, {tokens, config.hidden_size}));
      }
    }
    rank->device->synchronize();
    ranks.push_back(std::move(rank));
  }
  auto forward = [&](int r, int i, bool shared, const std::vector<DeviceTensor>& outs) {
    Rank& rank = *ranks[r];
    const Step& step = steps[i];
    ForwardInputs inputs;
    inputs.hidden_states = rank.x[i].view;
    if (step.layer == 1) inputs.router_logits = rank.logits[i].view;
    inputs.tier = step.tier;
    Runner& runner = shared ? *rank.shared[step.layer] : *rank.standalone[step.layer];
    const TailTier tier = runner.forward(inputs, ForwardOutputs{outs[i].view, {}, {}}, rank.stream);
    if (step.tier.has_value()) EXPECT_EQ(tier, *step.tier);
  };

  // Eager, alternating the layers: the standalone runner, then the shared-context one, every step.
  on_rank_threads(kTp, [&](int r) {
    for (int i = 0; i < num_steps; ++i) {
      forward(r, i, false, ranks[r]->out_standalone);
      forward(r, i, true, ranks[r]->out_shared);
    }
    ASSERT_EQ(cudaStreamSynchronize(ranks[r]->stream), cudaSuccess);
    group[r]->check();
  });
  for (int r = 0; r < kTp; ++r) EXPECT_TRUE(ranks[r]->context->frozen());

  // Both layers' forwards, every step, in one graph per rank (capture runs nothing: rank by rank).
  for (int r = 0; r < kTp; ++r) {
    cudaGraph_t graph = nullptr;
    ASSERT_EQ(cudaStreamBeginCapture(ranks[r]->stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    try {
      for (int i = 0; i < num_steps; ++i) forward(r, i, true, ranks[r]->out_graph);
    } catch (...) {
      cudaStreamEndCapture(ranks[r]->stream, &graph);
      throw;
    }
    ASSERT_EQ(cudaStreamEndCapture(ranks[r]->stream, &graph), cudaSuccess);
    ASSERT_EQ(cudaGraphInstantiate(&ranks[r]->graph, graph, 0), cudaSuccess);
    ASSERT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  }
  constexpr int kReplays = 3;
  for (int replay = 0; replay < kReplays; ++replay) {
    on_rank_threads(kTp, [&](int r) {
      Rank& rank = *ranks[r];
      for (const DeviceTensor& out : rank.out_graph) {
        ASSERT_EQ(cudaMemsetAsync(out.buffer.get(), 0xff, out.buffer.bytes(), rank.stream), cudaSuccess);
      }
      ASSERT_EQ(cudaGraphLaunch(rank.graph, rank.stream), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(rank.stream), cudaSuccess);
      group[r]->check();
    });
    for (int r = 0; r < kTp; ++r) {
      for (int i = 0; i < num_steps; ++i) {
        SCOPED_TRACE("replay " + std::to_string(replay) + ", rank " + std::to_string(r) + ", step " +
                     std::to_string(i));
        const HostTensor standalone = download(*ranks[r]->device, ranks[r]->out_standalone[i].view);
        EXPECT_EQ(count_non_finite(standalone), 0);
        if (replay == 0) {
          EXPECT_TRUE(
              bitwise_equal(download(*ranks[r]->device, ranks[r]->out_shared[i].view).view(), standalone.view()));
          EXPECT_TRUE(
              bitwise_equal(standalone.view(), download(*ranks[0]->device, ranks[0]->out_standalone[i].view).view()))
              << "ranks disagree";
        }
        EXPECT_TRUE(bitwise_equal(download(*ranks[r]->device, ranks[r]->out_graph[i].view).view(), standalone.view()));
      }
    }
  }
}

}  // namespace
}  // namespace latentmoe::cuda::testing

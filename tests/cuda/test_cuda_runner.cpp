// A first runner-level check of the CUDA backend: the whole layer at tp 1 (Runner with
// --backend cuda, host tensors staged through forward_host) against the same Runner on the CPU
// reference backend, for both reference families, f32 and bf16, decode and odd prefill sizes.
// (Several ranks need a device communicator; those tests come with it.)
#include <gtest/gtest.h>

#include "cuda_test_util.h"
#include "latentmoe/error.h"
#include "latentmoe/in_process_group.h"
#include "latentmoe/runner.h"
#include "latentmoe/weights.h"
#include "layer_test_util.h"

namespace latentmoe::cuda::testing {
namespace {

struct LayerOutputs {
  HostTensor output, ids, weights;
};

LayerOutputs run_layer(BackendKind kind, const LayerConfig& config, const LayerWeights& weights, const HostTensor& x,
                       const HostTensor* logits) {
  auto group = make_in_process_group(1);
  RunnerOptions options;
  options.backend = kind;
  options.max_tokens = 64;
  options.host_staging = true;
  Runner runner(config, ParallelConfig{}, weights, *group[0], options);
  const int64_t tokens = x.size(0);
  LayerOutputs out{HostTensor(x.dtype(), {tokens, config.hidden_size}), HostTensor(DType::i32, {tokens, config.top_k}),
                   HostTensor(DType::f32, {tokens, config.top_k})};
  ForwardInputs inputs;
  inputs.hidden_states = x.view();
  if (logits != nullptr) inputs.router_logits = logits->view();
  runner.forward_host(inputs, ForwardOutputs{out.output.view(), out.ids.view(), out.weights.view()});
  return out;
}

// MXFP4 routed experts (issue 16) have no CUDA kernels yet: building the runner is one clear error,
// never a silent fallback.
TEST(CudaRunner, mxfp4_experts_are_refused_when_the_runner_is_built) {
  LATENTMOE_REQUIRE_GPU();
  LayerConfig config = resized(kimi_k3_config(), {40, 64, 6, 3, 256, 40});
  config.experts_format = ExpertWeightFormat::mxfp4;
  const LayerWeights weights = make_random_layer_weights(config, DType::bf16, 3);
  auto group = make_in_process_group(1);
  RunnerOptions options;
  options.backend = BackendKind::cuda;
  options.max_tokens = 8;
  try {
    Runner runner(config, ParallelConfig{}, weights, *group[0], options);
    ADD_FAILURE() << "the CUDA runner accepted MXFP4 experts";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("does not run MXFP4 experts yet"), std::string::npos) << error.what();
  }
}

TEST(CudaRunner, tp1_layer_matches_the_cpu_runner) {
  LATENTMOE_REQUIRE_GPU();
  uint64_t seed = 1;
  for (const LayerConfig& config :
       {latentmoe::testing::kimi_like_config(), latentmoe::testing::nemotron_like_config()}) {
    for (DType dtype : {DType::f32, DType::bf16}) {
      const LayerWeights weights = make_random_layer_weights(config, dtype, ++seed);
      for (int64_t tokens : {int64_t{1}, int64_t{17}, int64_t{64}}) {
        SCOPED_TRACE(std::string(to_string(config.activation)) + ", " + name_of(dtype) +
                     ", T = " + std::to_string(tokens));
        const HostTensor x = latentmoe::testing::random_host_tensor(dtype, {tokens, config.hidden_size}, ++seed);
        // f32: logits from the gate on each backend (identical top-k required); bf16: given logits.
        const HostTensor logits =
            latentmoe::testing::random_host_tensor(DType::f32, {tokens, config.num_router_outputs()}, ++seed, 3.0f);
        const HostTensor* given = dtype == DType::f32 ? nullptr : &logits;
        const LayerOutputs ref = run_layer(BackendKind::cpu, config, weights, x, given);
        const LayerOutputs got = run_layer(BackendKind::cuda, config, weights, x, given);
        EXPECT_EQ(std::memcmp(got.ids.data(), ref.ids.data(), ref.ids.nbytes()), 0) << "topk_ids differ";
        EXPECT_LT(relative_error(got.weights, ref.weights), 1e-6);
        EXPECT_EQ(count_non_finite(got.output), 0);
        EXPECT_LT(relative_error(got.output, ref.output), tolerance(dtype));
      }
    }
  }
}

}  // namespace
}  // namespace latentmoe::cuda::testing

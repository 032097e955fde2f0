// A first runner-level check of the CUDA backend: the whole layer at tp 1 (Runner with
// --backend cuda, host tensors staged through forward_host) against the same Runner on the CPU
// reference backend, for both reference families, f32 and bf16, decode and odd prefill sizes.
// (Several ranks need a device communicator; those tests come with it.)
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <functional>

#include "checkpoint_test_util.h"
#include "cuda_test_util.h"
#include "error_test_util.h"
#include "latentmoe/checkpoint.h"
#include "latentmoe/compare.h"
#include "latentmoe/error.h"
#include "latentmoe/gpu_group.h"
#include "latentmoe/in_process_group.h"
#include "latentmoe/local_group.h"
#include "latentmoe/presets.h"
#include "latentmoe/runner.h"
#include "latentmoe/weights.h"
#include "layer_test_util.h"

namespace latentmoe::cuda::testing {
namespace {

struct LayerOutputs {
  HostTensor output, ids, weights;
};

LayerOutputs run_layer(BackendKind kind, const LayerConfig& config, const LayerWeightViews& weights,
                       const HostTensor& x, const HostTensor* logits) {
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

LayerOutputs run_layer(BackendKind kind, const LayerConfig& config, const LayerWeights& weights, const HostTensor& x,
                       const HostTensor* logits) {
  return run_layer(kind, config, views_of(weights), x, logits);
}

// The layer on `tp` simulated GPU ranks against the CPU runner on the same rank weights: within the
// dtype's tolerance, finite, the same routing, every rank the same output.
void expect_cuda_matches_cpu(const LayerConfig& config, const std::function<LayerWeights(const ParallelConfig&)>& load,
                             const LocalGroupInputs& inputs, int tp, DType dtype) {
  LocalGroupOptions options;
  options.tp_size = tp;
  options.backend = BackendKind::cpu;
  const auto ref = run_local_group(config, load, inputs, options);
  options.backend = BackendKind::cuda;
  options.placement = GpuPlacement::simulated;
  const auto got = run_local_group(config, load, inputs, options);
  EXPECT_EQ(count_non_finite(got[0].output), 0);
  EXPECT_LT(relative_error(got[0].output, ref[0].output), tolerance(dtype));
  EXPECT_TRUE(bitwise_equal(got[0].topk_ids.view(), ref[0].topk_ids.view()));
  for (int r = 1; r < tp; ++r) EXPECT_TRUE(bitwise_equal(got[r].output.view(), got[0].output.view())) << "rank " << r;
}

// Every 7th scale byte of an MXFP4 expert tensor set to one of the edge exponents 0 (2^-127, the
// subnormal), 1, 126, 127 and 128 in turn; the CPU runner decodes them exactly.
void set_edge_scales(HostTensor& scales) {
  if (!scales.defined()) return;  // relu2 has no gate
  constexpr uint8_t kEdges[] = {0, 1, 126, 127, 128};
  auto* bytes = scales.data_as<uint8_t>();
  for (int64_t i = 0; i < scales.numel(); i += 7) bytes[i] = kEdges[(i / 7) % 5];
}

// MXFP4 routed experts (issue 16), decoded in registers: the whole layer at tp 1 and on 2 simulated
// ranks against the CPU runner (which decodes exactly), situ and silu with a gate, relu2 without,
// 1..8 tokens on the decode kernels (bf16, f16: tensor cores, down with four items in flight at one token and two at
// 3 and 8; f32: CUDA cores; tokens sharing experts),
// 9, 37 and 150 tokens on the grouped GEMMs (above kMxfp4DecodeTokens: the rows kernel, the tile kernels; f32 in
// batches of 8 on the decode kernels at every count), a latent long enough for the unrolled loop and its remainder (544
// = 17 groups over 8 warps; a partial last k-tile of the grouped GEMM), edge scale bytes.
TEST(CudaRunner, mxfp4_experts_match_the_cpu_runner) {
  LATENTMOE_REQUIRE_GPU();
  LayerConfig kimi = resized(kimi_k3_config(), {40, 64, 6, 3, 256, 40});
  kimi.experts_format = ExpertWeightFormat::mxfp4;
  LayerConfig kimi_long = resized(kimi_k3_config(), {48, 544, 9, 4, 320, 40});
  kimi_long.experts_format = ExpertWeightFormat::mxfp4;
  kimi_long.activation = Activation::silu;  // the third activation kind
  LayerConfig nemotron = nemotron3_super_config();
  nemotron.zero_expert_num = 2;
  nemotron = resized(nemotron, {48, 32, 5, 3, 256, 72});
  nemotron.experts_format = ExpertWeightFormat::mxfp4;
  uint64_t seed = 40;
  for (const LayerConfig& config : {kimi, kimi_long, nemotron}) {
    for (DType dtype : {DType::bf16, DType::f16, DType::f32}) {
      LayerWeights weights = make_random_layer_weights(config, dtype, ++seed);
      set_edge_scales(weights.expert_gate_scale);
      set_edge_scales(weights.expert_up_scale);
      set_edge_scales(weights.expert_down_scale);
      // 1-8 tokens: the decode kernels; 9, 37 and 150 the grouped tensor-core GEMMs' MXFP4 shapes
      // (about 5, 18 and 75 rows per expert here); f32 runs above 8 tokens in batches of 8.
      for (int64_t tokens : {int64_t{1}, int64_t{3}, int64_t{8}, int64_t{9}, int64_t{37}, int64_t{150}}) {
        for (int tp : {1, 2}) {
          SCOPED_TRACE(std::string(to_string(config.activation)) + ", l " + std::to_string(config.latent_size) + ", " +
                       name_of(dtype) + ", T " + std::to_string(tokens) + ", tp " + std::to_string(tp));
          const LocalGroupInputs inputs = latentmoe::testing::random_inputs(config, tokens, dtype, seed + tokens);
          expect_cuda_matches_cpu(
              config, [&](const ParallelConfig& parallel) { return shard_layer_weights(weights, config, parallel); },
              inputs, tp, dtype);
        }
      }
    }
  }
}

// Sets an environment variable for its lifetime, then unsets it (also when a check throws).
class ScopedVariable {
 public:
  ScopedVariable(const char* name, const char* value) : name_(name) { ::setenv(name, value, 1); }
  ~ScopedVariable() { ::unsetenv(name_); }
  ScopedVariable(const ScopedVariable&) = delete;
  ScopedVariable& operator=(const ScopedVariable&) = delete;

 private:
  const char* name_;
};

// Issue 31: MXFP4 codes an engine keeps on the GPU (device views, used in place) must be in the kernel order. In
// the canonical order the runner refuses them, naming the tensor and the conversion; converted by the public
// mxfp4_to_kernel_order they give bit for bit the output of the same codes passed from the host (which the runner
// copies and converts itself): the decode kernels (bf16, f16 on the tensor cores, f32 on the CUDA cores) and the
// grouped GEMMs (64 tokens).
TEST(CudaRunner, mxfp4_device_codes_converted_in_place_match_host_codes) {
  LATENTMOE_REQUIRE_GPU();
  LayerConfig config = resized(kimi_k3_config(), {40, 64, 6, 3, 256, 40});
  config.experts_format = ExpertWeightFormat::mxfp4;
  uint64_t seed = 310;
  for (DType dtype : {DType::bf16, DType::f16, DType::f32}) {
    const LayerWeights weights = make_random_layer_weights(config, dtype, ++seed);
    auto staging = ::latentmoe::detail::make_cuda_backend(0);
    LayerWeightViews views = views_of(weights);
    std::vector<DeviceTensor> codes;
    for (TensorView* field : {&views.expert_gate, &views.expert_up, &views.expert_down}) {
      codes.push_back(upload(*staging, to_host_tensor(*field, DType::u8)));
      *field = codes.back().view;
    }
    staging->synchronize();
    const HostTensor x = random_tensor(dtype, {64, config.hidden_size}, static_cast<uint32_t>(++seed));
    latentmoe::testing::expect_error([&] { run_layer(BackendKind::cuda, config, views, x, nullptr); },
                                     {"expert_gate holds MXFP4 codes on the GPU in the canonical order",
                                      "mxfp4_to_kernel_order", "expert_code_order"});
    for (const DeviceTensor& tensor : codes)
      ::latentmoe::mxfp4_to_kernel_order(tensor.view);  // the legacy default stream
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    views.expert_code_order = Mxfp4CodeOrder::kernel;
    for (int64_t tokens : {3, 64}) {
      const HostTensor xt = to_host_tensor(x.view().slice_rows(0, tokens), dtype);
      const LayerOutputs from_host = run_layer(BackendKind::cuda, config, weights, xt, nullptr);
      const LayerOutputs from_device = run_layer(BackendKind::cuda, config, views, xt, nullptr);
      EXPECT_TRUE(bitwise_equal(from_device.output.view(), from_host.output.view())) << name_of(dtype) << " " << tokens;
      EXPECT_TRUE(bitwise_equal(from_device.ids.view(), from_host.ids.view())) << name_of(dtype) << " " << tokens;
      // And both are the layer (the CPU reference reads the canonical host codes).
      const LayerOutputs reference = run_layer(BackendKind::cpu, config, weights, xt, nullptr);
      EXPECT_LT(relative_error(from_host.output, reference.output), tolerance(dtype))
          << name_of(dtype) << " " << tokens;
    }
  }
}

// The MXFP4 tensor-core gate/up kernel with 1 and 2 warps per tile along K (the test above runs the
// automatic choice, which its small layers make 8): forced through LATENTMOE_MXFP4_GATE_UP_SPLIT, which
// each rank's backend reads when the runner makes it. A latent
// of 544 (17 groups: a partial chunk, taken by a different warp per split), 20 tiles of 16 rows (the last
// CTA's tiles past the matrix at 8 tiles a CTA), gated and relu2, bf16 and f16, 3 and 8 tokens (and 37, which
// the grouped GEMMs take); every result against the CPU runner.
TEST(CudaRunner, mxfp4_gate_up_with_fewer_warps_per_tile_matches_the_cpu_runner) {
  LATENTMOE_REQUIRE_GPU();
  LayerConfig kimi_long = resized(kimi_k3_config(), {48, 544, 9, 4, 320, 40});
  kimi_long.experts_format = ExpertWeightFormat::mxfp4;
  LayerConfig nemotron = nemotron3_super_config();
  nemotron = resized(nemotron, {48, 544, 5, 3, 320, 72});
  nemotron.experts_format = ExpertWeightFormat::mxfp4;
  uint64_t seed = 90;
  for (const char* split : {"1", "2"}) {
    const ScopedVariable forced("LATENTMOE_MXFP4_GATE_UP_SPLIT", split);
    for (const LayerConfig& config : {kimi_long, nemotron}) {
      for (DType dtype : {DType::bf16, DType::f16}) {
        const LayerWeights weights = make_random_layer_weights(config, dtype, ++seed);
        for (int64_t tokens : {int64_t{3}, int64_t{8}, int64_t{37}}) {
          SCOPED_TRACE(std::string("split ") + split + ", " + std::string(to_string(config.activation)) + ", " +
                       name_of(dtype) + ", T " + std::to_string(tokens));
          const LocalGroupInputs inputs = latentmoe::testing::random_inputs(config, tokens, dtype, seed + tokens);
          expect_cuda_matches_cpu(
              config, [&](const ParallelConfig& parallel) { return shard_layer_weights(weights, config, parallel); },
              inputs, 1, dtype);
        }
      }
    }
  }
  const ScopedVariable forced("LATENTMOE_MXFP4_GATE_UP_SPLIT", "3");  // anything but 1, 2 or 8 is refused by name
  const LayerWeights weights = make_random_layer_weights(kimi_long, DType::bf16, 7);
  const std::string message = latentmoe::testing::message_of([&] {
    expect_cuda_matches_cpu(
        kimi_long, [&](const ParallelConfig& parallel) { return shard_layer_weights(weights, kimi_long, parallel); },
        latentmoe::testing::random_inputs(kimi_long, 2, DType::bf16, 8), 1, DType::bf16);
  });
  EXPECT_NE(message.find("LATENTMOE_MXFP4_GATE_UP_SPLIT='3' is out of range; expected 1, 2 or 8 (warps per tile)"),
            std::string::npos)
      << message;
}

// The grouped MXFP4 path at every token count, down to one token: LATENTMOE_MXFP4_DECODE_MAX_TOKENS=0 sends
// what the decode kernels would take to the grouped GEMMs, whose automatic choice is the rows kernel here
// (at most 16 rows per touched expert). A latent of 544 and I of 320 (17 and 10 scale groups: partial
// 128-column steps, unaligned scale words) and one of 512 and 256 (whole steps), gated and relu2, bf16 and
// f16, tp 1 and 2, against the CPU runner; 9 and 16 tokens in batches of 8 on the decode kernels (the setting
// at 16); a value past 64 is refused by name.
TEST(CudaRunner, mxfp4_grouped_rows_kernel_from_one_token_matches_the_cpu_runner) {
  LATENTMOE_REQUIRE_GPU();
  LayerConfig kimi_long = resized(kimi_k3_config(), {48, 544, 9, 4, 320, 40});
  kimi_long.experts_format = ExpertWeightFormat::mxfp4;
  LayerConfig nemotron = resized(nemotron3_super_config(), {48, 544, 5, 3, 320, 72});
  nemotron.experts_format = ExpertWeightFormat::mxfp4;
  // Whole 128-column steps (aligned scale words: the bf16 path that folds the scales into the operands).
  LayerConfig kimi_aligned = resized(kimi_k3_config(), {48, 512, 9, 4, 256, 40});
  kimi_aligned.experts_format = ExpertWeightFormat::mxfp4;
  uint64_t seed = 190;
  {
    const ScopedVariable forced("LATENTMOE_MXFP4_DECODE_MAX_TOKENS", "0");
    for (const LayerConfig& config : {kimi_long, nemotron, kimi_aligned}) {
      for (DType dtype : {DType::bf16, DType::f16}) {
        const LayerWeights weights = make_random_layer_weights(config, dtype, ++seed);
        for (int64_t tokens : {int64_t{1}, int64_t{2}, int64_t{8}, int64_t{17}}) {
          for (int tp : {1, 2}) {
            SCOPED_TRACE(std::string(to_string(config.activation)) + ", " + name_of(dtype) + ", T " +
                         std::to_string(tokens) + ", tp " + std::to_string(tp));
            const LocalGroupInputs inputs = latentmoe::testing::random_inputs(config, tokens, dtype, seed + tokens);
            expect_cuda_matches_cpu(
                config, [&](const ParallelConfig& parallel) { return shard_layer_weights(weights, config, parallel); },
                inputs, tp, dtype);
          }
        }
      }
    }
  }
  {
    // Above 8 tokens the decode kernels run in batches of 8 where the setting sends them there (9 and 16
    // tokens: a partial and a whole second batch).
    const ScopedVariable batches("LATENTMOE_MXFP4_DECODE_MAX_TOKENS", "16");
    for (const LayerConfig& config : {kimi_long, nemotron}) {
      const LayerWeights weights = make_random_layer_weights(config, DType::bf16, ++seed);
      for (int64_t tokens : {int64_t{9}, int64_t{16}}) {
        SCOPED_TRACE(std::string(to_string(config.activation)) + ", batches of 8, T " + std::to_string(tokens));
        const LocalGroupInputs inputs = latentmoe::testing::random_inputs(config, tokens, DType::bf16, seed + tokens);
        expect_cuda_matches_cpu(
            config, [&](const ParallelConfig& parallel) { return shard_layer_weights(weights, config, parallel); },
            inputs, 1, DType::bf16);
      }
    }
  }
  const ScopedVariable forced("LATENTMOE_MXFP4_DECODE_MAX_TOKENS", "65");
  const LayerWeights weights = make_random_layer_weights(kimi_long, DType::bf16, 7);
  const std::string message = latentmoe::testing::message_of([&] {
    expect_cuda_matches_cpu(
        kimi_long, [&](const ParallelConfig& parallel) { return shard_layer_weights(weights, kimi_long, parallel); },
        latentmoe::testing::random_inputs(kimi_long, 2, DType::bf16, 8), 1, DType::bf16);
  });
  EXPECT_NE(
      message.find("LATENTMOE_MXFP4_DECODE_MAX_TOKENS='65' is out of range; expected an integer in 0..64 (tokens)"),
      std::string::npos)
      << message;
}

// The MXFP4 pair kernels in the layer (mxfp4_pairs.h: bf16 activations up to LATENTMOE_MXFP4_PAIRS_MAX_TOKENS tokens;
// the tests above run the default bound, kMxfp4PairsTokens) at 8 and at 2, and with the setting at 0 the tile decode
// kernels, which bf16 then takes at every count (and above 2 tokens at 2): situ with a gate, relu2 with zero experts,
// latents of 544 (17 scale groups) and 32 (one), I of 320 (10 groups; 5 a rank at tp 2), 1, 2, 3 and 8 tokens, tp 1 and
// 2, scale bytes of 129 and 131 among the edge bytes (the folded products' second path), against the CPU runner. A
// value past 8 is refused by name.
TEST(CudaRunner, mxfp4_pair_and_tile_decode_kernels_match_the_cpu_runner) {
  LATENTMOE_REQUIRE_GPU();
  LayerConfig kimi_long = resized(kimi_k3_config(), {48, 544, 9, 4, 320, 40});
  kimi_long.experts_format = ExpertWeightFormat::mxfp4;
  LayerConfig nemotron = nemotron3_super_config();
  nemotron.zero_expert_num = 2;
  nemotron = resized(nemotron, {48, 32, 5, 3, 320, 72});
  nemotron.experts_format = ExpertWeightFormat::mxfp4;
  auto large_scales = [](HostTensor& scales) {
    if (!scales.defined()) return;
    set_edge_scales(scales);
    auto* bytes = scales.data_as<uint8_t>();
    for (int64_t i = 3; i < scales.numel(); i += 11) bytes[i] = i % 2 == 0 ? 129 : 131;
  };
  uint64_t seed = 500;
  for (const char* bound : {"8", "2", "0"}) {
    const ScopedVariable forced("LATENTMOE_MXFP4_PAIRS_MAX_TOKENS", bound);
    for (const LayerConfig& config : {kimi_long, nemotron}) {
      LayerWeights weights = make_random_layer_weights(config, DType::bf16, ++seed);
      large_scales(weights.expert_gate_scale);
      large_scales(weights.expert_up_scale);
      large_scales(weights.expert_down_scale);
      for (int64_t tokens : {int64_t{1}, int64_t{2}, int64_t{3}, int64_t{8}}) {
        for (int tp : {1, 2}) {
          SCOPED_TRACE(std::string("pairs up to ") + bound + " tokens, " + std::string(to_string(config.activation)) +
                       ", T " + std::to_string(tokens) + ", tp " + std::to_string(tp));
          const LocalGroupInputs inputs = latentmoe::testing::random_inputs(config, tokens, DType::bf16, seed + tokens);
          expect_cuda_matches_cpu(
              config, [&](const ParallelConfig& parallel) { return shard_layer_weights(weights, config, parallel); },
              inputs, tp, DType::bf16);
        }
      }
    }
  }
  const ScopedVariable forced("LATENTMOE_MXFP4_PAIRS_MAX_TOKENS", "9");
  const LayerWeights weights = make_random_layer_weights(kimi_long, DType::bf16, 7);
  const std::string message = latentmoe::testing::message_of([&] {
    expect_cuda_matches_cpu(
        kimi_long, [&](const ParallelConfig& parallel) { return shard_layer_weights(weights, kimi_long, parallel); },
        latentmoe::testing::random_inputs(kimi_long, 2, DType::bf16, 8), 1, DType::bf16);
  });
  EXPECT_NE(message.find("LATENTMOE_MXFP4_PAIRS_MAX_TOKENS='9' is out of range; expected an integer in 0..8 (tokens)"),
            std::string::npos)
      << message;
}

// Issue 16's end-to-end case on the GPU: a Kimi-K3-style checkpoint (MXFP4 experts under the K3 names
// and prefix, three shards and an index, another layer's tensor beside them) loaded per rank straight
// from the index, run on the CUDA backend at tp 1, 2, 4 and 8 (simulated ranks) with 37 tokens, against
// the CPU backend on the same loaded shards: within bf16 rounding, the same routing, every rank the same.
TEST(CudaRunner, a_sharded_k3_mxfp4_checkpoint_runs_at_every_tp) {
  LATENTMOE_REQUIRE_GPU();
  namespace fs = std::filesystem;
  LayerConfig config = resized(kimi_k3_config(), {40, 64, 6, 3, 256, 40});
  config.experts_format = ExpertWeightFormat::mxfp4;
  const std::string prefix = "language_model.model.layers.3.block_sparse_moe.";
  const fs::path dir = fs::temp_directory_path() / ("latentmoe_cuda_k3_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  save_layer_weights((dir / "single.safetensors").string(), make_random_layer_weights(config, DType::bf16, 23), config,
                     prefix);
  auto tensors = latentmoe::testing::read_all_tensors((dir / "single.safetensors").string());
  tensors.emplace_back("language_model.model.layers.4.block_sparse_moe.experts.0.w1.weight_packed",
                       HostTensor(DType::u8, {2, 2}));
  const std::string index = latentmoe::testing::write_sharded_checkpoint(dir / "k3", tensors, 3);
  const Checkpoint checkpoint = Checkpoint::open(index);
  const LocalGroupInputs inputs = latentmoe::testing::random_inputs(config, 37, DType::bf16, 29);
  for (int tp : {1, 2, 4, 8}) {
    SCOPED_TRACE("tp " + std::to_string(tp));
    expect_cuda_matches_cpu(
        config,
        [&](const ParallelConfig& parallel) {
          return load_layer_weights(checkpoint, config, prefix, parallel, DType::bf16);
        },
        inputs, tp, DType::bf16);
  }
  fs::remove_all(dir);
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

// The skinny kernels (cuda/gemm/skinny_gemm.h) against the CPU reference: dense projections (linear, with
// accumulation and a strided output) and the routed experts at 1-8 tokens, every activation, bf16 and
// f16, shapes whose n is not a multiple of 16 and whose k is not a multiple of 32, shared, repeated and
// zero experts; every launch shape (dense MLP included); that the backend takes them for decode-sized
// batches (bit-identical to the direct call) and falls back when it must; graph replay with new
// routings; bad arguments. The dense MLP's activation matrix is test_cuda_backend.cpp's DenseMlp/skinny,
// a token of zero experts test_cuda_experts.cpp's ZeroExperts/skinny_bf16.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda/backend/cuda_backend.h"
#include "cuda/common/device.h"
#include "cuda/gemm/skinny_gemm.h"
#include "cuda_test_util.h"
#include "latentmoe/compare.h"
#include "latentmoe/error.h"

namespace latentmoe::cuda::testing {
namespace {

using ::latentmoe::detail::ActivationParams;
using ::latentmoe::detail::make_cpu_backend;
using ::latentmoe::detail::MlpWeights;

// topk_ids [tokens, k] drawn from [0, E + Z): distinct per token unless `repeats`.
HostTensor draw_ids(int64_t tokens, int64_t k, int64_t num_experts, int64_t num_zero, uint32_t seed, bool repeats) {
  HostTensor ids(DType::i32, {tokens, k});
  std::mt19937 generator(seed);
  std::vector<int32_t> all(static_cast<size_t>(num_experts + num_zero));
  std::iota(all.begin(), all.end(), 0);
  std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(num_experts + num_zero - 1));
  for (int64_t t = 0; t < tokens; ++t) {
    std::shuffle(all.begin(), all.end(), generator);
    for (int64_t j = 0; j < k; ++j) ids.data_as<int32_t>()[t * k + j] = repeats ? pick(generator) : all[j];
  }
  return ids;
}

class Skinny : public ::testing::Test {
 protected:
  void SetUp() override {
    LATENTMOE_REQUIRE_GPU();
    gpu_ = std::make_unique<CudaBackend>(0);
    gpu_->set_skinny_always(true);  // every decode-sized call, not only where they are measured faster
    cpu_ = make_cpu_backend();
  }
  cudaStream_t stream() const { return static_cast<cudaStream_t>(gpu_->stream()); }

  // linear through the backend (skinny) and the direct call; against the CPU backend.
  void check_linear(DType dtype, int64_t tokens, int64_t n, int64_t k, bool accumulate, int64_t ld_out, uint32_t seed) {
    SCOPED_TRACE(name_of(dtype) + ", T = " + std::to_string(tokens) + ", n = " + std::to_string(n) + ", k = " +
                 std::to_string(k) + (accumulate ? ", accumulate" : "") + ", ld = " + std::to_string(ld_out));
    ASSERT_EQ(gpu_->skinny_max_tokens(), kSkinnyMaxRows);
    const HostTensor x = random_tensor(dtype, {tokens, k}, seed, -1.0f, 1.0f);
    const HostTensor w = random_tensor(dtype, {n, k}, seed + 1, -0.2f, 0.2f);
    const HostTensor y0 = random_tensor(dtype, {tokens, ld_out}, seed + 2, -1.0f, 1.0f);
    HostTensor ref = to_host_tensor(y0.view(), dtype);
    const TensorView ref_block = ref.view().slice_cols(0, n);
    cpu_->linear(x.view(), w.view(), ref_block, accumulate);

    DeviceTensor dx = upload(*gpu_, x), dw = upload(*gpu_, w), dy = upload(*gpu_, y0), dy_direct = upload(*gpu_, y0);
    if (!accumulate) {  // unwritten outputs show as NaN
      poison(*gpu_, dy);
      poison(*gpu_, dy_direct);
    }
    gpu_->linear(dx.view, dw.view, dy.view.slice_cols(0, n), accumulate);
    skinny_down(dtype, SkinnyRouting{}, {dx.view.data(), k}, tokens, SkinnyWeights{nullptr, dw.view.data(), n, k, k, 0},
                dy_direct.view.data(), ld_out, accumulate, stream(), shape_);
    const HostTensor got = download(*gpu_, dy.view), direct = download(*gpu_, dy_direct.view);
    EXPECT_TRUE(bitwise_equal(got.view(), direct.view())) << "the backend did not take the skinny kernel";
    HostTensor block(dtype, {tokens, n}), ref_only(dtype, {tokens, n});
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t c = 0; c < ld_out; ++c) {
        const float value = value_at(got, t * ld_out + c);
        if (c < n) {
          store_from_float(block.data(), dtype, t * n + c, value);
          store_from_float(ref_only.data(), dtype, t * n + c, value_at(ref, t * ld_out + c));
        } else if (accumulate) {
          ASSERT_EQ(value, value_at(y0, t * ld_out + c)) << "column " << c << " past n was written";
        } else {
          ASSERT_TRUE(std::isnan(value)) << "column " << c << " past n was written";
        }
      }
    }
    EXPECT_EQ(count_non_finite(block), 0);
    EXPECT_LT(relative_error(block, ref_only), tolerance(dtype));
  }

  // routed_experts with the skinny kernels, and (the same inputs) with them turned off.
  void check_routed(Activation act, DType dtype, int64_t tokens, int64_t num_experts, int64_t num_zero, int64_t k,
                    int64_t latent, int64_t inter, uint32_t seed, bool repeats = false) {
    SCOPED_TRACE(std::string(to_string(act)) + ", " + name_of(dtype) + ", T = " + std::to_string(tokens) +
                 ", E = " + std::to_string(num_experts) + " + " + std::to_string(num_zero) +
                 ", k = " + std::to_string(k) + ", l = " + std::to_string(latent) + ", I = " + std::to_string(inter) +
                 (repeats ? ", repeated ids" : ""));
    WorkspaceSpec spec;
    spec.max_tokens = kSkinnyMaxRows;
    spec.element_size = dtype_size(dtype);
    spec.num_experts = num_experts;
    spec.top_k = k;
    spec.latent_size = latent;
    spec.expert_intermediate = inter;
    gpu_->prepare(spec);
    ActivationParams activation;
    activation.activation = act;
    const bool gated = act != Activation::relu2;
    const int64_t e = num_experts;
    const HostTensor z = random_tensor(dtype, {tokens, latent}, seed + 1, -2.0f, 2.0f);
    const HostTensor gate = random_tensor(dtype, {e, inter, latent}, seed + 2, -0.15f, 0.15f);
    const HostTensor up = random_tensor(dtype, {e, inter, latent}, seed + 3, -0.15f, 0.15f);
    const HostTensor down = random_tensor(dtype, {e, latent, inter}, seed + 4, -0.15f, 0.15f);
    const HostTensor ids = draw_ids(tokens, k, e, num_zero, seed + 5, repeats);
    const HostTensor weights = random_tensor(DType::f32, {tokens, k}, seed + 6, 0.05f, 1.0f);
    HostTensor ref(dtype, {tokens, latent});
    cpu_->routed_experts(activation, z.view(), ids.view(), weights.view(),
                         MlpWeights{gated ? gate.view() : TensorView(), up.view(), down.view()}, ref.view());
    DeviceTensor dz = upload(*gpu_, z), dgate = upload(*gpu_, gate), dup = upload(*gpu_, up),
                 ddown = upload(*gpu_, down), dids = upload(*gpu_, ids), dweights = upload(*gpu_, weights);
    const MlpWeights experts{gated ? dgate.view : TensorView(), dup.view, ddown.view};
    DeviceTensor dout = poisoned(*gpu_, dtype, {tokens, latent});
    gpu_->routed_experts(activation, dz.view, dids.view, dweights.view, experts, dout.view);
    const HostTensor out = download(*gpu_, dout.view);
    EXPECT_EQ(count_non_finite(out), 0);
    EXPECT_LT(relative_error(out, ref), tolerance(dtype));

    // The grouped-GEMM path on the same problem: also right, and not the same bits (it rounds each
    // expert's y before the combine), which shows the skinny path ran above.
    gpu_->set_skinny_max_tokens(0);
    DeviceTensor dgrouped = poisoned(*gpu_, dtype, {tokens, latent});
    gpu_->routed_experts(activation, dz.view, dids.view, dweights.view, experts, dgrouped.view);
    gpu_->set_skinny_max_tokens(kSkinnyMaxRows);
    const HostTensor grouped = download(*gpu_, dgrouped.view);
    EXPECT_LT(relative_error(grouped, ref), tolerance(dtype));
    if (latent * inter >= 4096) EXPECT_FALSE(bitwise_equal(out.view(), grouped.view()));
  }

  // Every later skinny call, through the backend or direct, with this launch shape.
  void force_shape(const SkinnyShape& shape) {
    shape_ = shape;
    gpu_->set_skinny_shape(shape);
  }

  std::unique_ptr<CudaBackend> gpu_;
  std::unique_ptr<Backend> cpu_;
  SkinnyShape shape_;
};

TEST_F(Skinny, linear_matches_cpu) {
  uint32_t seed = 100;
  for (DType dtype : {DType::bf16, DType::f16}) {
    for (int64_t tokens : {1, 2, 3, 5, 8}) {
      check_linear(dtype, tokens, 3584, 1024, false, 3584, seed += 3);  // W_down/W_up-like rows
      check_linear(dtype, tokens, 100, 200, false, 100, seed += 3);     // n % 16 != 0, k % 32 != 0
    }
  }
  check_linear(DType::bf16, 1, 7168, 3584, false, 7168, seed += 3);  // Kimi-K3's W_up
  check_linear(DType::bf16, 4, 24, 8, false, 24, seed += 3);         // one 8-element group of k
}

TEST_F(Skinny, linear_accumulates_into_a_strided_column_block) {
  check_linear(DType::bf16, 3, 250, 520, true, 264, 7);
  check_linear(DType::f16, 8, 64, 96, true, 72, 8);
  check_linear(DType::bf16, 2, 64, 96, false, 80, 9);
}

TEST_F(Skinny, routed_experts_match_cpu_for_every_activation_and_dtype) {
  uint32_t seed = 300;
  for (Activation act : {Activation::silu, Activation::situ, Activation::relu2}) {
    for (DType dtype : {DType::bf16, DType::f16}) {
      for (int64_t tokens : {1, 2, 5, 8}) {
        check_routed(act, dtype, tokens, 64, 3, 8, 520, 336, seed += 10);  // zero experts; n, k odd multiples of 8
      }
    }
  }
}

TEST_F(Skinny, routed_experts_with_shared_repeated_and_many_experts) {
  // Three experts for 8 tokens of top-2: every expert serves several tokens.
  check_routed(Activation::situ, DType::bf16, 8, 3, 0, 2, 256, 96, 1);
  // Ids drawn with replacement: a token may name one expert twice (it counts twice), zero experts too.
  check_routed(Activation::silu, DType::bf16, 8, 5, 2, 6, 256, 96, 2, /*repeats=*/true);
  check_routed(Activation::relu2, DType::f16, 3, 4, 1, 8, 128, 64, 3, /*repeats=*/true);
  // top_k = 32 at 8 tokens: 256 pairs, the largest table.
  check_routed(Activation::situ, DType::bf16, 8, 896, 0, 32, 512, 128, 4);
  // Kimi-K3's one-rank shapes at one token (l = 3584, I/8 = 384, k = 16 of 64 experts here).
  check_routed(Activation::situ, DType::bf16, 1, 64, 0, 16, 3584, 384, 5);
  // Nemotron-3's (relu2, I/8 = 336, l = 1024, k = 22).
  check_routed(Activation::relu2, DType::bf16, 2, 128, 0, 22, 1024, 336, 6);
}

// Every schedule path (skinny_gemm.cu, "Schedule"): one warp; more warps than a unit has steps;
// several units per cluster (persistent rounds, odd cluster counts); units split over clusters of
// 2, 4 and 8 CTAs (sm_90+); with dense, routed, gated and relu2 calls whose n and k are not
// multiples of 16 and 64. Each against the CPU reference; the same shape twice gives the same bits.
TEST_F(Skinny, every_launch_shape_matches_cpu) {
  std::vector<SkinnyShape> shapes = {{1, 1, 1}, {3, 1, 2}, {16, 1, 3}, {16, 1, 0}, {5, 1, 0}};
  if (current_compute_capability() >= 90) {
    shapes.insert(shapes.end(), {{4, 2, 1}, {4, 2, 3}, {8, 4, 0}, {2, 8, 5}, {16, 8, 1}, {0, 2, 0}, {0, 8, 0}});
  }
  uint32_t seed = 700;
  for (const SkinnyShape& shape : shapes) {
    SCOPED_TRACE("warps " + std::to_string(shape.warps) + ", split " + std::to_string(shape.split) + ", clusters " +
                 std::to_string(shape.clusters));
    force_shape(shape);
    check_linear(DType::bf16, 3, 200, 1000, false, 200, seed += 3);
    check_linear(DType::f16, 8, 40, 264, true, 48, seed += 3);
    WorkspaceSpec spec;
    spec.max_tokens = 8;
    spec.element_size = 2;
    spec.dense_intermediate = 336;
    gpu_->prepare(spec);
    check_dense_mlp(*gpu_, *cpu_, Activation::situ, DType::bf16, 5, 520, 336, seed += 5);
    check_dense_mlp(*gpu_, *cpu_, Activation::relu2, DType::bf16, 2, 264, 336, seed += 5);
    check_routed(Activation::silu, DType::bf16, 8, 20, 2, 6, 520, 200, seed += 10, /*repeats=*/true);
    check_routed(Activation::relu2, DType::f16, 1, 64, 0, 22, 1000, 336, seed += 10);
  }
  force_shape({});
}

TEST_F(Skinny, a_launch_shape_gives_the_same_bits_every_run) {
  for (const SkinnyShape& shape : std::vector<SkinnyShape>{{}, {4, 1, 2}, {6, 2, 3}}) {
    if (shape.split > 1 && current_compute_capability() < 90) continue;
    const int64_t tokens = 6, n = 300, k = 2000;
    const HostTensor x = random_tensor(DType::bf16, {tokens, k}, 11);
    const HostTensor w = random_tensor(DType::bf16, {n, k}, 12);
    DeviceTensor dx = upload(*gpu_, x), dw = upload(*gpu_, w);
    DeviceTensor first = poisoned(*gpu_, DType::bf16, {tokens, n}), second = poisoned(*gpu_, DType::bf16, {tokens, n});
    const SkinnyWeights weights{nullptr, dw.view.data(), n, k, k, 0};
    skinny_down(DType::bf16, SkinnyRouting{}, {dx.view.data(), k}, tokens, weights, first.view.data(), n, false,
                stream(), shape);
    skinny_down(DType::bf16, SkinnyRouting{}, {dx.view.data(), k}, tokens, weights, second.view.data(), n, false,
                stream(), shape);
    EXPECT_TRUE(bitwise_equal(download(*gpu_, first.view).view(), download(*gpu_, second.view).view()));
  }
}

// The measured rule (backend/linears.cpp, skinny_pays): a one-row linear stays on cuBLASLt (the same
// bits as with the skinny kernels off, not those of the skinny kernel). The decode GEMV, which would
// take it otherwise, is off here (tests/cuda/test_gemv.cpp tests it).
TEST_F(Skinny, the_default_rule_keeps_a_linear_on_cublaslt) {
  gpu_->set_skinny_always(false);
  gpu_->set_gemv_max_tokens(0);
  const HostTensor x = random_tensor(DType::bf16, {1, 1024}, 21);
  const HostTensor w = random_tensor(DType::bf16, {512, 1024}, 22);
  DeviceTensor dx = upload(*gpu_, x), dw = upload(*gpu_, w);
  DeviceTensor by_rule = poisoned(*gpu_, DType::bf16, {1, 512}), off = poisoned(*gpu_, DType::bf16, {1, 512}),
               skinny = poisoned(*gpu_, DType::bf16, {1, 512});
  gpu_->linear(dx.view, dw.view, by_rule.view, false);
  gpu_->set_skinny_max_tokens(0);
  gpu_->linear(dx.view, dw.view, off.view, false);
  gpu_->set_skinny_max_tokens(kSkinnyMaxRows);
  skinny_down(DType::bf16, SkinnyRouting{}, {dx.view.data(), 1024}, 1,
              SkinnyWeights{nullptr, dw.view.data(), 512, 1024, 1024, 0}, skinny.view.data(), 512, false, stream());
  const HostTensor rule_out = download(*gpu_, by_rule.view), off_out = download(*gpu_, off.view);
  EXPECT_TRUE(bitwise_equal(rule_out.view(), off_out.view()));
  EXPECT_EQ(count_non_finite(rule_out), 0);
  EXPECT_LT(relative_error(download(*gpu_, skinny.view), rule_out), 1e-2);
  gpu_->set_skinny_always(true);
}

// Decode as an engine runs it: routed experts, shared expert and a projection captured once, replayed
// with new inputs and a new routing written into the same buffers; bit-identical to eager runs.
TEST_F(Skinny, graph_replays_with_new_routings) {
  constexpr int64_t kTokens = 3, kLatent = 256, kInter = 96, kExperts = 40, kTopK = 6, kShared = 128, kHidden = 200;
  WorkspaceSpec spec;
  spec.max_tokens = kTokens;
  spec.element_size = 2;
  spec.num_experts = kExperts;
  spec.top_k = kTopK;
  spec.latent_size = kLatent;
  spec.expert_intermediate = kInter;
  spec.dense_intermediate = kShared;
  gpu_->prepare(spec);
  const DType dtype = DType::bf16;
  ActivationParams activation;
  activation.activation = Activation::situ;
  DeviceTensor gate = upload(*gpu_, random_tensor(dtype, {kExperts, kInter, kLatent}, 1, -0.1f, 0.1f));
  DeviceTensor up = upload(*gpu_, random_tensor(dtype, {kExperts, kInter, kLatent}, 2, -0.1f, 0.1f));
  DeviceTensor down = upload(*gpu_, random_tensor(dtype, {kExperts, kLatent, kInter}, 3, -0.1f, 0.1f));
  DeviceTensor shared_gate = upload(*gpu_, random_tensor(dtype, {kShared, kLatent}, 4, -0.1f, 0.1f));
  DeviceTensor shared_up = upload(*gpu_, random_tensor(dtype, {kShared, kLatent}, 5, -0.1f, 0.1f));
  DeviceTensor shared_down = upload(*gpu_, random_tensor(dtype, {kLatent, kShared}, 6, -0.1f, 0.1f));
  DeviceTensor proj = upload(*gpu_, random_tensor(dtype, {kHidden, kLatent}, 7, -0.1f, 0.1f));
  DeviceTensor z = device_empty(*gpu_, dtype, {kTokens, kLatent});
  DeviceTensor ids = device_empty(*gpu_, DType::i32, {kTokens, kTopK});
  DeviceTensor weights = device_empty(*gpu_, DType::f32, {kTokens, kTopK});
  DeviceTensor routed = device_empty(*gpu_, dtype, {kTokens, kLatent});
  DeviceTensor shared = device_empty(*gpu_, dtype, {kTokens, kLatent});
  DeviceTensor out = device_empty(*gpu_, dtype, {kTokens, kHidden});
  auto step = [&] {
    gpu_->run_overlapped(
        [&] {
          gpu_->routed_experts(activation, z.view, ids.view, weights.view, MlpWeights{gate.view, up.view, down.view},
                               routed.view);
        },
        [&] {
          gpu_->dense_mlp(activation, z.view, MlpWeights{shared_gate.view, shared_up.view, shared_down.view},
                          shared.view);
        });
    gpu_->add(routed.view, shared.view, routed.view);
    gpu_->linear(routed.view, proj.view, out.view, false);
  };
  auto load_inputs = [&](uint32_t seed) {
    gpu_->copy(random_tensor(dtype, {kTokens, kLatent}, seed, -2.0f, 2.0f).view(), z.view);
    gpu_->copy(draw_ids(kTokens, kTopK, kExperts, 0, seed + 1, false).view(), ids.view);
    gpu_->copy(random_tensor(DType::f32, {kTokens, kTopK}, seed + 2, 0.1f, 1.0f).view(), weights.view);
  };
  const int64_t allocations = gpu_->num_device_allocations();
  auto stream = static_cast<cudaStream_t>(gpu_->stream());
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  step();
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  cudaGraphDestroy(graph);
  for (uint32_t seed : {10u, 20u, 30u}) {
    load_inputs(seed);
    poison(*gpu_, out);
    step();
    const HostTensor eager = download(*gpu_, out.view);
    load_inputs(seed);
    poison(*gpu_, out);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    const HostTensor replayed = download(*gpu_, out.view);
    EXPECT_EQ(count_non_finite(replayed), 0);
    EXPECT_TRUE(bitwise_equal(eager.view(), replayed.view())) << "seed " << seed;
  }
  cudaGraphExecDestroy(exec);
  EXPECT_EQ(gpu_->num_device_allocations(), allocations);
}

TEST_F(Skinny, falls_back_where_it_must_and_rejects_bad_arguments) {
  // 9 tokens, k not a multiple of 8, f32: not skinny problems (the backend takes cuBLASLt; still right).
  EXPECT_FALSE(skinny_supported(DType::bf16, 9, 64, {}));
  EXPECT_FALSE(skinny_supported(DType::bf16, 2, 60, {}));
  EXPECT_FALSE(skinny_supported(DType::f32, 2, 64, {}));
  EXPECT_FALSE(skinny_supported(DType::bf16, 0, 64, {}));
  DeviceTensor odd = device_empty(*gpu_, DType::bf16, {4, 72});
  const void* unaligned = static_cast<const char*>(odd.view.data()) + 2;
  EXPECT_FALSE(skinny_supported(DType::bf16, 2, 64, {{unaligned, 72}}));
  EXPECT_FALSE(skinny_supported(DType::bf16, 2, 64, {{odd.view.data(), 68}}));
  EXPECT_TRUE(skinny_supported(DType::bf16, 2, 64, {{odd.view.data(), 72}}));
  const HostTensor x = random_tensor(DType::bf16, {2, 60}, 1);
  const HostTensor w = random_tensor(DType::bf16, {16, 60}, 2);
  HostTensor ref(DType::bf16, {2, 16});
  cpu_->linear(x.view(), w.view(), ref.view(), false);
  DeviceTensor dx = upload(*gpu_, x), dw = upload(*gpu_, w), dy = poisoned(*gpu_, DType::bf16, {2, 16});
  gpu_->linear(dx.view, dw.view, dy.view, false);
  EXPECT_LT(relative_error(download(*gpu_, dy.view), ref), 1e-2);

  // A direct call with an unsupported problem throws, naming it; nothing is launched.
  EXPECT_THROW(skinny_down(DType::bf16, SkinnyRouting{}, {dx.view.data(), 60}, 2,
                           SkinnyWeights{nullptr, dw.view.data(), 16, 60, 60, 0}, dy.view.data(), 16, false, stream()),
               Error);
  DeviceTensor a = device_empty(*gpu_, DType::bf16, {9, 64});
  DeviceTensor b = device_empty(*gpu_, DType::bf16, {16, 64});
  EXPECT_THROW(skinny_down(DType::bf16, SkinnyRouting{}, {a.view.data(), 64}, 9,
                           SkinnyWeights{nullptr, b.view.data(), 16, 64, 64, 0}, dy.view.data(), 16, false, stream()),
               Error);
  SkinnyRouting too_wide{nullptr, nullptr, 33, 4};
  DeviceTensor ids = device_empty(*gpu_, DType::i32, {1, 33});
  too_wide.topk_ids = ids.view.data_as<const int32_t>();
  EXPECT_THROW(
      skinny_down(DType::bf16, too_wide, {a.view.data(), 64}, 1,
                  SkinnyWeights{nullptr, b.view.data(), 16, 64, 64, 16 * 64}, dy.view.data(), 16, false, stream()),
      Error);
  ActivationParams relu2;
  relu2.activation = Activation::relu2;
  EXPECT_THROW(skinny_gate_up(DType::bf16, relu2, SkinnyRouting{}, {a.view.data(), 64}, 1,
                              SkinnyWeights{b.view.data(), b.view.data(), 16, 64, 64, 0}, dy.view.data(), 16, stream()),
               Error);  // relu2 takes no gate
  // Impossible launch shapes: too many warps, a split that is no cluster size.
  for (const SkinnyShape& bad : std::vector<SkinnyShape>{{17, 1, 1}, {-1, 0, 0}, {4, 3, 1}, {4, 16, 1}, {4, 1, -2}}) {
    EXPECT_THROW(
        skinny_down(DType::bf16, SkinnyRouting{}, {a.view.data(), 64}, 2,
                    SkinnyWeights{nullptr, b.view.data(), 16, 64, 64, 0}, dy.view.data(), 16, false, stream(), bad),
        Error);
  }
  EXPECT_THROW(gpu_->set_skinny_max_tokens(kSkinnyMaxRows + 1), Error);
  EXPECT_THROW(gpu_->set_skinny_max_tokens(-1), Error);
  ASSERT_EQ(cudaStreamSynchronize(stream()), cudaSuccess);
}

}  // namespace
}  // namespace latentmoe::cuda::testing

// Every dense operation of the CUDA backend against the CPU reference backend (src/cpu), on odd
// shapes, every compute dtype and activation, with outputs poisoned first so that an unwritten
// element shows up as NaN. Routing must choose identical ids; values are compared by
// ||out - ref|| / ||ref|| (f32 under 1e-5, bf16/f16 under 1e-2).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <random>
#include <thread>
#include <vector>

#include "cuda/backend/cuda_backend.h"
#include "cuda/common/device.h"
#include "cuda/gemm/gemv.h"
#include "cuda/kernels/routing.h"
#include "cuda_test_util.h"
#include "latentmoe/error.h"

namespace latentmoe::cuda::testing {
namespace {

using ::latentmoe::detail::ActivationParams;
using ::latentmoe::detail::make_cpu_backend;
using ::latentmoe::detail::MlpWeights;
using ::latentmoe::detail::RoutingParams;

constexpr int64_t kTokenCounts[] = {1, 3, 17, 133};
constexpr DType kDTypes[] = {DType::f32, DType::bf16, DType::f16};

class CudaOps : public ::testing::Test {
 protected:
  void SetUp() override {
    LATENTMOE_REQUIRE_GPU();
    gpu_ = std::make_unique<CudaBackend>(0);
    cpu_ = make_cpu_backend();
  }

  std::unique_ptr<CudaBackend> gpu_;
  std::unique_ptr<Backend> cpu_;
};

TEST(CudaDevice, count_never_throws) {
  const int count = cuda_device_count();
  EXPECT_GE(count, 0);
  if (count > 0) {
    const DeviceInfo info = device_info(0);
    EXPECT_GT(info.num_sms, 0);
    EXPECT_GE(info.shared_memory_per_block_optin, size_t{48 * 1024});
  }
  EXPECT_THROW(device_info(count), Error);
}

// A stream held by work that does not end (here a host function waiting for a flag, as a collective
// waits for a peer): synchronize_for gives up at its limit instead of blocking, and succeeds once the
// work has ended.
TEST_F(CudaOps, synchronize_for_gives_up_on_a_stream_that_does_not_finish) {
  static std::atomic<bool> release{false};
  release = false;
  auto hold = [](void*) {
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (!release.load() && std::chrono::steady_clock::now() < give_up) std::this_thread::yield();
  };
  ASSERT_EQ(cudaLaunchHostFunc(static_cast<cudaStream_t>(gpu_->stream()), hold, nullptr), cudaSuccess);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(gpu_->synchronize_for(std::chrono::milliseconds(100)));
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(100));
  release = true;
  EXPECT_TRUE(gpu_->synchronize_for(std::chrono::seconds(20)));
  EXPECT_TRUE(gpu_->synchronize_for(std::chrono::milliseconds(1)));  // nothing queued: at once
}

TEST_F(CudaOps, copy_round_trips_contiguous_and_strided) {
  const HostTensor host = random_tensor(DType::bf16, {17, 40}, 1);
  DeviceTensor device = upload(*gpu_, host);
  const HostTensor back = download(*gpu_, device.view);
  EXPECT_EQ(std::memcmp(back.data(), host.data(), host.nbytes()), 0);

  // Device-to-device into a column block of a wider poisoned matrix; the other columns stay poisoned.
  DeviceTensor wide = poisoned(*gpu_, DType::bf16, {17, 64});
  gpu_->copy(device.view, wide.view.slice_cols(8, 48));
  const HostTensor wide_back = download(*gpu_, wide.view);
  for (int64_t r = 0; r < 17; ++r) {
    for (int64_t c = 0; c < 64; ++c) {
      const uint16_t bits = wide_back.data_as<uint16_t>()[r * 64 + c];
      if (c >= 8 && c < 48) {
        EXPECT_EQ(bits, host.data_as<uint16_t>()[r * 40 + c - 8]) << r << ", " << c;
      } else {
        EXPECT_EQ(bits, 0xffff) << r << ", " << c;
      }
    }
  }
  // And a strided block back to the host.
  const HostTensor block = download(*gpu_, wide.view.slice_cols(8, 48));
  EXPECT_EQ(std::memcmp(block.data(), host.data(), host.nbytes()), 0);

  EXPECT_THROW(gpu_->copy(device.view, wide.view), Error);  // shape mismatch
}

void check_router_logits(CudaBackend& gpu, Backend& cpu, DType x_dtype, DType w_dtype, uint32_t seed) {
  const int64_t d = 336, outputs = 1056;
  for (int64_t tokens : kTokenCounts) {
    const HostTensor x = random_tensor(x_dtype, {tokens, d}, ++seed);
    const HostTensor gate = random_tensor(w_dtype, {outputs, d}, ++seed);
    HostTensor ref(DType::f32, {tokens, outputs});
    cpu.router_logits(x.view(), gate.view(), ref.view());
    DeviceTensor dx = upload(gpu, x), dgate = upload(gpu, gate);
    DeviceTensor dout = poisoned(gpu, DType::f32, {tokens, outputs});
    gpu.router_logits(dx.view, dgate.view, dout.view);
    const HostTensor out = download(gpu, dout.view);
    SCOPED_TRACE(name_of(x_dtype) + " x " + name_of(w_dtype) + ", T = " + std::to_string(tokens));
    EXPECT_EQ(count_non_finite(out), 0);
    EXPECT_LT(relative_error(out, ref), 1e-5);
  }
}

TEST_F(CudaOps, router_logits_match_cpu_in_fp32) {
  const std::pair<DType, DType> dtype_pairs[] = {
      {DType::f32, DType::f32}, {DType::bf16, DType::bf16}, {DType::f16, DType::f16}, {DType::bf16, DType::f32}};
  uint32_t seed = 10;
  for (auto [x_dtype, w_dtype] : dtype_pairs) check_router_logits(*gpu_, *cpu_, x_dtype, w_dtype, seed += 100);
  // Prepared with d: a 16-bit x with an f32 gate is widened to f32 for cuBLASLt (no fallback kernel).
  WorkspaceSpec spec;
  spec.max_tokens = 133;
  spec.hidden_size = 336;
  gpu_->prepare(spec);
  check_router_logits(*gpu_, *cpu_, DType::bf16, DType::f32, seed += 100);
  check_router_logits(*gpu_, *cpu_, DType::f16, DType::f32, seed += 100);
}

// --- routing --------------------------------------------------------------------------------------

struct RouteCase {
  const char* name;
  ScoringFunc scoring;
  bool bias;
  int64_t num_experts, num_zero_experts, top_k, n_group, topk_group;
  bool norm_topk_prob;
  float scaling;
};

RoutingParams params_of(const RouteCase& c) {
  RoutingParams params;
  params.scoring = c.scoring;
  params.num_experts = c.num_experts;
  params.num_zero_experts = c.num_zero_experts;
  params.top_k = c.top_k;
  params.n_group = c.n_group;
  params.topk_group = c.topk_group;
  params.norm_topk_prob = c.norm_topk_prob;
  params.routed_scaling_factor = c.scaling;
  return params;
}

struct RouteResult {
  HostTensor ids, weights, zero_sum;
};

RouteResult route_on(Backend& backend, bool on_device, const RoutingParams& params, const HostTensor& logits,
                     const HostTensor* bias) {
  const int64_t tokens = logits.size(0);
  RouteResult result;
  if (!on_device) {
    result.ids = HostTensor(DType::i32, {tokens, params.top_k});
    result.weights = HostTensor(DType::f32, {tokens, params.top_k});
    result.zero_sum = HostTensor(DType::f32, {tokens});
    backend.route(params, logits.view(), bias ? bias->view() : TensorView(), result.ids.view(), result.weights.view(),
                  result.zero_sum.view());
    return result;
  }
  DeviceTensor dlogits = upload(backend, logits);
  DeviceTensor dbias;
  if (bias) dbias = upload(backend, *bias);
  DeviceTensor ids = poisoned(backend, DType::i32, {tokens, params.top_k});
  DeviceTensor weights = poisoned(backend, DType::f32, {tokens, params.top_k});
  DeviceTensor zero_sum = poisoned(backend, DType::f32, {tokens});
  backend.route(params, dlogits.view, bias ? dbias.view : TensorView(), ids.view, weights.view, zero_sum.view);
  result.ids = download(backend, ids.view);
  result.weights = download(backend, weights.view);
  result.zero_sum = download(backend, zero_sum.view);
  return result;
}

void expect_same_routing(const RouteResult& gpu, const RouteResult& cpu) {
  ASSERT_EQ(gpu.ids.numel(), cpu.ids.numel());
  int64_t wrong_ids = 0;
  for (int64_t i = 0; i < cpu.ids.numel(); ++i) {
    if (gpu.ids.data_as<int32_t>()[i] != cpu.ids.data_as<int32_t>()[i]) {
      if (++wrong_ids <= 5) {
        ADD_FAILURE() << "topk_ids[" << i << "]: " << gpu.ids.data_as<int32_t>()[i] << " vs reference "
                      << cpu.ids.data_as<int32_t>()[i];
      }
    }
  }
  EXPECT_EQ(wrong_ids, 0);
  for (int64_t i = 0; i < cpu.weights.numel(); ++i) {
    const float ref = cpu.weights.data_as<float>()[i];
    EXPECT_NEAR(gpu.weights.data_as<float>()[i], ref, 1e-6f * std::fabs(ref)) << "topk_weights[" << i << "]";
  }
  for (int64_t t = 0; t < cpu.zero_sum.numel(); ++t) {
    const float ref = cpu.zero_sum.data_as<float>()[t];
    EXPECT_NEAR(gpu.zero_sum.data_as<float>()[t], ref, 1e-6f * std::fabs(ref)) << "zero_weight_sum[" << t << "]";
  }
}

HostTensor normal_logits(int64_t tokens, int64_t outputs, uint32_t seed) {
  HostTensor logits(DType::f32, {tokens, outputs});
  std::mt19937 generator(seed);
  std::normal_distribution<float> distribution(0.0f, 2.0f);
  for (int64_t i = 0; i < logits.numel(); ++i) logits.data_as<float>()[i] = distribution(generator);
  return logits;
}

TEST_F(CudaOps, route_ties_go_to_the_lower_index) {
  RoutingParams params;
  params.num_experts = 8;
  params.top_k = 3;
  HostTensor logits(DType::f32, {2, 8});  // all zero: every score 0.5
  // Token 1: groups of 2; group 3 (ids 6, 7) is best, groups 0..2 tie and group 0 wins the tie.
  for (int64_t e = 6; e < 8; ++e) logits.data_as<float>()[8 + e] = 5.0f;
  {
    const RouteResult got = route_on(*gpu_, true, params, logits, nullptr);
    for (int j = 0; j < 3; ++j) {
      EXPECT_EQ(got.ids.data_as<int32_t>()[j], j);
      EXPECT_FLOAT_EQ(got.weights.data_as<float>()[j], 1.0f / 3.0f);
    }
    EXPECT_EQ(got.ids.data_as<int32_t>()[3], 6);
    EXPECT_EQ(got.ids.data_as<int32_t>()[4], 7);
    EXPECT_EQ(got.ids.data_as<int32_t>()[5], 0);
  }
  params.n_group = 4;
  params.topk_group = 2;
  {
    const RouteResult got = route_on(*gpu_, true, params, logits, nullptr);
    // Token 0: groups 0 and 1 kept (ties), ids 0, 1, 2. Token 1: groups 3 and 0 kept: 6, 7, 0.
    const int32_t expected[] = {0, 1, 2, 6, 7, 0};
    for (int i = 0; i < 6; ++i) EXPECT_EQ(got.ids.data_as<int32_t>()[i], expected[i]) << i;
    EXPECT_FLOAT_EQ(got.zero_sum.data_as<float>()[0], 0.0f);
  }
}

TEST_F(CudaOps, route_orders_nan_and_inf_like_the_reference) {
  for (ScoringFunc scoring : {ScoringFunc::sigmoid, ScoringFunc::softmax}) {
    RoutingParams params;
    params.scoring = scoring;
    params.num_experts = 40;
    params.num_zero_experts = 4;
    params.top_k = 6;
    HostTensor logits = normal_logits(4, 44, 7);
    float* row = logits.data_as<float>();
    const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
    row[3] = nan;       // token 0: a NaN never wins over a real score
    row[44 + 5] = inf;  // token 1: +inf logits
    row[44 + 9] = inf;
    for (int64_t e = 0; e < 44; ++e) row[88 + e] = -inf;  // token 2: every logit -inf
    for (int64_t e = 0; e < 44; ++e) row[132 + e] = nan;  // token 3: every logit NaN
    SCOPED_TRACE(std::string(to_string(scoring)));
    expect_same_routing(route_on(*gpu_, true, params, logits, nullptr),
                        route_on(*cpu_, false, params, logits, nullptr));
  }
}

TEST_F(CudaOps, route_rejects_impossible_parameters) {
  RoutingParams params;
  params.num_experts = 64;
  params.top_k = 33;
  const HostTensor logits = normal_logits(2, 64, 3);
  EXPECT_THROW(route_on(*gpu_, true, params, logits, nullptr), Error);  // top_k > 32: the kernels' limit
#ifndef NDEBUG  // the runner validates the config; the backend checks it again in debug builds only
  params.top_k = 4;
  params.n_group = 5;  // does not divide 64
  EXPECT_THROW(route_on(*gpu_, true, params, logits, nullptr), Error);
#endif
}

// Both route kernels (forced), and the automatic choice, against the reference.
RouteResult route_with_path(CudaBackend& backend, RoutePath path, const RoutingParams& params, const HostTensor& logits,
                            const HostTensor* bias) {
  const int64_t tokens = logits.size(0);
  DeviceTensor dlogits = upload(backend, logits);
  DeviceTensor dbias;
  if (bias) dbias = upload(backend, *bias);
  DeviceTensor ids = poisoned(backend, DType::i32, {tokens, params.top_k});
  DeviceTensor weights = poisoned(backend, DType::f32, {tokens, params.top_k});
  DeviceTensor zero_sum = poisoned(backend, DType::f32, {tokens});
  RouteArgs args;
  args.logits = dlogits.view.data_as<const float>();
  args.ld_logits = logits.size(1);
  args.bias = bias ? dbias.view.data_as<const float>() : nullptr;
  args.topk_ids = ids.view.data_as<int32_t>();
  args.topk_weights = weights.view.data_as<float>();
  args.zero_weight_sum = zero_sum.view.data_as<float>();
  args.num_tokens = tokens;
  launch_route(params, args, device_info(0).shared_memory_per_block_optin, static_cast<cudaStream_t>(backend.stream()),
               path);
  RouteResult result;
  result.ids = download(backend, ids.view);
  result.weights = download(backend, weights.view);
  result.zero_sum = download(backend, zero_sum.view);
  return result;
}

// Logits drawn from a few integer values: many exact ties in scores, biased scores and groups.
HostTensor tied_logits(int64_t tokens, int64_t outputs, uint32_t seed) {
  HostTensor logits(DType::f32, {tokens, outputs});
  std::mt19937 generator(seed);
  std::uniform_int_distribution<int> distribution(-2, 2);
  for (int64_t i = 0; i < logits.numel(); ++i) logits.data_as<float>()[i] = static_cast<float>(distribution(generator));
  return logits;
}

// Routing against the reference, exactly: through the backend (its automatic kernel choice) on the
// configurations of the supported models, and on each route kernel forced (block, warp) over odd and
// wide E+Z, groups and zero experts, with normal and with tied logits.
struct RouteSuite {
  const char* name;
  std::vector<RouteCase> cases;
  std::vector<int64_t> tokens;
  bool forced_kernels;  // false: the backend's route(); true: each kernel through route_with_path
  bool with_ties;       // also tied logits (tied_logits)
  uint32_t seed;
};

class Route : public CudaOps, public ::testing::WithParamInterface<RouteSuite> {};

TEST_P(Route, matches_cpu_exactly) {
  const RouteSuite& suite = GetParam();
  uint32_t seed = suite.seed;
  for (const RouteCase& c : suite.cases) {
    const RoutingParams params = params_of(c);
    const int64_t outputs = c.num_experts + c.num_zero_experts;
    const HostTensor bias = random_tensor(DType::f32, {outputs}, ++seed, -0.2f, 0.2f);
    const HostTensor* b = c.bias ? &bias : nullptr;
    for (int64_t tokens : suite.tokens) {
      for (bool ties : {false, true}) {
        if (ties && !suite.with_ties) continue;
        SCOPED_TRACE(std::string(c.name) + ", T = " + std::to_string(tokens) + (ties ? ", tied logits" : ""));
        const HostTensor logits = ties ? tied_logits(tokens, outputs, ++seed) : normal_logits(tokens, outputs, ++seed);
        const RouteResult ref = route_on(*cpu_, false, params, logits, b);
        if (!suite.forced_kernels) {
          expect_same_routing(route_on(*gpu_, true, params, logits, b), ref);
          continue;
        }
        {
          SCOPED_TRACE("block kernel");
          expect_same_routing(route_with_path(*gpu_, RoutePath::block, params, logits, b), ref);
        }
        {
          SCOPED_TRACE("warp kernel");
          expect_same_routing(route_with_path(*gpu_, RoutePath::warp, params, logits, b), ref);
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Suites, Route,
    ::testing::Values(
        RouteSuite{"models_through_the_backend",
                   {
                       {"kimi_sigmoid_bias", ScoringFunc::sigmoid, true, 896, 0, 16, 1, 1, true, 1.0f},
                       {"nemotron_sigmoid", ScoringFunc::sigmoid, false, 512, 0, 22, 1, 1, true, 5.0f},
                       {"longcat_softmax_zero_experts", ScoringFunc::softmax, false, 768, 288, 12, 1, 1, false, 6.0f},
                       {"deepseek_groups", ScoringFunc::sigmoid, true, 256, 0, 8, 8, 4, true, 2.5f},
                       {"k32_groups_zero_experts", ScoringFunc::softmax, true, 1024, 32, 32, 8, 3, true, 1.0f},
                       {"k1", ScoringFunc::sigmoid, true, 64, 8, 1, 1, 1, false, 1.0f},
                   },
                   {1, 3, 17, 133},
                   false,
                   false,
                   100},
        // E+Z = 896 (Kimi), 512 (Nemotron), odd 37, 1056 and 2500 (2 and 3 outputs per thread), 4096 (4).
        RouteSuite{"block_and_warp_kernels",
                   {
                       {"kimi_896_k16", ScoringFunc::sigmoid, true, 896, 0, 16, 1, 1, true, 2.827f},
                       {"nemotron_512_k22", ScoringFunc::sigmoid, true, 512, 0, 22, 1, 1, true, 5.0f},
                       {"odd_37_k1", ScoringFunc::sigmoid, false, 37, 0, 1, 1, 1, true, 1.0f},
                       {"odd_37_zero_k16", ScoringFunc::softmax, true, 30, 7, 16, 1, 1, false, 1.0f},
                       {"softmax_1056_zero_k12", ScoringFunc::softmax, false, 768, 288, 12, 1, 1, true, 6.0f},
                       {"groups_896_k16", ScoringFunc::sigmoid, true, 896, 0, 16, 8, 4, true, 1.0f},
                       {"groups_size1_64", ScoringFunc::sigmoid, true, 64, 0, 8, 64, 8, true, 1.0f},
                       {"groups_2500_k32", ScoringFunc::softmax, true, 2400, 100, 32, 20, 3, true, 1.0f},
                       {"wide_4096_k22", ScoringFunc::sigmoid, true, 4000, 96, 22, 1, 1, true, 1.0f},
                   },
                   {1, 2, 7, 8, 9, 64},
                   true,
                   true,
                   900}),
    [](const ::testing::TestParamInfo<RouteSuite>& info) { return info.param.name; });

TEST_F(CudaOps, route_automatic_path_crosses_its_thresholds) {
  // Around kRouteBlockMaxTokens (block below, warp above) and above kRouteBlockMaxOutputs (warp only).
  RoutingParams params;
  params.num_experts = 33;
  params.num_zero_experts = 4;
  params.top_k = 16;
  const HostTensor bias = random_tensor(DType::f32, {37}, 11, -0.2f, 0.2f);
  for (int64_t tokens : {kRouteBlockMaxTokens, kRouteBlockMaxTokens + 1}) {
    SCOPED_TRACE("T = " + std::to_string(tokens));
    const HostTensor logits = tied_logits(tokens, 37, 12 + static_cast<uint32_t>(tokens));
    expect_same_routing(route_with_path(*gpu_, RoutePath::automatic, params, logits, &bias),
                        route_on(*cpu_, false, params, logits, &bias));
  }
  params.num_experts = kRouteBlockMaxOutputs + 1;
  params.num_zero_experts = 0;
  params.top_k = 8;
  const HostTensor logits = normal_logits(3, kRouteBlockMaxOutputs + 1, 13);
  expect_same_routing(route_with_path(*gpu_, RoutePath::automatic, params, logits, nullptr),
                      route_on(*cpu_, false, params, logits, nullptr));
  EXPECT_THROW(route_with_path(*gpu_, RoutePath::block, params, logits, nullptr), Error);
}

TEST_F(CudaOps, route_block_kernel_breaks_ties_at_the_threshold_by_index) {
  // Nearly all 896 biased scores are equal, so the k-th key is shared by hundreds of entries and
  // the lowest-index cut decides.
  RoutingParams params;
  params.num_experts = 896;
  params.top_k = 16;
  HostTensor logits(DType::f32, {3, 896});
  float* row = logits.data_as<float>();
  for (int64_t i = 0; i < 2 * 896; ++i) row[i] = 0.0f;
  row[700] = 3.0f;  // token 0: 5 and 700 tie (sigmoid(3) - 0.5 each)
  row[5] = 3.0f;
  row[896 + 895] = 1.0f;  // token 1: 895 (sigmoid(1) - 0.5)
  for (int64_t i = 0; i < 896; ++i) row[2 * 896 + i] = -std::numeric_limits<float>::infinity();  // scores 0
  // The bias is shared by all tokens: every id's biased score is sigmoid(logit) - 0.5, except id 3's,
  // sigmoid(logit) - 0. So id 3 leads every token (0.5 beats sigmoid(3) - 0.5 = 0.4526), and the
  // hundreds of ids at biased score 0 (tokens 0, 1) or -0.5 (token 2) tie at the k-th key.
  HostTensor bias(DType::f32, {896});
  for (int64_t i = 0; i < 896; ++i) bias.data_as<float>()[i] = -0.5f;
  bias.data_as<float>()[3] = -0.0f;
  for (RoutePath path : {RoutePath::block, RoutePath::warp}) {
    SCOPED_TRACE(path == RoutePath::block ? "block kernel" : "warp kernel");
    const RouteResult got = route_with_path(*gpu_, path, params, logits, &bias);
    expect_same_routing(got, route_on(*cpu_, false, params, logits, &bias));
    const int32_t* ids = got.ids.data_as<int32_t>();
    const std::vector<int32_t> expected{3, 5,   700, 0, 1, 2, 4, 6, 7, 8, 9,  10, 11, 12, 13, 14,   // token 0
                                        3, 895, 0,   1, 2, 4, 5, 6, 7, 8, 9,  10, 11, 12, 13, 14,   // token 1
                                        3, 0,   1,   2, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};  // token 2
    for (int j = 0; j < 48; ++j) EXPECT_EQ(ids[j], expected[j]) << "slot " << j;
  }
}

// --- linear ---------------------------------------------------------------------------------------

TEST_F(CudaOps, linear_matches_cpu_for_every_dtype) {
  const int64_t m = 336, n = 192;
  uint32_t seed = 200;
  for (DType dtype : kDTypes) {
    for (int64_t tokens : kTokenCounts) {
      SCOPED_TRACE(name_of(dtype) + ", T = " + std::to_string(tokens));
      const HostTensor x = random_tensor(dtype, {tokens, m}, ++seed);
      const HostTensor w = random_tensor(dtype, {n, m}, ++seed);
      HostTensor ref(dtype, {tokens, n});
      cpu_->linear(x.view(), w.view(), ref.view(), false);
      DeviceTensor dx = upload(*gpu_, x), dw = upload(*gpu_, w);
      DeviceTensor dy = poisoned(*gpu_, dtype, {tokens, n});
      gpu_->linear(dx.view, dw.view, dy.view, false);
      const HostTensor out = download(*gpu_, dy.view);
      EXPECT_EQ(count_non_finite(out), 0);
      EXPECT_LT(relative_error(out, ref), tolerance(dtype));
    }
  }
}

// y is a column block [T, 192] at column 64 of a [T, 512] matrix, accumulated into (beta = 1): the
// block must match the reference and every other column must keep its bits.
TEST_F(CudaOps, linear_accumulates_into_a_strided_column_block) {
  const int64_t m = 336, n = 192, width = 512, begin = 64;
  uint32_t seed = 300;
  for (DType dtype : kDTypes) {
    for (int64_t tokens : kTokenCounts) {
      SCOPED_TRACE(name_of(dtype) + ", T = " + std::to_string(tokens));
      const HostTensor x = random_tensor(dtype, {tokens, m}, ++seed);
      const HostTensor w = random_tensor(dtype, {n, m}, ++seed);
      const HostTensor y0 = random_tensor(dtype, {tokens, width}, ++seed);
      HostTensor ref = random_tensor(dtype, {tokens, width}, seed);  // same values as y0
      cpu_->linear(x.view(), w.view(), ref.view().slice_cols(begin, begin + n), true);
      DeviceTensor dx = upload(*gpu_, x), dw = upload(*gpu_, w), dy = upload(*gpu_, y0);
      gpu_->linear(dx.view, dw.view, dy.view.slice_cols(begin, begin + n), true);
      const HostTensor out = download(*gpu_, dy.view);
      EXPECT_LT(relative_error(out, ref), tolerance(dtype));
      const size_t element = dtype_size(dtype);
      int64_t changed = 0;
      for (int64_t r = 0; r < tokens; ++r) {
        for (int64_t c = 0; c < width; ++c) {
          if (c >= begin && c < begin + n) continue;
          const size_t offset = static_cast<size_t>(r * width + c) * element;
          changed += std::memcmp(static_cast<const char*>(out.data()) + offset,
                                 static_cast<const char*>(y0.data()) + offset, element) != 0;
        }
      }
      EXPECT_EQ(changed, 0) << "elements outside the column block were written";
    }
  }
}

TEST_F(CudaOps, linear_with_mixed_dtypes_uses_the_fallback) {
  const int64_t m = 100, n = 70, tokens = 33;
  const HostTensor x = random_tensor(DType::bf16, {tokens, m}, 401);
  const HostTensor w = random_tensor(DType::f32, {n, m}, 402);
  HostTensor ref(DType::f16, {tokens, n});
  cpu_->linear(x.view(), w.view(), ref.view(), false);
  DeviceTensor dx = upload(*gpu_, x), dw = upload(*gpu_, w);
  DeviceTensor dy = poisoned(*gpu_, DType::f16, {tokens, n});
  gpu_->linear(dx.view, dw.view, dy.view, false);
  const HostTensor out = download(*gpu_, dy.view);
  EXPECT_EQ(count_non_finite(out), 0);
  EXPECT_LT(relative_error(out, ref), 1e-2);
}

// f32 GEMMs must be true fp32: TF32 (10-bit mantissa inputs) would miss 1e-5 by two orders.
TEST_F(CudaOps, f32_linear_is_not_tf32) {
  const int64_t m = 2688 / 8, n = 256, tokens = 64;
  const HostTensor x = random_tensor(DType::f32, {tokens, m}, 501);
  const HostTensor w = random_tensor(DType::f32, {n, m}, 502);
  HostTensor ref(DType::f32, {tokens, n});
  cpu_->linear(x.view(), w.view(), ref.view(), false);
  DeviceTensor dx = upload(*gpu_, x), dw = upload(*gpu_, w);
  DeviceTensor dy = poisoned(*gpu_, DType::f32, {tokens, n});
  gpu_->linear(dx.view, dw.view, dy.view, false);
  EXPECT_LT(relative_error(download(*gpu_, dy.view), ref), 2e-6);
}

// --- dense MLP ------------------------------------------------------------------------------------

// The shared expert on both of its paths: cuBLASLt + the elementwise activation (skinny kernels off;
// f32, bf16, f16 up to 133 tokens) and the skinny kernels (every decode-sized call; 16-bit only, 1-8
// tokens, n and k odd multiples of 8).
// Which path a suite forces: cuBLASLt (skinny kernels and GEMV off), the skinny kernels (always), or the
// decode GEMV pair (gemv_max_tokens up to 4, the skinny kernels off).
enum class MlpPath { cublaslt, skinny, gemv };

struct DenseMlpSuite {
  const char* name;
  MlpPath path;
  std::vector<DType> dtypes;
  std::vector<int64_t> tokens;
  int64_t d, intermediate;
  uint32_t seed;
};

class DenseMlp : public ::testing::TestWithParam<DenseMlpSuite> {
 protected:
  void SetUp() override {
    LATENTMOE_REQUIRE_GPU();
    gpu_ = std::make_unique<CudaBackend>(0);
    cpu_ = make_cpu_backend();
  }
  std::unique_ptr<CudaBackend> gpu_;
  std::unique_ptr<Backend> cpu_;
};

TEST_P(DenseMlp, matches_cpu_for_every_activation_and_dtype) {
  const DenseMlpSuite& suite = GetParam();
  switch (suite.path) {
    case MlpPath::cublaslt:
      gpu_->set_skinny_max_tokens(0);
      gpu_->set_gemv_max_tokens(0);
      break;
    case MlpPath::skinny:
      gpu_->set_skinny_always(true);
      break;
    case MlpPath::gemv:
      gpu_->set_skinny_max_tokens(0);
      gpu_->set_gemv_max_tokens(kGemvMaxRows);
      break;
  }
  WorkspaceSpec spec;
  spec.max_tokens = *std::max_element(suite.tokens.begin(), suite.tokens.end());
  spec.dense_intermediate = suite.intermediate;
  gpu_->prepare(spec);
  uint32_t seed = suite.seed;
  for (Activation act : {Activation::silu, Activation::situ, Activation::relu2}) {
    for (DType dtype : suite.dtypes) {
      for (int64_t tokens : suite.tokens) {
        check_dense_mlp(*gpu_, *cpu_, act, dtype, tokens, suite.d, suite.intermediate, seed += 5);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Paths, DenseMlp,
    ::testing::Values(
        DenseMlpSuite{
            "cublaslt", MlpPath::cublaslt, {DType::f32, DType::bf16, DType::f16}, {1, 17, 133}, 336, 192, 600},
        DenseMlpSuite{"skinny", MlpPath::skinny, {DType::bf16, DType::f16}, {1, 4, 8}, 520, 336, 200},
        DenseMlpSuite{"gemv", MlpPath::gemv, {DType::bf16, DType::f16}, {1, 2, 3, 4}, 520, 336, 800},
        DenseMlpSuite{"gemv_team", MlpPath::gemv, {DType::bf16, DType::f16}, {1, 4}, 4096, 672, 900}),
    [](const ::testing::TestParamInfo<DenseMlpSuite>& info) { return info.param.name; });

// --- RMSNorm, add, add_scaled_rows ----------------------------------------------------------------

TEST_F(CudaOps, rms_norm_matches_cpu) {
  struct Case {
    DType in, out, gamma;
  };
  const Case cases[] = {{DType::f32, DType::f32, DType::f32},
                        {DType::bf16, DType::bf16, DType::f32},
                        {DType::f16, DType::f16, DType::f32},
                        {DType::f32, DType::bf16, DType::bf16},
                        {DType::bf16, DType::f32, DType::f16}};
  uint32_t seed = 700;
  for (const Case& c : cases) {
    for (int64_t cols : {int64_t{336}, int64_t{333}, int64_t{3584}}) {
      for (int64_t tokens : {int64_t{1}, int64_t{17}, int64_t{133}}) {
        SCOPED_TRACE(name_of(c.in) + " -> " + name_of(c.out) + ", gamma " + name_of(c.gamma) + ", cols " +
                     std::to_string(cols) + ", T = " + std::to_string(tokens));
        const HostTensor in = random_tensor(c.in, {tokens, cols}, ++seed, -3.0f, 3.0f);
        const HostTensor gamma = random_tensor(c.gamma, {cols}, ++seed, 0.5f, 1.5f);
        HostTensor ref(c.out, {tokens, cols});
        cpu_->rms_norm(in.view(), gamma.view(), 1e-5f, ref.view());
        DeviceTensor din = upload(*gpu_, in), dgamma = upload(*gpu_, gamma);
        DeviceTensor dout = poisoned(*gpu_, c.out, {tokens, cols});
        gpu_->rms_norm(din.view, dgamma.view, 1e-5f, dout.view);
        const HostTensor out = download(*gpu_, dout.view);
        EXPECT_EQ(count_non_finite(out), 0);
        EXPECT_LT(relative_error(out, ref), tolerance(c.out));
      }
    }
  }
}

TEST_F(CudaOps, rms_norm_in_place_and_on_a_column_block) {
  const int64_t tokens = 17, cols = 192, width = 336;
  const HostTensor wide = random_tensor(DType::bf16, {tokens, width}, 801);
  const HostTensor gamma = random_tensor(DType::f32, {cols}, 802, 0.5f, 1.5f);
  HostTensor ref(DType::bf16, {tokens, cols});
  cpu_->rms_norm(wide.view().slice_cols(72, 72 + cols), gamma.view(), 1e-6f, ref.view());
  DeviceTensor dwide = upload(*gpu_, wide), dgamma = upload(*gpu_, gamma);
  const TensorView block = dwide.view.slice_cols(72, 72 + cols);
  gpu_->rms_norm(block, dgamma.view, 1e-6f, block);  // in place, strided
  EXPECT_LT(relative_error(download(*gpu_, block), ref), 1e-2);
}

TEST_F(CudaOps, add_matches_cpu_including_aliasing_and_mixed_dtypes) {
  uint32_t seed = 900;
  for (DType dtype : kDTypes) {
    for (int64_t cols : {int64_t{336}, int64_t{333}}) {
      for (int64_t tokens : kTokenCounts) {
        SCOPED_TRACE(name_of(dtype) + ", cols " + std::to_string(cols) + ", T = " + std::to_string(tokens));
        const HostTensor a = random_tensor(dtype, {tokens, cols}, ++seed);
        const HostTensor b = random_tensor(dtype, {tokens, cols}, ++seed);
        HostTensor ref(dtype, {tokens, cols});
        cpu_->add(a.view(), b.view(), ref.view());
        DeviceTensor da = upload(*gpu_, a), db = upload(*gpu_, b);
        DeviceTensor dout = poisoned(*gpu_, dtype, {tokens, cols});
        gpu_->add(da.view, db.view, dout.view);
        const HostTensor out = download(*gpu_, dout.view);
        EXPECT_EQ(count_non_finite(out), 0);
        EXPECT_LT(relative_error(out, ref), tolerance(dtype));
        gpu_->add(da.view, db.view, da.view);  // out aliases a
        EXPECT_LT(relative_error(download(*gpu_, da.view), ref), tolerance(dtype));
      }
    }
  }
  // Mixed: f32 + bf16 -> bf16.
  const HostTensor a = random_tensor(DType::f32, {17, 100}, 990);
  const HostTensor b = random_tensor(DType::bf16, {17, 100}, 991);
  HostTensor ref(DType::bf16, {17, 100});
  cpu_->add(a.view(), b.view(), ref.view());
  DeviceTensor da = upload(*gpu_, a), db = upload(*gpu_, b), dout = poisoned(*gpu_, DType::bf16, {17, 100});
  gpu_->add(da.view, db.view, dout.view);
  EXPECT_LT(relative_error(download(*gpu_, dout.view), ref), 1e-2);
}

TEST_F(CudaOps, add_scaled_rows_matches_cpu_and_skips_zero_scales) {
  uint32_t seed = 1000;
  for (DType x_dtype : kDTypes) {
    for (DType out_dtype : {x_dtype, DType::f32}) {
      const int64_t tokens = 17, cols = 336;
      SCOPED_TRACE(name_of(x_dtype) + " into " + name_of(out_dtype));
      HostTensor x = random_tensor(x_dtype, {tokens, cols}, ++seed);
      const HostTensor out0 = random_tensor(out_dtype, {tokens, cols}, ++seed);
      HostTensor scale = random_tensor(DType::f32, {tokens}, ++seed, 0.0f, 2.0f);
      // Rows 2 and 5: no zero expert (scale 0) and a NaN in x: they must stay untouched.
      for (int64_t r : {2, 5}) {
        scale.data_as<float>()[r] = 0.0f;
        store_from_float(x.data(), x_dtype, r * cols + 7, std::numeric_limits<float>::quiet_NaN());
      }
      HostTensor ref = random_tensor(out_dtype, {tokens, cols}, seed - 1);
      cpu_->add_scaled_rows(x.view(), scale.view(), ref.view());
      DeviceTensor dx = upload(*gpu_, x), dscale = upload(*gpu_, scale), dout = upload(*gpu_, out0);
      gpu_->add_scaled_rows(dx.view, dscale.view, dout.view);
      const HostTensor out = download(*gpu_, dout.view);
      EXPECT_EQ(count_non_finite(out), 0);
      EXPECT_LT(relative_error(out, ref), tolerance(out_dtype));
      const size_t row_bytes = cols * dtype_size(out_dtype);
      for (int64_t r : {2, 5}) {
        EXPECT_EQ(std::memcmp(static_cast<const char*>(out.data()) + r * row_bytes,
                              static_cast<const char*>(out0.data()) + r * row_bytes, row_bytes),
                  0);
      }
    }
  }
}

// The runner validates every argument; the operations check them again in debug builds only
// (LATENTMOE_DEBUG_CHECK, src/cuda/common/debug_check.h).
TEST_F(CudaOps, operations_reject_host_tensors_and_bad_dtypes_in_debug_builds) {
#ifdef NDEBUG
  GTEST_SKIP() << "argument checks of the backend operations are debug-only";
#endif
  const HostTensor host = random_tensor(DType::f32, {3, 8}, 1);
  DeviceTensor device = upload(*gpu_, host);
  DeviceTensor ints = device_empty(*gpu_, DType::i32, {3, 8});
  EXPECT_THROW(gpu_->add(host.view(), device.view, device.view), Error);
  EXPECT_THROW(gpu_->add(ints.view, device.view, device.view), Error);
  EXPECT_THROW(gpu_->linear(device.view, device.view, device.view, false), Error);  // [3,8] x [3,8]^T -> [3,3]
}

}  // namespace
}  // namespace latentmoe::cuda::testing

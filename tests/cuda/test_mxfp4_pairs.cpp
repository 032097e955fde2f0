// The MXFP4 pair kernels (cuda/gemm/mxfp4_pairs.h) called directly, against an fp64 host reference that decodes the
// canonical codes exactly: silu, situ and relu2; 1, 2, 5 and 8 tokens; latents of 32 to 544 columns (1 to 17 scale
// groups: steps whose last groups lie past the row, a warp with no group at all) and I of 64 to 320; top_k up to 32
// (256 pairs, the kernels' most: clusters of 8, warps that take several pairs); zero experts and pads (-1) among the
// ids, which leave their act rows unwritten and add nothing; experts named by several tokens; scale bytes 0, 1 and
// above 128 (the folded products' second path); activation and output rows longer than the matrices, their padding
// poisoned. Each result is checked element by element and twice for the same bits, then captured in a CUDA graph and
// replayed, on the same inputs and on new ones written into the same buffers. Then the calls the kernels refuse
// (by mxfp4_pairs_supported and by name), and, without a GPU, the down kernel's launch rule and the setting's
// declared default.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/settings.h"
#include "cpu/activation.h"
#include "cuda/backend/cuda_backend.h"
#include "cuda/common/device.h"
#include "cuda/gemm/mxfp4_pairs.h"
#include "cuda_test_util.h"
#include "latentmoe/error.h"
#include "latentmoe/mxfp4.h"

namespace latentmoe::cuda::testing {
namespace {

using ::latentmoe::detail::ActivationParams;
namespace cpu = ::latentmoe::detail::cpu;

// Stacked MXFP4 matrices [E, rows, cols] on the host, canonical codes.
struct HostExperts {
  int64_t experts = 0, rows = 0, cols = 0;
  std::vector<uint8_t> codes, scales;

  double value(int64_t expert, int64_t row, int64_t col) const {
    const int64_t r = expert * rows + row;
    const uint8_t byte = codes[static_cast<size_t>(r * cols / 2 + col / 2)];
    return e2m1_value(col % 2 == 0 ? byte & 0xF : byte >> 4) *
           e8m0_value(scales[static_cast<size_t>(r * (cols / kMxfp4GroupSize) + col / kMxfp4GroupSize)]);
  }
};

// Random codes; scale bytes around `center` (-3 .. +2), every 13th one of the edges 0, 1, 127, 128, 129 and 131.
HostExperts random_experts(int64_t experts, int64_t rows, int64_t cols, uint32_t seed, int center) {
  HostExperts m{experts, rows, cols, std::vector<uint8_t>(static_cast<size_t>(experts * rows * cols / 2)),
                std::vector<uint8_t>(static_cast<size_t>(experts * rows * cols / kMxfp4GroupSize))};
  std::mt19937 generator(seed);
  for (auto& byte : m.codes) byte = static_cast<uint8_t>(generator());
  constexpr uint8_t kEdges[] = {0, 1, 127, 128, 129, 131};
  for (size_t i = 0; i < m.scales.size(); ++i) {
    m.scales[i] =
        i % 13 == 5 ? kEdges[(i / 13) % 6] : static_cast<uint8_t>(center - 3 + static_cast<int>(generator() % 6));
  }
  return m;
}

// Device copies: codes in the kernel order, scales as they are.
struct DeviceExperts {
  DeviceTensor codes, scales;
  Mxfp4Matrices matrices(const HostExperts& m) const {
    return Mxfp4Matrices{static_cast<const uint8_t*>(codes.view.data()),
                         static_cast<const uint8_t*>(scales.view.data()), m.rows, m.cols};
  }
};

DeviceExperts upload_experts(Backend& gpu, const HostExperts& m) {
  HostTensor codes(DType::u8, {static_cast<int64_t>(m.codes.size())});
  std::memcpy(codes.data(), m.codes.data(), m.codes.size());
  mxfp4_codes_to_kernel_order(codes.data_as<uint8_t>(), m.codes.size());
  HostTensor scales(DType::u8, {static_cast<int64_t>(m.scales.size())});
  std::memcpy(scales.data(), m.scales.data(), m.scales.size());
  return DeviceExperts{upload(gpu, codes), upload(gpu, scales)};
}

struct Case {
  Activation activation;
  int64_t experts, latent, intermediate;
  int top_k, tokens;
};

std::string name_of(const Case& c) {
  return std::string(to_string(c.activation)) + ", E " + std::to_string(c.experts) + ", l " + std::to_string(c.latent) +
         ", I " + std::to_string(c.intermediate) + ", top_k " + std::to_string(c.top_k) + ", T " +
         std::to_string(c.tokens);
}

// ids: each token names top_k distinct experts, drawn from a pool that tokens share; where the case has room, one
// pair a zero expert (E or E + 1) and one a pad (-1).
std::vector<int32_t> make_ids(const Case& c, uint32_t seed) {
  std::mt19937 generator(seed);
  std::vector<int32_t> ids(static_cast<size_t>(c.tokens * c.top_k));
  for (int t = 0; t < c.tokens; ++t) {
    std::vector<int32_t> all(static_cast<size_t>(c.experts));
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), generator);
    for (int j = 0; j < c.top_k; ++j) ids[static_cast<size_t>(t * c.top_k + j)] = all[static_cast<size_t>(j)];
  }
  if (c.top_k >= 3) {
    ids[1] = static_cast<int32_t>(c.experts + (seed % 2));  // a zero expert
    ids[ids.size() - 1] = -1;                               // a pad
  }
  return ids;
}

bool is_real(int32_t id, int64_t experts) { return id >= 0 && id < experts; }

double bf16_round(double v) {
  HostTensor one(DType::bf16, {1});
  store_from_float(one.data(), DType::bf16, 0, static_cast<float>(v));
  return value_at(one, 0);
}

void run_case(CudaBackend& gpu, const Case& c, uint32_t seed) {
  SCOPED_TRACE(name_of(c));
  const bool gated = c.activation != Activation::relu2;
  const int64_t pairs = static_cast<int64_t>(c.tokens) * c.top_k;
  const int64_t ld_z = c.latent + 16, ld_out = c.latent + 8;
  const HostExperts up = random_experts(c.experts, c.intermediate, c.latent, seed, 122);
  const HostExperts gate = gated ? random_experts(c.experts, c.intermediate, c.latent, seed + 1, 122) : HostExperts{};
  const HostExperts down = random_experts(c.experts, c.latent, c.intermediate, seed + 2, 121);
  const std::vector<int32_t> ids = make_ids(c, seed + 3);
  const HostTensor weights = random_tensor(DType::f32, {c.tokens, c.top_k}, seed + 4, 0.05f, 1.0f);
  const HostTensor z = random_tensor(DType::bf16, {c.tokens, ld_z}, seed + 5, -1.0f, 1.0f);
  ActivationParams activation;
  activation.activation = c.activation;

  // The reference act rows: the sums in double, the activation, rounded to bf16 as the kernel stores them; and the
  // bound on the fp32 sums' error that the activation carries (the sums of |products| times the activation's slope:
  // silu and situ move by at most 1.1 |u| per unit of g and |g| per unit of u, relu2 by 2 |u|).
  std::vector<double> act_ref(static_cast<size_t>(pairs * c.intermediate), 0.0);
  std::vector<double> act_slack(act_ref.size(), 0.0);
  for (int64_t p = 0; p < pairs; ++p) {
    const int32_t e = ids[static_cast<size_t>(p)];
    if (!is_real(e, c.experts)) continue;
    for (int64_t i = 0; i < c.intermediate; ++i) {
      double g = 0.0, u = 0.0, g_size = 0.0, u_size = 0.0;
      for (int64_t k = 0; k < c.latent; ++k) {
        const double x = value_at(z, (p / c.top_k) * ld_z + k);
        u += up.value(e, i, k) * x;
        u_size += std::abs(up.value(e, i, k) * x);
        if (gated) {
          g += gate.value(e, i, k) * x;
          g_size += std::abs(gate.value(e, i, k) * x);
        }
      }
      const size_t at = static_cast<size_t>(p * c.intermediate + i);
      act_ref[at] = bf16_round(cpu::activate(activation, g, u));
      act_slack[at] =
          0x1p-14 * (gated ? g_size * 1.1 * std::abs(u) + u_size * std::abs(g) : u_size * 2.0 * std::abs(u));
    }
  }

  HostTensor ids_host(DType::i32, {c.tokens, c.top_k});
  std::memcpy(ids_host.data(), ids.data(), ids.size() * sizeof(int32_t));
  const DeviceTensor d_ids = upload(gpu, ids_host), d_weights = upload(gpu, weights), d_z = upload(gpu, z);
  const DeviceExperts d_up = upload_experts(gpu, up), d_down = upload_experts(gpu, down);
  const DeviceExperts d_gate = gated ? upload_experts(gpu, gate) : DeviceExperts{};
  Mxfp4GateUpCall gate_up;
  gate_up.dtype = DType::bf16;
  gate_up.activation = activation;
  gate_up.ids = static_cast<const int32_t*>(d_ids.view.data());
  gate_up.tokens = c.tokens;
  gate_up.top_k = c.top_k;
  gate_up.num_experts = static_cast<int>(c.experts);
  gate_up.z = d_z.view.data();
  gate_up.ld_z = ld_z;
  gate_up.up = d_up.matrices(up);
  if (gated) gate_up.gate = d_gate.matrices(gate);
  Mxfp4DownCall down_call;
  down_call.dtype = DType::bf16;
  down_call.ids = gate_up.ids;
  down_call.weights = static_cast<const float*>(d_weights.view.data());
  down_call.tokens = c.tokens;
  down_call.top_k = c.top_k;
  down_call.num_experts = gate_up.num_experts;
  down_call.down = d_down.matrices(down);
  down_call.ld_out = ld_out;

  std::vector<uint8_t> first_act, first_out;
  for (int run = 0; run < 2; ++run) {
    const DeviceTensor act = poisoned(gpu, DType::bf16, {pairs, c.intermediate});
    const DeviceTensor out = poisoned(gpu, DType::bf16, {c.tokens, ld_out});
    gate_up.act = act.view.data();
    down_call.act = act.view.data();
    down_call.out = out.view.data();
    ASSERT_TRUE(mxfp4_pairs_supported(gate_up, down_call));
    const auto stream = static_cast<cudaStream_t>(gpu.stream());
    mxfp4_pairs_gate_up(gate_up, stream);
    mxfp4_pairs_down(down_call, stream);
    const HostTensor act_host = download(gpu, act.view), out_host = download(gpu, out.view);
    if (run == 0) {
      // Element by element. An act value is the reference's, or one bf16 ulp from it where the exact value lies
      // near a rounding boundary, or as far as the fp32 sums' error carries it (act_slack).
      for (int64_t p = 0; p < pairs; ++p) {
        const bool real = is_real(ids[static_cast<size_t>(p)], c.experts);
        for (int64_t i = 0; i < c.intermediate; ++i) {
          const float got = value_at(act_host, p * c.intermediate + i);
          const size_t at = static_cast<size_t>(p * c.intermediate + i);
          if (!real) {
            ASSERT_TRUE(std::isnan(got)) << "pair " << p << " (expert " << ids[static_cast<size_t>(p)]
                                         << ") has no act row, but row " << i << " was written";
            continue;
          }
          ASSERT_LE(std::abs(got - act_ref[at]), 0x1p-7 * std::abs(act_ref[at]) + act_slack[at] + 0x1p-126)
              << "act pair " << p << ", row " << i << ": " << got << " against " << act_ref[at];
        }
      }
      // The output against the down and the combine of the kernel's own act rows, in double: within half a bf16
      // ulp of the value and the fp32 sums' error (2^-14 of the sum of |w · products|: K 2^-24 for K up to 1024).
      for (int64_t t = 0; t < c.tokens; ++t) {
        for (int64_t r = 0; r < ld_out; ++r) {
          const float got = value_at(out_host, t * ld_out + r);
          if (r >= c.latent) {
            ASSERT_TRUE(std::isnan(got)) << "the padding of output row " << t << " was written at column " << r;
            continue;
          }
          double want = 0.0, magnitude = 0.0;
          for (int j = 0; j < c.top_k; ++j) {
            const int64_t p = t * c.top_k + j;
            const int32_t e = ids[static_cast<size_t>(p)];
            if (!is_real(e, c.experts)) continue;
            for (int64_t i = 0; i < c.intermediate; ++i) {
              const double product = value_at(weights, p) * down.value(e, r, i) *
                                     static_cast<double>(value_at(act_host, p * c.intermediate + i));
              want += product;
              magnitude += std::abs(product);
            }
          }
          ASSERT_LE(std::abs(got - want), 0x1p-8 * std::abs(want) + 0x1p-14 * magnitude + 0x1p-126)
              << "output token " << t << ", row " << r << ": " << got << " against " << want;
        }
      }
      first_act.assign(static_cast<const uint8_t*>(act_host.data()),
                       static_cast<const uint8_t*>(act_host.data()) + act_host.nbytes());
      first_out.assign(static_cast<const uint8_t*>(out_host.data()),
                       static_cast<const uint8_t*>(out_host.data()) + out_host.nbytes());
    } else {
      ASSERT_EQ(first_act.size(), act_host.nbytes());
      ASSERT_EQ(first_out.size(), out_host.nbytes());
      EXPECT_EQ(std::memcmp(first_act.data(), act_host.data(), act_host.nbytes()), 0) << "act differs run to run";
      EXPECT_EQ(std::memcmp(first_out.data(), out_host.data(), out_host.nbytes()), 0) << "output differs run to run";
    }
  }

  // The two calls captured in a CUDA graph: replayed on the same inputs, the first run's bits; replayed after new
  // activations and routing weights were written into the same buffers, the bits of an eager run on those.
  const auto stream = static_cast<cudaStream_t>(gpu.stream());
  const DeviceTensor act = poisoned(gpu, DType::bf16, {pairs, c.intermediate});
  const DeviceTensor out = poisoned(gpu, DType::bf16, {c.tokens, ld_out});
  gate_up.act = act.view.data();
  down_call.act = act.view.data();
  down_call.out = out.view.data();
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  mxfp4_pairs_gate_up(gate_up, stream);
  mxfp4_pairs_down(down_call, stream);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  const HostTensor replayed = download(gpu, out.view);
  EXPECT_EQ(std::memcmp(first_out.data(), replayed.data(), replayed.nbytes()), 0) << "the graph's output differs";
  gpu.copy(random_tensor(DType::bf16, {c.tokens, ld_z}, seed + 6, -1.0f, 1.0f).view(), d_z.view);
  gpu.copy(random_tensor(DType::f32, {c.tokens, c.top_k}, seed + 7, 0.05f, 1.0f).view(), d_weights.view);
  poison(gpu, out);
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  const HostTensor replayed_new = download(gpu, out.view);
  poison(gpu, out);
  mxfp4_pairs_gate_up(gate_up, stream);
  mxfp4_pairs_down(down_call, stream);
  const HostTensor eager_new = download(gpu, out.view);
  EXPECT_EQ(std::memcmp(eager_new.data(), replayed_new.data(), eager_new.nbytes()), 0)
      << "the graph replayed on new inputs differs from an eager run";
  EXPECT_NE(std::memcmp(first_out.data(), replayed_new.data(), eager_new.nbytes()), 0) << "new inputs, same output";
  EXPECT_EQ(count_non_finite(eager_new), c.tokens * (ld_out - c.latent));  // only the padding
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
}

TEST(Mxfp4Pairs, match_an_exact_reference) {
  LATENTMOE_REQUIRE_GPU();
  if (current_compute_capability() < 90) GTEST_SKIP() << "the pair kernels need sm_90 (clusters)";
  auto gpu = std::make_unique<CudaBackend>(0);
  uint32_t seed = 300;
  for (int tokens : {1, 2, 5, 8}) {
    for (const Case& c : {Case{Activation::situ, 9, 544, 320, 4, tokens}, Case{Activation::silu, 6, 64, 256, 3, tokens},
                          Case{Activation::relu2, 5, 32, 256, 3, tokens}, Case{Activation::relu2, 7, 96, 32, 2, tokens},
                          Case{Activation::silu, 40, 96, 64, 32, tokens}}) {
      run_case(*gpu, c, ++seed);
    }
  }
}

TEST(Mxfp4Pairs, refuse_what_they_do_not_take) {
  LATENTMOE_REQUIRE_GPU();
  auto gpu = std::make_unique<CudaBackend>(0);
  const DeviceTensor codes = device_empty(*gpu, DType::u8, {64 * 64});
  const DeviceTensor scales = device_empty(*gpu, DType::u8, {64 * 4});
  const DeviceTensor z = device_empty(*gpu, DType::bf16, {8, 72});
  const DeviceTensor act = device_empty(*gpu, DType::bf16, {256, 64});
  const DeviceTensor ids = device_empty(*gpu, DType::i32, {256});
  const DeviceTensor weights = device_empty(*gpu, DType::f32, {256});
  const auto* code_bytes = static_cast<const uint8_t*>(codes.view.data());
  const auto* scale_bytes = static_cast<const uint8_t*>(scales.view.data());
  Mxfp4GateUpCall gate_up;
  gate_up.dtype = DType::bf16;
  gate_up.activation.activation = Activation::relu2;
  gate_up.ids = static_cast<const int32_t*>(ids.view.data());
  gate_up.tokens = 2;
  gate_up.top_k = 2;
  gate_up.num_experts = 1;
  gate_up.z = z.view.data();
  gate_up.ld_z = 64;
  gate_up.up = Mxfp4Matrices{code_bytes, scale_bytes, 64, 64};
  gate_up.act = act.view.data();
  Mxfp4DownCall down;
  down.dtype = DType::bf16;
  down.ids = gate_up.ids;
  down.weights = static_cast<const float*>(weights.view.data());
  down.tokens = 2;
  down.top_k = 2;
  down.num_experts = 1;
  down.act = act.view.data();
  down.down = Mxfp4Matrices{code_bytes, scale_bytes, 64, 64};
  down.out = z.view.data();
  down.ld_out = 64;
  if (current_compute_capability() >= 90) EXPECT_TRUE(mxfp4_pairs_supported(gate_up, down));
  auto refused = [&](auto change, const char* what) {
    Mxfp4GateUpCall g = gate_up;
    Mxfp4DownCall d = down;
    change(g, d);
    EXPECT_FALSE(mxfp4_pairs_supported(g, d)) << what;
  };
  refused([](auto& g, auto& d) { g.dtype = d.dtype = DType::f16; }, "f16");
  refused([](auto& g, auto& d) { g.tokens = d.tokens = 9; }, "9 tokens");
  refused([](auto& g, auto& d) { g.top_k = d.top_k = 129; }, "258 pairs");
  refused([](auto& g, auto&) { g.ld_z = 68; }, "z rows not 16-byte aligned");
  refused([](auto& g, auto&) { g.up.rows = 56; }, "gate/up rows not a multiple of 16");
  refused([](auto&, auto& d) { d.down.rows = 40; }, "down rows not a multiple of 16");
  refused([&](auto& g, auto&) { g.up.packed = code_bytes + 4; }, "codes not 16-byte aligned");
  refused([](auto& g, auto&) { g.activation.activation = Activation::silu; }, "silu without gate weights");
  refused([](auto&, auto& d) { d.top_k = 3; }, "the two calls' top_k differ");
  refused([](auto&, auto& d) { d.ld_out = 32; }, "an output row stride shorter than the row");
  Mxfp4GateUpCall f16 = gate_up;
  f16.dtype = DType::f16;
  try {
    mxfp4_pairs_gate_up(f16, static_cast<cudaStream_t>(gpu->stream()));
    ADD_FAILURE() << "an f16 call was taken";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("MXFP4 pair gate/up: unsupported call"), std::string::npos)
        << error.what();
  }
}

// The down kernel's launch rule (no GPU needed): ceil(pairs / min(8, ceil(pairs / 4))) pairs a CTA, as many CTAs a
// cluster as the pairs fill, a warp a pair up to 8 warps.
TEST(Mxfp4Pairs, down_launch_rule) {
  struct Expected {
    int pairs, cluster, pairs_per_cta, warps;
  };
  for (const Expected& e :
       {Expected{1, 1, 1, 1}, Expected{3, 1, 3, 3}, Expected{5, 2, 3, 3}, Expected{16, 4, 4, 4}, Expected{22, 6, 4, 4},
        Expected{32, 8, 4, 4}, Expected{33, 7, 5, 5}, Expected{128, 8, 16, 8}, Expected{256, 8, 32, 8}}) {
    const Mxfp4PairsDownShape shape = mxfp4_pairs_down_shape(e.pairs);
    EXPECT_EQ(shape.cluster, e.cluster) << e.pairs << " pairs";
    EXPECT_EQ(shape.pairs_per_cta, e.pairs_per_cta) << e.pairs << " pairs";
    EXPECT_EQ(shape.warps, e.warps) << e.pairs << " pairs";
    EXPECT_LE((shape.cluster - 1) * shape.pairs_per_cta, e.pairs - 1) << "an empty CTA at " << e.pairs << " pairs";
  }
  for (int pairs : {0, 257}) {
    try {
      (void)mxfp4_pairs_down_shape(pairs);
      ADD_FAILURE() << pairs << " pairs taken";
    } catch (const Error& error) {
      EXPECT_NE(std::string(error.what()).find(std::to_string(pairs) + " pairs; they take 1..256"), std::string::npos)
          << error.what();
    }
  }
}

// The settings registry declares the backend's bound when LATENTMOE_MXFP4_PAIRS_MAX_TOKENS is unset (the registry, in
// core, cannot name the CUDA constant), and the range the backend's setter accepts. Host only.
TEST(Mxfp4Pairs, token_bound_is_the_registrys_default) {
  const auto& spec = latentmoe::detail::setting_spec(latentmoe::detail::Setting::mxfp4_pairs_max_tokens);
  EXPECT_EQ(spec.fallback, int64_t{kMxfp4PairsTokens});
  EXPECT_EQ(spec.min, 0);
  EXPECT_EQ(spec.max, int64_t{kMxfp4PairsMaxTokens});
  EXPECT_LE(kMxfp4PairsTokens, kMxfp4PairsMaxTokens);
}

}  // namespace
}  // namespace latentmoe::cuda::testing

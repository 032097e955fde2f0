// The tail alone (latentmoe/tail.h) on the CPU backend: every tier at tp 2 and 4 (and native at tp 1),
// with and without the latent norm, in f32, bf16 and f16, against the native tail computed by hand in
// double from every rank's partials (out = RMSNorm(sum_r L_r) W_up^T + sum_r S_r); every rank holds
// the same bits; the inputs are left as they were; bad arguments and impossible tiers are refused.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "error_test_util.h"
#include "latentmoe/compare.h"
#include "latentmoe/in_process_group.h"
#include "latentmoe/random.h"
#include "latentmoe/rank_context.h"
#include "latentmoe/runner.h"
#include "latentmoe/tail.h"
#include "layer_test_util.h"

namespace latentmoe {
namespace {

using testing::expect_error;
using testing::random_host_tensor;
using testing::value_at;

// d and l divisible by 4 but otherwise odd-sized per rank (d/4 = 11, l/4 = 7).
constexpr int64_t kHidden = 44;
constexpr int64_t kLatent = 28;
constexpr float kEps = 1e-5f;

// f32: the ranks' partial sums are added in rank order in double, then rounded once; the rest is fp32
// accumulation. bf16/f16: the reduced latent and the output are rounded to 8 (11) bits of mantissa.
double tolerance_for(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return 1e-5;
    case DType::f16:
      return 4e-3;
    default:
      return 2e-2;
  }
}

struct TailInputs {
  std::vector<HostTensor> shared, latent;  // per rank: S_r [T, d], L_r [T, l]
  HostTensor up_proj;                      // [d, l]
  HostTensor latent_norm;                  // [l] f32, or undefined
};

TailInputs make_inputs(int tp, int64_t tokens, DType dtype, bool with_norm, uint64_t seed) {
  TailInputs in;
  for (int r = 0; r < tp; ++r) {
    in.shared.push_back(random_host_tensor(dtype, {tokens, kHidden}, seed + 10 * r + 1));
    in.latent.push_back(random_host_tensor(dtype, {tokens, kLatent}, seed + 10 * r + 2));
  }
  in.up_proj = random_host_tensor(dtype, {kHidden, kLatent}, seed + 3, 1.0f / std::sqrt(float(kLatent)));
  if (with_norm) in.latent_norm = random_uniform_tensor(DType::f32, {kLatent}, seed + 4, 0.25f, 1.0f);
  return in;
}

// The native tail by hand, in double, from the very values the ranks hold.
std::vector<double> reference_tail(const TailInputs& in, int64_t tokens) {
  const int tp = static_cast<int>(in.shared.size());
  std::vector<double> out(static_cast<size_t>(tokens * kHidden));
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<double> latent(kLatent, 0.0);
    for (int r = 0; r < tp; ++r) {
      for (int64_t i = 0; i < kLatent; ++i) latent[i] += value_at(in.latent[r], t * kLatent + i);
    }
    if (in.latent_norm.defined()) {
      double mean_square = 0.0;
      for (double v : latent) mean_square += v * v / kLatent;
      const double scale = 1.0 / std::sqrt(mean_square + kEps);
      for (int64_t i = 0; i < kLatent; ++i) latent[i] *= scale * value_at(in.latent_norm, i);
    }
    for (int64_t j = 0; j < kHidden; ++j) {
      double value = 0.0;
      for (int64_t i = 0; i < kLatent; ++i) value += value_at(in.up_proj, j * kLatent + i) * latent[i];
      for (int r = 0; r < tp; ++r) value += value_at(in.shared[r], t * kHidden + j);
      out[t * kHidden + j] = value;
    }
  }
  return out;
}

TailWeights weights_of(const TailInputs& in) {
  TailWeights weights;
  weights.up_proj = in.up_proj.view();
  if (in.latent_norm.defined()) weights.latent_norm = in.latent_norm.view();
  return weights;
}

struct TailCase {
  DType dtype;
  int tp;
  TailTier tier;
  int64_t tokens;
  bool norm;
};

std::string describe(const TailCase& c) {
  return std::string(dtype_name(c.dtype)) + "_" + std::string(to_string(c.tier)) + "_tp" + std::to_string(c.tp) + "_t" +
         std::to_string(c.tokens) + (c.norm ? "_norm" : "_nonorm");
}
void PrintTo(const TailCase& c, std::ostream* os) { *os << describe(c); }

class TailAloneTierTest : public ::testing::TestWithParam<TailCase> {};

TEST_P(TailAloneTierTest, matches_the_native_tail_by_hand_and_ranks_agree) {
  const TailCase& c = GetParam();
  const TailInputs in = make_inputs(c.tp, c.tokens, c.dtype, c.norm, 1000 + c.tokens);
  std::vector<HostTensor> before_shared, before_latent;
  for (int r = 0; r < c.tp; ++r) {
    before_shared.push_back(to_host_tensor(in.shared[r].view(), c.dtype));
    before_latent.push_back(to_host_tensor(in.latent[r].view(), c.dtype));
  }
  std::vector<HostTensor> outputs(c.tp);
  std::vector<TailTier> ran(c.tp);
  auto group = make_in_process_group(c.tp);
  run_ranks(group, [&](int rank) {
    RankContextOptions options;
    options.max_tokens = 64;
    RankContext context(ParallelConfig{c.tp, rank, false}, *group[rank], options);
    Tail tail(context, kHidden, kLatent, weights_of(in), kEps, c.dtype);
    outputs[rank] = HostTensor(c.dtype, {c.tokens, kHidden});
    // Poison: every element must be written.
    std::memset(outputs[rank].data(), 0xff, outputs[rank].nbytes());
    ran[rank] = tail.forward(in.shared[rank].view(), in.latent[rank].view(), outputs[rank].view(), c.tier);
  });
  const std::vector<double> reference = reference_tail(in, c.tokens);
  for (int rank = 0; rank < c.tp; ++rank) {
    EXPECT_EQ(ran[rank], c.tier);
    EXPECT_TRUE(bitwise_equal(outputs[rank].view(), outputs[0].view())) << "rank " << rank;
    EXPECT_TRUE(bitwise_equal(in.shared[rank].view(), before_shared[rank].view())) << "S_r of rank " << rank;
    EXPECT_TRUE(bitwise_equal(in.latent[rank].view(), before_latent[rank].view())) << "L_r of rank " << rank;
  }
  const double error = testing::max_relative_error_vs(outputs[0], reference);
  EXPECT_LE(error, tolerance_for(c.dtype)) << describe(c);
}

std::vector<TailCase> all_cases() {
  std::vector<TailCase> cases;
  for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
    for (bool norm : {true, false}) {
      cases.push_back({dtype, 1, TailTier::native, 5, norm});
      for (int tp : {2, 4}) {
        for (TailTier tier : kAllTailTiers) {
          for (int64_t tokens : {1, 7, 33}) cases.push_back({dtype, tp, tier, tokens, norm});
        }
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(AllTiers, TailAloneTierTest, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<TailCase>& info) { return describe(info.param); });

// The automatic choice follows the policy, and a tail shares the context of a layer without
// disturbing it: the layer's output is bit-identical with and without the tail's forwards between.
TEST(TailAloneTest, policy_picks_by_token_count) {
  constexpr int kTp = 2;
  const TailInputs in = make_inputs(kTp, 1, DType::f32, true, 5);
  auto group = make_in_process_group(kTp);
  std::vector<std::vector<TailTier>> selected(kTp);
  run_ranks(group, [&](int rank) {
    RankContext context(ParallelConfig{kTp, rank, false}, *group[rank]);
    TierPolicy policy;
    policy.tail_fusion_max_tokens = 4;
    policy.shared_stream_token_threshold = 16;
    Tail tail(context, kHidden, kLatent, weights_of(in), kEps, DType::f32, policy);
    for (int64_t tokens : {1, 4, 5, 16, 17}) selected[rank].push_back(tail.select_tier(tokens));
  });
  const std::vector<TailTier> expected = {TailTier::tail_fusion, TailTier::tail_fusion, TailTier::allreduce_overlap,
                                          TailTier::allreduce_overlap, TailTier::column_parallel};
  for (int rank = 0; rank < kTp; ++rank) EXPECT_EQ(selected[rank], expected);
}

TEST(TailAloneTest, shares_a_context_with_a_layer) {
  constexpr int kTp = 2;
  const LayerConfig config = testing::kimi_like_config();
  const LayerWeights full = make_random_layer_weights(config, DType::bf16, 3, /*with_gate=*/false);
  const LocalGroupInputs layer_inputs = testing::random_inputs(config, 9, DType::bf16, 17);
  const TailInputs in = make_inputs(kTp, 6, DType::bf16, true, 23);
  std::vector<HostTensor> alone(kTp), shared(kTp);
  auto run = [&](bool with_tail, std::vector<HostTensor>& outputs) {
    auto group = make_in_process_group(kTp);
    run_ranks(group, [&](int rank) {
      const ParallelConfig parallel{kTp, rank, false};
      RankContext context(parallel, *group[rank]);
      Runner layer(context, config, parallel, shard_layer_weights(full, config, parallel));
      std::optional<Tail> tail;
      if (with_tail) tail.emplace(context, kHidden, kLatent, weights_of(in), kEps, DType::bf16);
      HostTensor tail_out(DType::bf16, {6, kHidden});
      if (tail) tail->forward(in.shared[rank].view(), in.latent[rank].view(), tail_out.view(), std::nullopt);
      outputs[rank] = HostTensor(DType::bf16, {9, config.hidden_size});
      layer.forward({layer_inputs.hidden_states.view(), layer_inputs.router_logits.view(), {}, std::nullopt},
                    {outputs[rank].view(), {}, {}});
      if (tail) tail->forward(in.shared[rank].view(), in.latent[rank].view(), tail_out.view(), std::nullopt);
    });
  };
  run(false, alone);
  run(true, shared);
  for (int rank = 0; rank < kTp; ++rank) EXPECT_TRUE(bitwise_equal(alone[rank].view(), shared[rank].view()));
}

TEST(TailAloneTest, refuses_bad_arguments) {
  auto group = make_in_process_group(1);
  RankContextOptions options;
  options.max_tokens = 8;
  RankContext context(ParallelConfig{1, 0, false}, *group[0], options);
  const TailInputs in = make_inputs(1, 3, DType::bf16, true, 9);
  const TailWeights weights = weights_of(in);
  expect_error([&] { Tail(context, kHidden, kLatent, weights, kEps, DType::i32); }, {"not a compute dtype"});
  expect_error([&] { Tail(context, kHidden, kLatent, weights, kEps, DType::f32); }, {"up_proj has dtype BF16"});
  expect_error([&] { Tail(context, kHidden + 1, kLatent, weights, kEps, DType::bf16); },
               {"tail: up_proj has shape [44, 28], expected [45, 28]"});
  expect_error([&] { Tail(context, kHidden, kLatent, TailWeights{}, kEps, DType::bf16); }, {"up_proj", "missing"});
  TailWeights bad_norm = weights;
  const HostTensor norm16 = random_host_tensor(DType::bf16, {kLatent}, 1);
  bad_norm.latent_norm = norm16.view();
  expect_error([&] { Tail(context, kHidden, kLatent, bad_norm, kEps, DType::bf16); }, {"latent_norm has dtype BF16"});

  Tail tail(context, kHidden, kLatent, weights, kEps, DType::bf16);
  HostTensor out(DType::bf16, {3, kHidden});
  const TensorView s = in.shared[0].view(), l = in.latent[0].view();
  expect_error([&] { tail.forward(s, l, out.view(), TailTier::tail_fusion); }, {"tier tail_fusion", "tp"});
  expect_error([&] { tail.forward(l, l, out.view(), std::nullopt); }, {"shared_partial has shape [3, 28]"});
  expect_error([&] { tail.forward(s, s, out.view(), std::nullopt); }, {"latent_partial has shape [3, 44]"});
  const HostTensor wrong_dtype = random_host_tensor(DType::f32, {3, kHidden}, 2);
  expect_error([&] { tail.forward(wrong_dtype.view(), l, out.view(), std::nullopt); },
               {"shared_partial has dtype F32, expected BF16"});
  const HostTensor wide = random_host_tensor(DType::bf16, {3, 2 * kHidden}, 2);
  expect_error([&] { tail.forward(wide.view().slice_cols(0, kHidden), l, out.view(), std::nullopt); },
               {"shared_partial must be contiguous"});
  const HostTensor many_s = random_host_tensor(DType::bf16, {9, kHidden}, 3);
  const HostTensor many_l = random_host_tensor(DType::bf16, {9, kLatent}, 4);
  HostTensor many_out(DType::bf16, {9, kHidden});
  expect_error([&] { tail.forward(many_s.view(), many_l.view(), many_out.view(), std::nullopt); },
               {"tail got 9 tokens", "max_tokens = 8"});
  // After the first forward the context's buffers are fixed: a larger tail is refused.
  tail.forward(s, l, out.view(), std::nullopt);
  const HostTensor big_up = random_host_tensor(DType::bf16, {2 * kHidden, kLatent}, 5);
  TailWeights big = weights;
  big.up_proj = big_up.view();
  expect_error([&] { Tail(context, 2 * kHidden, kLatent, big, kEps, DType::bf16); },
               {"construct every layer before the first forward: this tail (d 88"});
}

TEST(TailAloneTest, refuses_sizes_tp_does_not_divide) {
  auto group = make_in_process_group(4);
  const TailInputs in = make_inputs(1, 1, DType::f32, false, 2);
  const HostTensor up = random_host_tensor(DType::f32, {42, kLatent}, 3);
  run_ranks(group, [&](int rank) {
    RankContext context(ParallelConfig{4, rank, false}, *group[rank]);
    expect_error(
        [&] {
          Tail(context, 42, kLatent, TailWeights{{}, up.view()}, kEps, DType::f32);
        },
        {"tail: tp 4 must divide hidden_size (42)"});
  });
}

}  // namespace
}  // namespace latentmoe

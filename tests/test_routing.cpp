// Routing on the CPU backend (DESIGN section 1 step 1): hand-computed cases, then a cross-check
// against a slow, obviously correct implementation on random logits.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "core/backend.h"
#include "cpu/routing.h"
#include "latentmoe/error.h"
#include "latentmoe/tensor.h"

namespace latentmoe {
namespace {

using detail::RoutingParams;

struct Routed {
  std::vector<int32_t> ids;      // [T, k]
  std::vector<float> weights;    // [T, k]
  std::vector<float> zero_sums;  // [T]
};

// Routes `logits` ([T, E+Z] row-major) through the CPU backend; an empty bias means none.
Routed route(const RoutingParams& params, const std::vector<float>& logits, const std::vector<float>& bias = {}) {
  const int64_t width = params.num_experts + params.num_zero_experts;
  const int64_t num_tokens = static_cast<int64_t>(logits.size()) / width;
  HostTensor logit_tensor(DType::f32, {num_tokens, width});
  std::copy(logits.begin(), logits.end(), logit_tensor.data_as<float>());
  HostTensor bias_tensor;
  if (!bias.empty()) {
    bias_tensor = HostTensor(DType::f32, {width});
    std::copy(bias.begin(), bias.end(), bias_tensor.data_as<float>());
  }
  HostTensor ids(DType::i32, {num_tokens, params.top_k});
  HostTensor weights(DType::f32, {num_tokens, params.top_k});
  HostTensor zero_sums(DType::f32, {num_tokens});
  auto backend = detail::make_cpu_backend();
  backend->route(params, logit_tensor.view(), bias.empty() ? TensorView() : bias_tensor.view(), ids.view(),
                 weights.view(), zero_sums.view());
  Routed result;
  result.ids.assign(ids.data_as<int32_t>(), ids.data_as<int32_t>() + ids.numel());
  result.weights.assign(weights.data_as<float>(), weights.data_as<float>() + weights.numel());
  result.zero_sums.assign(zero_sums.data_as<float>(), zero_sums.data_as<float>() + num_tokens);
  return result;
}

RoutingParams make_params(int64_t num_experts, int64_t top_k, ScoringFunc scoring = ScoringFunc::sigmoid) {
  RoutingParams params;
  params.scoring = scoring;
  params.num_experts = num_experts;
  params.top_k = top_k;
  return params;
}

// The logit whose sigmoid is p.
float logit_of(double p) { return static_cast<float>(std::log(p / (1.0 - p))); }

// The scores of the two group tests below, as logits: (0.6, 0.55 | 0.7, 0.5 | 0.9, 0.1 | 0.3, 0.2).
std::vector<float> group_test_logits() {
  std::vector<float> logits;
  for (double p : {0.6, 0.55, 0.7, 0.5, 0.9, 0.1, 0.3, 0.2}) logits.push_back(logit_of(p));
  return logits;
}

const float kLn3 = static_cast<float>(std::log(3.0));
const float kLn9 = static_cast<float>(std::log(9.0));
constexpr float kTol = 1e-6f;

TEST(Routing, sigmoid_scores_renormalised) {
  // sigmoid(0, ln3, -ln3, ln9) = (0.5, 0.75, 0.25, 0.9). Top 2: ids 3, 1.
  // Renormalised: 0.9 / 1.65 = 0.545455, 0.75 / 1.65 = 0.454545.
  Routed r = route(make_params(4, 2), {0.0f, kLn3, -kLn3, kLn9});
  EXPECT_EQ(r.ids, (std::vector<int32_t>{3, 1}));
  EXPECT_NEAR(r.weights[0], 0.9 / 1.65, kTol);
  EXPECT_NEAR(r.weights[1], 0.75 / 1.65, kTol);
  EXPECT_EQ(r.zero_sums[0], 0.0f);
}

TEST(Routing, softmax_scores) {
  // exp(0, ln3, -ln3, ln9) = (1, 3, 1/3, 9), sum 40/3: scores (3/40, 9/40, 1/40, 27/40).
  RoutingParams params = make_params(4, 2, ScoringFunc::softmax);
  params.norm_topk_prob = false;
  Routed raw = route(params, {0.0f, kLn3, -kLn3, kLn9});
  EXPECT_EQ(raw.ids, (std::vector<int32_t>{3, 1}));
  EXPECT_NEAR(raw.weights[0], 27.0 / 40, kTol);  // 0.675
  EXPECT_NEAR(raw.weights[1], 9.0 / 40, kTol);   // 0.225
  // Renormalised over the chosen two: 27/36 and 9/36.
  params.norm_topk_prob = true;
  Routed normed = route(params, {0.0f, kLn3, -kLn3, kLn9});
  EXPECT_NEAR(normed.weights[0], 0.75, kTol);
  EXPECT_NEAR(normed.weights[1], 0.25, kTol);
}

TEST(Routing, bias_changes_selection_not_weights) {
  // Scores (0.5, 0.75, 0.25, 0.9); bias (0, 0, 0.7, 0) makes the biased scores (0.5, 0.75, 0.95, 0.9):
  // ids 2, 3 in that order. Weights from the unbiased scores: 0.25 / 1.15 = 0.217391, 0.9 / 1.15 = 0.782609.
  Routed r = route(make_params(4, 2), {0.0f, kLn3, -kLn3, kLn9}, {0.0f, 0.0f, 0.7f, 0.0f});
  EXPECT_EQ(r.ids, (std::vector<int32_t>{2, 3}));
  EXPECT_NEAR(r.weights[0], 0.25 / 1.15, kTol);
  EXPECT_NEAR(r.weights[1], 0.9 / 1.15, kTol);
}

TEST(Routing, renormalisation_and_scaling_factor) {
  // Scores (0.5, 0.75, 0.25, 0.9), ids 3, 1; scale 2.5.
  RoutingParams params = make_params(4, 2);
  params.routed_scaling_factor = 2.5f;
  params.norm_topk_prob = false;
  Routed raw = route(params, {0.0f, kLn3, -kLn3, kLn9});
  EXPECT_NEAR(raw.weights[0], 0.9 * 2.5, 4 * kTol);   // 2.25
  EXPECT_NEAR(raw.weights[1], 0.75 * 2.5, 4 * kTol);  // 1.875
  params.norm_topk_prob = true;
  Routed normed = route(params, {0.0f, kLn3, -kLn3, kLn9});
  EXPECT_NEAR(normed.weights[0], 0.9 / 1.65 * 2.5, 4 * kTol);   // 1.363636
  EXPECT_NEAR(normed.weights[1], 0.75 / 1.65 * 2.5, 4 * kTol);  // 1.136364
}

TEST(Routing, group_limited_drops_best_single_expert) {
  // E = 8 in 4 groups of 2; keep 2 groups; k = 2. Scores (0.6, 0.55 | 0.7, 0.5 | 0.9, 0.1 | 0.3, 0.2).
  // Group scores (sum of the best two): 1.15, 1.2, 1.0, 0.5 -> keep groups 1 and 0. The best single
  // expert, id 4 (0.9), is in dropped group 2. Top 2 of ids 0..3: id 2 (0.7), id 0 (0.6);
  // weights 0.7 / 1.3 = 0.538462, 0.6 / 1.3 = 0.461538.
  const std::vector<float> logits = group_test_logits();
  RoutingParams params = make_params(8, 2);
  params.n_group = 4;
  params.topk_group = 2;
  Routed grouped = route(params, logits);
  EXPECT_EQ(grouped.ids, (std::vector<int32_t>{2, 0}));
  EXPECT_NEAR(grouped.weights[0], 0.7 / 1.3, kTol);
  EXPECT_NEAR(grouped.weights[1], 0.6 / 1.3, kTol);
  // Without groups the best two overall are ids 4 and 2.
  Routed flat = route(make_params(8, 2), logits);
  EXPECT_EQ(flat.ids, (std::vector<int32_t>{4, 2}));
}

TEST(Routing, group_scores_use_biased_scores) {
  // Same scores as above plus bias 0.5 on id 5 (biased 0.6): group scores 1.15, 1.2, 0.9 + 0.6 = 1.5, 0.5
  // -> keep groups 2 and 1. Top 2 of ids 2..5 by biased score (0.7, 0.5, 0.9, 0.6): id 4, id 2.
  // Weights from the unbiased scores: 0.9 / 1.6 = 0.5625, 0.7 / 1.6 = 0.4375.
  const std::vector<float> logits = group_test_logits();
  RoutingParams params = make_params(8, 2);
  params.n_group = 4;
  params.topk_group = 2;
  Routed r = route(params, logits, {0, 0, 0, 0, 0, 0.5f, 0, 0});
  EXPECT_EQ(r.ids, (std::vector<int32_t>{4, 2}));
  EXPECT_NEAR(r.weights[0], 0.9 / 1.6, kTol);
  EXPECT_NEAR(r.weights[1], 0.7 / 1.6, kTol);
}

TEST(Routing, tie_between_groups_goes_to_lower_group) {
  // Logits 0 give scores 0.5 exactly; bias (0, 0 | -0.25, 0.25 | 0.25, -0.25) gives biased scores
  // (0.5, 0.5 | 0.25, 0.75 | 0.75, 0.25): every group scores 1.0. topk_group 1 keeps group 0, so ids 3
  // and 4 (0.75) are excluded and the top 1 is id 0 (tied with id 1: lower id). Weight 0.5 / 0.5 = 1.
  RoutingParams params = make_params(6, 1);
  params.n_group = 3;
  params.topk_group = 1;
  Routed r = route(params, std::vector<float>(6, 0.0f), {0, 0, -0.25f, 0.25f, 0.25f, -0.25f});
  EXPECT_EQ(r.ids, (std::vector<int32_t>{0}));
  EXPECT_FLOAT_EQ(r.weights[0], 1.0f);
}

TEST(Routing, single_member_groups_score_by_their_one_expert) {
  // 4 groups of 1, keep 2, k 2: identical to plain top 2. Scores (0.5, 0.75, 0.25, 0.9): ids 3, 1.
  RoutingParams params = make_params(4, 2);
  params.n_group = 4;
  params.topk_group = 2;
  Routed r = route(params, {0.0f, kLn3, -kLn3, kLn9});
  EXPECT_EQ(r.ids, (std::vector<int32_t>{3, 1}));
}

TEST(Routing, zero_experts_take_part_and_sum_their_weights) {
  // E = 3, Z = 2, k = 2. Token 0: scores (0.75, 0.5, 0.25 | 0.9, 0.1): ids 3 (zero expert), 0;
  // weights 0.9/1.65 = 0.545455, 0.75/1.65 = 0.454545; zero_weight_sum = 0.545455.
  // Token 1: scores (0.9, 0.75, 0.5 | 0.25, 0.1): ids 0, 1, zero sum 0.
  // Token 2: scores (0.1, 0.25, 0.5 | 0.9, 0.75): ids 3, 4, both zero experts: zero sum = 1.
  RoutingParams params = make_params(3, 2);
  params.num_zero_experts = 2;
  params.routed_scaling_factor = 2.0f;
  Routed r = route(params, {kLn3, 0.0f, -kLn3, kLn9, -kLn9,  //
                            kLn9, kLn3, 0.0f, -kLn3, -kLn9,  //
                            -kLn9, -kLn3, 0.0f, kLn9, kLn3});
  EXPECT_EQ(r.ids, (std::vector<int32_t>{3, 0, 0, 1, 3, 4}));
  EXPECT_NEAR(r.weights[0], 2 * 0.9 / 1.65, 4 * kTol);
  EXPECT_NEAR(r.weights[1], 2 * 0.75 / 1.65, 4 * kTol);
  EXPECT_NEAR(r.zero_sums[0], 2 * 0.9 / 1.65, 4 * kTol);  // scaled like the weights: 1.090909
  EXPECT_EQ(r.zero_sums[1], 0.0f);
  EXPECT_NEAR(r.zero_sums[2], 2.0, 4 * kTol);
  EXPECT_EQ(r.zero_sums[2], r.weights[4] + r.weights[5]);
}

TEST(Routing, ties_go_to_the_lower_id) {
  // Identical logits: ids 0, 1, 2 with equal weights 1/3.
  Routed equal = route(make_params(6, 3), std::vector<float>(6, 1.5f));
  EXPECT_EQ(equal.ids, (std::vector<int32_t>{0, 1, 2}));
  for (float w : equal.weights) EXPECT_NEAR(w, 1.0 / 3, kTol);
  // Logits (1, 2, 2, 1, 2): the three 2s in id order, then the first 1.
  Routed partial = route(make_params(5, 4), {1, 2, 2, 1, 2});
  EXPECT_EQ(partial.ids, (std::vector<int32_t>{1, 2, 4, 0}));
  // Softmax ties behave the same.
  Routed soft = route(make_params(5, 2, ScoringFunc::softmax), {1, 2, 2, 1, 2});
  EXPECT_EQ(soft.ids, (std::vector<int32_t>{1, 2}));
}

TEST(Routing, zero_score_sum_gives_zero_weights) {
  // sigmoid(-1000) is 0 in double: the chosen scores sum to 0 and 0 / (0 + 1e-20) = 0, not NaN.
  Routed r = route(make_params(3, 2), {-1000.0f, -1000.0f, -1000.0f});
  EXPECT_EQ(r.ids, (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(r.weights[0], 0.0f);
  EXPECT_EQ(r.weights[1], 0.0f);
}

TEST(Routing, nan_logits_rank_last_with_score_zero) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // NaN counts as -inf: logits (NaN, 0, ln3) pick ids 2, 1 (scores 0.75, 0.5).
  Routed r = route(make_params(3, 2), {nan, 0.0f, kLn3});
  EXPECT_EQ(r.ids, (std::vector<int32_t>{2, 1}));
  EXPECT_NEAR(r.weights[0], 0.6, kTol);
  // With k = 3 the NaN expert comes last with weight 0.
  Routed all = route(make_params(3, 3), {nan, 0.0f, kLn3});
  EXPECT_EQ(all.ids, (std::vector<int32_t>{2, 1, 0}));
  EXPECT_EQ(all.weights[2], 0.0f);
  // Softmax: the NaN logit gets no mass; exp(0, ln3) = (1, 3): scores 0.25, 0.75.
  RoutingParams soft = make_params(3, 2, ScoringFunc::softmax);
  soft.norm_topk_prob = false;
  Routed s = route(soft, {nan, 0.0f, kLn3});
  EXPECT_EQ(s.ids, (std::vector<int32_t>{2, 1}));
  EXPECT_NEAR(s.weights[0], 0.75, kTol);
  EXPECT_NEAR(s.weights[1], 0.25, kTol);
  for (float w : s.weights) EXPECT_FALSE(std::isnan(w));
  // A NaN bias ranks its expert last too: biased (NaN, 0.5, 0.75) picks ids 2, 1 although id 0 scores 0.9.
  Routed b = route(make_params(3, 2), {kLn9, 0.0f, kLn3}, {nan, 0.0f, 0.0f});
  EXPECT_EQ(b.ids, (std::vector<int32_t>{2, 1}));
}

TEST(Routing, rejects_bad_dtypes_and_params) {
  auto backend = detail::make_cpu_backend();
  RoutingParams params = make_params(4, 2);
  HostTensor logits(DType::f32, {1, 4}), ids(DType::i32, {1, 2}), weights(DType::f32, {1, 2}), sums(DType::f32, {1});
  HostTensor bf16_logits(DType::bf16, {1, 4}), f32_ids(DType::f32, {1, 2});
  EXPECT_THROW(backend->route(params, bf16_logits.view(), {}, ids.view(), weights.view(), sums.view()), Error);
  EXPECT_THROW(backend->route(params, logits.view(), {}, f32_ids.view(), weights.view(), sums.view()), Error);
  RoutingParams bad_groups = params;
  bad_groups.n_group = 3;  // does not divide 4
  EXPECT_THROW(backend->route(bad_groups, logits.view(), {}, ids.view(), weights.view(), sums.view()), Error);
  RoutingParams too_many = params;
  too_many.top_k = 5;
  EXPECT_THROW(backend->route(too_many, logits.view(), {}, ids.view(), weights.view(), sums.view()), Error);
}

// --- Cross-check against a slow implementation written from the definition --------------------

float slow_score(ScoringFunc scoring, const float* logits, int64_t count, int64_t i) {
  if (scoring == ScoringFunc::sigmoid)
    return static_cast<float>(1.0 / (1.0 + std::exp(-static_cast<double>(logits[i]))));
  float largest = logits[0];
  for (int64_t j = 1; j < count; ++j) largest = std::max(largest, logits[j]);
  double sum = 0.0;
  for (int64_t j = 0; j < count; ++j) sum += std::exp(static_cast<double>(logits[j]) - largest);
  return static_cast<float>(std::exp(static_cast<double>(logits[i]) - largest) / sum);
}

// Repeated linear-scan argmax: the first maximum wins, so ties go to the lower index.
std::vector<int64_t> slow_top(const std::vector<float>& values, const std::vector<bool>& allowed, int64_t count) {
  std::vector<bool> taken(values.size(), false);
  std::vector<int64_t> picked;
  for (int64_t n = 0; n < count; ++n) {
    int64_t best = -1;
    for (size_t i = 0; i < values.size(); ++i) {
      if (!allowed[i] || taken[i]) continue;
      if (best < 0 || values[i] > values[best]) best = static_cast<int64_t>(i);
    }
    taken[best] = true;
    picked.push_back(best);
  }
  return picked;
}

Routed slow_route(const RoutingParams& p, const std::vector<float>& logits, const std::vector<float>& bias) {
  const int64_t width = p.num_experts + p.num_zero_experts;
  const int64_t num_tokens = static_cast<int64_t>(logits.size()) / width;
  Routed out;
  for (int64_t t = 0; t < num_tokens; ++t) {
    const float* row = logits.data() + t * width;
    std::vector<float> scores(width), biased(width);
    for (int64_t i = 0; i < width; ++i) {
      scores[i] = slow_score(p.scoring, row, width, i);
      biased[i] = bias.empty() ? scores[i] : scores[i] + bias[i];
    }
    std::vector<bool> allowed(width, true);
    if (p.n_group > 1) {
      const int64_t size = width / p.n_group;
      std::vector<float> group_scores;
      for (int64_t g = 0; g < p.n_group; ++g) {
        std::vector<float> members(biased.begin() + g * size, biased.begin() + (g + 1) * size);
        std::sort(members.rbegin(), members.rend());
        group_scores.push_back(size == 1 ? members[0] : members[0] + members[1]);
      }
      std::vector<int64_t> kept = slow_top(group_scores, std::vector<bool>(p.n_group, true), p.topk_group);
      for (int64_t i = 0; i < width; ++i) allowed[i] = std::find(kept.begin(), kept.end(), i / size) != kept.end();
    }
    std::vector<int64_t> chosen = slow_top(biased, allowed, p.top_k);
    double sum = 0.0;
    for (int64_t id : chosen) sum += scores[id];
    double zero_sum = 0.0;
    for (int64_t id : chosen) {
      double w = p.norm_topk_prob ? scores[id] / (sum + 1e-20) : scores[id];
      const float weight = static_cast<float>(w * p.routed_scaling_factor);
      out.ids.push_back(static_cast<int32_t>(id));
      out.weights.push_back(weight);
      if (id >= p.num_experts) zero_sum += weight;
    }
    out.zero_sums.push_back(static_cast<float>(zero_sum));
  }
  return out;
}

TEST(Routing, matches_slow_reference_on_random_logits) {
  struct Case {
    int64_t num_experts, num_zero, top_k, n_group, topk_group;
    ScoringFunc scoring;
    bool with_bias, norm;
    float scale;
  };
  const std::vector<Case> cases = {
      {16, 0, 4, 1, 1, ScoringFunc::sigmoid, true, true, 1.0f},
      {16, 0, 4, 4, 2, ScoringFunc::sigmoid, true, true, 2.5f},
      {12, 4, 3, 4, 3, ScoringFunc::softmax, false, true, 1.0f},
      {12, 4, 3, 4, 3, ScoringFunc::softmax, false, false, 1.0f},
      {8, 0, 8, 1, 1, ScoringFunc::sigmoid, true, false, 1.0f},
      {30, 2, 5, 8, 3, ScoringFunc::sigmoid, true, true, 5.0f},
      {6, 0, 2, 6, 3, ScoringFunc::sigmoid, false, true, 1.0f},
      {64, 8, 6, 8, 4, ScoringFunc::softmax, true, true, 1.0f},
  };
  std::mt19937 rng(1234);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::uniform_int_distribution<int> small_int(-1, 1);
  std::uniform_real_distribution<float> small_bias(-0.3f, 0.3f);
  const int64_t num_tokens = 64;
  for (const Case& c : cases) {
    RoutingParams p = make_params(c.num_experts, c.top_k, c.scoring);
    p.num_zero_experts = c.num_zero;
    p.n_group = c.n_group;
    p.topk_group = c.topk_group;
    p.norm_topk_prob = c.norm;
    p.routed_scaling_factor = c.scale;
    const int64_t width = c.num_experts + c.num_zero;
    // The second half of the tokens has logits in {-1, 0, 1}, so ties (of experts and groups) are common.
    std::vector<float> logits;
    for (int64_t t = 0; t < num_tokens; ++t) {
      for (int64_t i = 0; i < width; ++i) logits.push_back(t < num_tokens / 2 ? normal(rng) : small_int(rng));
    }
    std::vector<float> bias;
    if (c.with_bias) {
      for (int64_t i = 0; i < width; ++i) bias.push_back(i % 3 == 0 ? 0.25f : small_bias(rng));
    }
    SCOPED_TRACE(testing::Message() << "E=" << c.num_experts << " Z=" << c.num_zero << " k=" << c.top_k
                                    << " n_group=" << c.n_group << " topk_group=" << c.topk_group);
    Routed fast = route(p, logits, bias);
    Routed slow = slow_route(p, logits, bias);
    ASSERT_EQ(fast.ids, slow.ids);
    for (size_t i = 0; i < slow.weights.size(); ++i) {
      ASSERT_NEAR(fast.weights[i], slow.weights[i], 1e-6f * std::max(1.0f, std::fabs(slow.weights[i]))) << i;
    }
    for (int64_t t = 0; t < num_tokens; ++t) ASSERT_NEAR(fast.zero_sums[t], slow.zero_sums[t], 1e-6f * c.scale);
    // Deterministic: the same inputs give the same ids and bit-identical weights.
    Routed again = route(p, logits, bias);
    EXPECT_EQ(again.ids, fast.ids);
    EXPECT_EQ(again.weights, fast.weights);
  }
}

}  // namespace
}  // namespace latentmoe

#include "cpu/routing.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "cpu/numeric.h"

namespace latentmoe::detail::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// NaN orders as -inf, so every comparison below is a strict weak order.
float finite_order(float value) { return std::isnan(value) ? kNegInf : value; }

// True when a ranks before b: higher value first, the lower index on a tie.
bool ranks_before(float value_a, int64_t a, float value_b, int64_t b) {
  return value_a > value_b || (value_a == value_b && a < b);
}

struct Scratch {
  std::vector<float> scores;  // unbiased, fp32
  std::vector<float> biased;  // scores + bias in fp32, NaN as -inf
  std::vector<float> group_score;
  std::vector<int64_t> groups;
  std::vector<int64_t> candidates;
  std::vector<double> exps;  // softmax numerators
};

// Scores of one token, each computed in double and rounded once to fp32 (the value an fp32 kernel
// holds). NaN logits count as -inf: score 0, never preferred over a real score.
void compute_scores(ScoringFunc scoring, const float* logits, int64_t count, float* scores, std::vector<double>& exps) {
  if (scoring == ScoringFunc::sigmoid) {
    for (int64_t i = 0; i < count; ++i) {
      const double x = std::isnan(logits[i]) ? -std::numeric_limits<double>::infinity() : logits[i];
      scores[i] = static_cast<float>(1.0 / (1.0 + std::exp(-x)));
    }
    return;
  }
  // Softmax over all E+Z, shifted by the largest logit. All -inf (or NaN): every score 0. Some +inf:
  // the limit, those share the mass equally.
  float largest = kNegInf;
  for (int64_t i = 0; i < count; ++i) largest = std::max(largest, finite_order(logits[i]));
  if (largest == kNegInf) {
    std::fill(scores, scores + count, 0.0f);
    return;
  }
  if (std::isinf(largest)) {
    const auto num_inf = std::count(logits, logits + count, largest);
    for (int64_t i = 0; i < count; ++i) scores[i] = logits[i] == largest ? 1.0f / static_cast<float>(num_inf) : 0.0f;
    return;
  }
  exps.resize(static_cast<size_t>(count));
  double sum = 0.0;
  for (int64_t i = 0; i < count; ++i) {
    exps[i] = std::isnan(logits[i]) ? 0.0 : std::exp(static_cast<double>(logits[i]) - largest);
    sum += exps[i];
  }
  for (int64_t i = 0; i < count; ++i) scores[i] = static_cast<float>(exps[i] / sum);
}

// Keeps the candidate experts of one token: all E+Z ids, or those of the topk_group best groups.
void select_candidates(const RoutingParams& params, Scratch& scratch) {
  const int64_t count = static_cast<int64_t>(scratch.biased.size());
  scratch.candidates.resize(static_cast<size_t>(count));
  std::iota(scratch.candidates.begin(), scratch.candidates.end(), int64_t{0});
  if (params.n_group <= 1) return;

  // A group's score: the fp32 sum of its two highest biased scores (its only one for size 1).
  const int64_t group_size = count / params.n_group;
  const float* biased = scratch.biased.data();
  for (int64_t g = 0; g < params.n_group; ++g) {
    const float* member = biased + g * group_size;
    float first = kNegInf, second = kNegInf;
    for (int64_t i = 0; i < group_size; ++i) {
      if (member[i] > first) {
        second = first;
        first = member[i];
      } else if (member[i] > second) {
        second = member[i];
      }
    }
    const float score = group_size == 1 ? first : first + second;
    scratch.group_score[g] = finite_order(score);  // -inf + inf is NaN: order it last
  }
  auto& groups = scratch.groups;
  std::iota(groups.begin(), groups.end(), int64_t{0});
  const float* group_score = scratch.group_score.data();
  std::partial_sort(groups.begin(), groups.begin() + params.topk_group, groups.end(),
                    [&](int64_t a, int64_t b) { return ranks_before(group_score[a], a, group_score[b], b); });
  // The kept groups' members (their order does not matter: selection uses a total order).
  scratch.candidates.clear();
  for (int64_t i = 0; i < params.topk_group; ++i) {
    for (int64_t e = groups[i] * group_size; e < (groups[i] + 1) * group_size; ++e) scratch.candidates.push_back(e);
  }
}

void check_params(const RoutingParams& params, int64_t num_outputs, int64_t k) {
  LATENTMOE_CHECK(params.num_experts >= 0 && params.num_zero_experts >= 0 && num_outputs >= 1,
                  "routing: invalid expert counts E=", params.num_experts, " Z=", params.num_zero_experts);
  LATENTMOE_CHECK(params.top_k >= 1 && params.top_k <= num_outputs, "routing: top_k ", params.top_k, " is outside 1..",
                  num_outputs);
  LATENTMOE_CHECK(k == params.top_k, "routing: topk_ids has ", k, " columns but top_k is ", params.top_k);
  if (params.n_group > 1) {
    LATENTMOE_CHECK(num_outputs % params.n_group == 0, "routing: n_group ", params.n_group,
                    " does not divide E+Z = ", num_outputs);
    LATENTMOE_CHECK(params.topk_group >= 1 && params.topk_group <= params.n_group, "routing: topk_group ",
                    params.topk_group, " is outside 1..", params.n_group);
    LATENTMOE_CHECK(params.top_k <= params.topk_group * (num_outputs / params.n_group), "routing: top_k ", params.top_k,
                    " exceeds the experts of ", params.topk_group, " groups");
  }
}

}  // namespace

void route(const RoutingParams& params, const TensorView& logits, const TensorView& bias, const TensorView& topk_ids,
           const TensorView& topk_weights, const TensorView& zero_weight_sum) {
  require_dtype(logits.dtype(), DType::f32, "router logits");
  require_dtype(topk_ids.dtype(), DType::i32, "topk_ids");
  require_dtype(topk_weights.dtype(), DType::f32, "topk_weights");
  require_dtype(zero_weight_sum.dtype(), DType::f32, "zero_weight_sum");
  const Matrix logit_rows = as_matrix(logits, "router logits");
  const Matrix id_rows = as_matrix(topk_ids, "topk_ids");
  const Matrix weight_rows = as_matrix(topk_weights, "topk_weights");
  const int64_t num_tokens = logit_rows.rows;
  const int64_t num_outputs = params.num_experts + params.num_zero_experts;
  const int64_t k = id_rows.cols;
  check_params(params, num_outputs, k);
  LATENTMOE_CHECK(logit_rows.cols == num_outputs, "routing: logits have ", logit_rows.cols,
                  " columns, expected E+Z = ", num_outputs);
  LATENTMOE_CHECK(id_rows.rows == num_tokens && weight_rows.rows == num_tokens && weight_rows.cols == k &&
                      zero_weight_sum.numel() == num_tokens,
                  "routing: output shapes do not match ", num_tokens, " tokens and top_k ", k);
  const float* bias_data = nullptr;
  if (bias.defined()) {
    require_dtype(bias.dtype(), DType::f32, "e_score_correction_bias");
    LATENTMOE_CHECK(bias.numel() == num_outputs && bias.is_contiguous(), "routing: bias of shape ", bias.shape_string(),
                    " does not match E+Z = ", num_outputs);
    bias_data = bias.data_as<const float>();
  }

  Scratch scratch;
  scratch.scores.resize(static_cast<size_t>(num_outputs));
  scratch.biased.resize(static_cast<size_t>(num_outputs));
  scratch.group_score.resize(static_cast<size_t>(std::max<int64_t>(params.n_group, 1)));
  scratch.groups.resize(scratch.group_score.size());
  auto* zero_sums = zero_weight_sum.data_as<float>();

  for (int64_t t = 0; t < num_tokens; ++t) {
    const auto* row = static_cast<const float*>(logit_rows.row(t));
    compute_scores(params.scoring, row, num_outputs, scratch.scores.data(), scratch.exps);
    for (int64_t i = 0; i < num_outputs; ++i) {
      const float biased = bias_data ? scratch.scores[i] + bias_data[i] : scratch.scores[i];
      scratch.biased[i] = finite_order(biased);
    }
    select_candidates(params, scratch);

    auto& candidates = scratch.candidates;
    const float* biased = scratch.biased.data();
    std::partial_sort(candidates.begin(), candidates.begin() + k, candidates.end(),
                      [&](int64_t a, int64_t b) { return ranks_before(biased[a], a, biased[b], b); });

    // Weights: the unbiased scores, renormalised in double, scaled, rounded once to fp32.
    double sum = 0.0;
    for (int64_t j = 0; j < k; ++j) sum += scratch.scores[candidates[j]];
    const double denominator = params.norm_topk_prob ? sum + kRenormEpsilon : 1.0;
    auto* ids = static_cast<int32_t*>(id_rows.row(t));
    auto* weights = static_cast<float*>(weight_rows.row(t));
    double zero_sum = 0.0;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t id = candidates[j];
      ids[j] = static_cast<int32_t>(id);
      weights[j] = static_cast<float>(scratch.scores[id] / denominator * params.routed_scaling_factor);
      if (id >= params.num_experts) zero_sum += weights[j];
    }
    zero_sums[t] = static_cast<float>(zero_sum);
  }
}

}  // namespace latentmoe::detail::cpu

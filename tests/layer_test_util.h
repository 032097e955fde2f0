// Shared helpers of the layer tests: small configs of both reference families with odd shapes,
// seeded inputs, and an independent double-precision evaluation of DESIGN section 1 on full weights.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "latentmoe/config.h"
#include "latentmoe/local_group.h"
#include "latentmoe/presets.h"
#include "latentmoe/random.h"
#include "latentmoe/tensor.h"
#include "latentmoe/tier.h"
#include "latentmoe/weights.h"

namespace latentmoe::testing {

// Kimi-K3-like (situ, latent norm, biased sigmoid routing, shared expert). Every size divisible by 8
// (so tp 1/2/4/8 all work) but otherwise odd: I/8 = 3, Is/8 = 5.
inline LayerConfig kimi_like_config() { return resized(kimi_k3_config(), {40, 24, 12, 3, 24, 40}); }

// Nemotron-3-like (relu2, no latent norm, scaling 5), plus 2 zero experts and softmax scoring so
// that the identity experts and the other score function take part in every tail test.
inline LayerConfig nemotron_like_config() {
  LayerConfig config = nemotron3_super_config();
  config.zero_expert_num = 2;
  config.scoring = ScoringFunc::softmax;
  return resized(config, {48, 16, 10, 4, 56, 72});
}

inline HostTensor random_host_tensor(DType dtype, std::vector<int64_t> shape, uint64_t seed, float scale = 1.0f) {
  return random_uniform_tensor(dtype, std::move(shape), seed, scale);
}

inline LocalGroupInputs random_inputs(const LayerConfig& config, int64_t num_tokens, DType dtype, uint64_t seed) {
  LocalGroupInputs inputs;
  inputs.hidden_states = random_host_tensor(dtype, {num_tokens, config.hidden_size}, seed);
  inputs.router_logits = random_host_tensor(DType::f32, {num_tokens, config.num_router_outputs()}, seed + 1, 3.0f);
  return inputs;
}

inline double value_at(const HostTensor& tensor, int64_t index) {
  return load_as_float(tensor.data(), tensor.dtype(), index);
}

// DESIGN section 1 in double on full (tp 1) weights, using the given routing (topk ids and
// weights; routing itself is tested on its own). latent_states, when defined, replaces x W_down^T.
inline std::vector<double> naive_layer(const LayerConfig& config, const LayerWeights& weights, const HostTensor& x,
                                       const HostTensor& topk_ids, const HostTensor& topk_weights,
                                       const HostTensor& latent_states = HostTensor()) {
  const int64_t num_tokens = x.size(0), d = config.hidden_size, l = config.latent_size, k = config.top_k;
  const int64_t inter = config.intermediate_size, shared_inter = config.shared_intermediate_size;
  const double b1 = config.situ_beta, b2 = config.situ_linear_beta;
  auto sigmoid = [](double v) { return 1.0 / (1.0 + std::exp(-v)); };
  auto act = [&](double g, double u) {
    switch (config.activation) {
      case Activation::silu:
        return g * sigmoid(g) * u;
      case Activation::situ:
        return (b1 * std::tanh(g / b1) * sigmoid(g)) * (b2 * std::tanh(u / b2));
      case Activation::relu2:
        return u > 0 ? u * u : 0.0;
    }
    return 0.0;
  };
  std::vector<double> out(static_cast<size_t>(num_tokens * d), 0.0);
  for (int64_t t = 0; t < num_tokens; ++t) {
    std::vector<double> z(l, 0.0), latent(l, 0.0);
    for (int64_t i = 0; i < l; ++i) {
      if (latent_states.defined()) {
        z[i] = value_at(latent_states, t * l + i);
      } else {
        for (int64_t j = 0; j < d; ++j) z[i] += value_at(weights.down_proj, i * d + j) * value_at(x, t * d + j);
      }
    }
    double zero_weight = 0.0;
    for (int64_t slot = 0; slot < k; ++slot) {
      const int32_t expert = topk_ids.data_as<int32_t>()[t * k + slot];
      const double weight = topk_weights.data_as<float>()[t * k + slot];
      if (expert >= config.num_experts) {
        zero_weight += weight;
        continue;
      }
      std::vector<double> a(inter);
      for (int64_t n = 0; n < inter; ++n) {
        double g = 0.0, u = 0.0;
        for (int64_t i = 0; i < l; ++i) {
          const int64_t w_index = (expert * inter + n) * l + i;
          if (config.is_gated()) g += value_at(weights.expert_gate, w_index) * z[i];
          u += value_at(weights.expert_up, w_index) * z[i];
        }
        a[n] = act(g, u);
      }
      for (int64_t i = 0; i < l; ++i) {
        double y = 0.0;
        for (int64_t n = 0; n < inter; ++n) y += value_at(weights.expert_down, (expert * l + i) * inter + n) * a[n];
        latent[i] += weight * y;
      }
    }
    if (config.use_latent_norm) {
      double mean_square = 0.0;
      for (double v : latent) mean_square += v * v / static_cast<double>(l);
      const double scale = 1.0 / std::sqrt(mean_square + config.rms_norm_eps);
      for (int64_t i = 0; i < l; ++i) latent[i] *= scale * value_at(weights.latent_norm, i);
    }
    std::vector<double> shared_a(shared_inter);
    for (int64_t n = 0; n < shared_inter; ++n) {
      double g = 0.0, u = 0.0;
      for (int64_t j = 0; j < d; ++j) {
        if (config.is_gated()) g += value_at(weights.shared_gate, n * d + j) * value_at(x, t * d + j);
        u += value_at(weights.shared_up, n * d + j) * value_at(x, t * d + j);
      }
      shared_a[n] = act(g, u);
    }
    for (int64_t j = 0; j < d; ++j) {
      double routed = 0.0, shared = 0.0;
      for (int64_t i = 0; i < l; ++i) routed += value_at(weights.up_proj, j * l + i) * latent[i];
      for (int64_t n = 0; n < shared_inter; ++n)
        shared += value_at(weights.shared_down, j * shared_inter + n) * shared_a[n];
      out[t * d + j] = routed + shared + zero_weight * value_at(x, t * d + j);
    }
  }
  return out;
}

// max_i |out_i - ref_i| / max_i |ref_i| against a double reference.
inline double max_relative_error_vs(const HostTensor& out, const std::vector<double>& ref) {
  double max_diff = 0.0, max_ref = 0.0;
  for (int64_t i = 0; i < out.numel(); ++i) {
    const double value = value_at(out, i);
    if (std::isnan(value)) return NAN;
    max_diff = std::max(max_diff, std::fabs(value - ref[i]));
    max_ref = std::max(max_ref, std::fabs(ref[i]));
  }
  return max_ref > 0 ? max_diff / max_ref : max_diff;
}

// Every tensor field of LayerWeights, by name.
struct LayerWeightsField {
  const char* name;
  HostTensor LayerWeights::*member;
};
inline constexpr LayerWeightsField kLayerWeightsFields[] = {
    {"gate", &LayerWeights::gate},
    {"score_bias", &LayerWeights::score_bias},
    {"down_proj", &LayerWeights::down_proj},
    {"latent_norm", &LayerWeights::latent_norm},
    {"up_proj", &LayerWeights::up_proj},
    {"expert_gate", &LayerWeights::expert_gate},
    {"expert_up", &LayerWeights::expert_up},
    {"expert_down", &LayerWeights::expert_down},
    {"expert_gate_scale", &LayerWeights::expert_gate_scale},
    {"expert_up_scale", &LayerWeights::expert_up_scale},
    {"expert_down_scale", &LayerWeights::expert_down_scale},
    {"shared_gate", &LayerWeights::shared_gate},
    {"shared_up", &LayerWeights::shared_up},
    {"shared_down", &LayerWeights::shared_down},
};

// Same dtype, expert format, and in every field the same presence, dtype, shape and bytes.
inline void expect_identical(const LayerWeights& actual, const LayerWeights& expected, const std::string& context) {
  EXPECT_EQ(actual.dtype, expected.dtype) << context;
  EXPECT_EQ(actual.experts_format, expected.experts_format) << context;
  for (const LayerWeightsField& field : kLayerWeightsFields) {
    const HostTensor& a = actual.*field.member;
    const HostTensor& b = expected.*field.member;
    ASSERT_EQ(a.defined(), b.defined()) << context << " " << field.name;
    if (!a.defined()) continue;
    ASSERT_EQ(a.dtype(), b.dtype()) << context << " " << field.name;
    ASSERT_EQ(a.shape(), b.shape()) << context << " " << field.name;
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.nbytes()), 0) << context << " " << field.name;
  }
}

// One forward of the schedule that alternates two layers sharing a rank context (layer 0: the
// kimi-like layer, computing its router logits from its gate; layer 1: the nemotron-like layer,
// given them): every tier forced on each layer, then the policy's choice.
struct AlternatingStep {
  int layer;
  int64_t num_tokens;
  std::optional<TailTier> tier;  // nullopt: the policy picks
};

// The schedule, with token counts up to `max_tokens`.
inline std::vector<AlternatingStep> alternating_schedule(int64_t max_tokens) {
  const auto tokens = [max_tokens](int64_t t) { return std::min(t, max_tokens); };
  return {{0, tokens(3), TailTier::native},
          {1, tokens(5), TailTier::tail_fusion},
          {0, tokens(17), TailTier::allreduce_overlap},
          {1, 1, TailTier::column_parallel},
          {0, 1, TailTier::tail_fusion},
          {1, tokens(33), TailTier::native},
          {0, max_tokens, TailTier::column_parallel},
          {1, tokens(7), TailTier::allreduce_overlap},
          {0, 2, std::nullopt},
          {1, max_tokens, std::nullopt}};
}

}  // namespace latentmoe::testing

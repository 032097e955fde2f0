// LayerConfig parsing and validation (the JSON reader is core/json_reader.h, the quantization_config
// core/quantization_config.h). The accepted keys, aliases, types and rules are documented in
// docs/CONFIG.md; keep the two in step.
#include "latentmoe/config.h"

#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "core/bounded_file.h"
#include "core/json_reader.h"
#include "core/quantization_config.h"
#include "latentmoe/error.h"
#include "latentmoe/mxfp4.h"

namespace latentmoe {
namespace {

using nlohmann::json;

// Every size must fit in an int32 so that kernels may index a single dimension with int.
constexpr int64_t kMaxDimension = std::numeric_limits<int32_t>::max();

void check_size(std::string_view key, int64_t value, bool allow_zero) {
  if (allow_zero) {
    LATENTMOE_CHECK(value >= 0, key, " must be >= 0, got ", value);
  } else {
    LATENTMOE_CHECK(value > 0, key, " must be positive, got ", value);
  }
  LATENTMOE_CHECK(value <= kMaxDimension, key, " ", value, " exceeds the limit ", kMaxDimension);
}

void check_positive_finite(std::string_view key, double value) {
  LATENTMOE_CHECK(std::isfinite(value) && value > 0, key, " must be finite and > 0, got ", value);
}

// a * b * ... without overflow; nullopt when the product does not fit in int64.
std::optional<int64_t> checked_product(std::initializer_list<int64_t> factors) {
  int64_t product = 1;
  for (int64_t factor : factors) {
    if (factor != 0 && product > std::numeric_limits<int64_t>::max() / factor) return std::nullopt;
    product *= factor;
  }
  return product;
}

}  // namespace

std::string_view to_string(ExpertWeightFormat format) {
  switch (format) {
    case ExpertWeightFormat::dense:
      return "dense";
    case ExpertWeightFormat::mxfp4:
      return "mxfp4";
  }
  return "unknown";
}

std::string_view to_string(Activation activation) {
  switch (activation) {
    case Activation::silu:
      return "silu";
    case Activation::situ:
      return "situ";
    case Activation::relu2:
      return "relu2";
  }
  return "unknown";
}

std::string_view to_string(ScoringFunc scoring) {
  switch (scoring) {
    case ScoringFunc::sigmoid:
      return "sigmoid";
    case ScoringFunc::softmax:
      return "softmax";
  }
  return "unknown";
}

void LayerConfig::validate() const {
  check_size("hidden_size", hidden_size, false);
  check_size("moe_latent_size", latent_size, false);
  check_size("n_routed_experts", num_experts, false);
  check_size("num_experts_per_tok", top_k, false);
  check_size("moe_intermediate_size", intermediate_size, false);
  check_size("n_shared_experts", num_shared_experts, true);
  check_size("shared_expert_intermediate_size", shared_intermediate_size, true);
  check_size("zero_expert_num", zero_expert_num, true);
  check_size("n_router_outputs (n_routed_experts + zero_expert_num)", num_router_outputs(), false);

  const int64_t num_outputs = num_router_outputs();
  LATENTMOE_CHECK(top_k <= num_outputs, "num_experts_per_tok ", top_k,
                  " exceeds n_routed_experts + zero_expert_num = ", num_outputs);
  LATENTMOE_CHECK(n_group >= 1, "n_group must be positive, got ", n_group);
  LATENTMOE_CHECK(num_outputs % n_group == 0, "n_group ", n_group,
                  " does not divide n_routed_experts + zero_expert_num = ", num_outputs);
  const int64_t group_size = num_outputs / n_group;
  // A group's score is the sum of its best two biased scores (DeepSeek-V3), so a group needs two.
  LATENTMOE_CHECK(n_group == 1 || group_size >= 2, "n_group ", n_group, " leaves ", group_size,
                  " expert per group (n_routed_experts + zero_expert_num = ", num_outputs,
                  "); group-limited routing needs at least 2");
  LATENTMOE_CHECK(topk_group >= 1 && topk_group <= n_group, "topk_group ", topk_group,
                  " is outside [1, n_group = ", n_group, "]");
  LATENTMOE_CHECK(
      top_k <= topk_group * group_size, "num_experts_per_tok ", top_k,
      " exceeds the experts in the kept groups: topk_group * (n_routed_experts + zero_expert_num) / n_group = ",
      topk_group, " * ", num_outputs, " / ", n_group, " = ", topk_group * group_size);

  check_positive_finite("situ_beta", situ_beta);
  check_positive_finite("situ_linear_beta", situ_linear_beta);
  check_positive_finite("routed_scaling_factor", routed_scaling_factor);
  check_positive_finite("rms_norm_eps", rms_norm_eps);

  if (has_mxfp4_experts()) {
    // Packed rows hold whole scale groups: 32 input columns of gate/up (l) and of down (I).
    LATENTMOE_CHECK(latent_size % kMxfp4GroupSize == 0, "MXFP4 experts (quantization_config) need moe_latent_size ",
                    "to be a multiple of the group size ", kMxfp4GroupSize, ", got ", latent_size);
    LATENTMOE_CHECK(intermediate_size % kMxfp4GroupSize == 0,
                    "MXFP4 experts (quantization_config) need moe_intermediate_size to be a multiple of the group ",
                    "size ", kMxfp4GroupSize, ", got ", intermediate_size);
  }

  // The largest weight tensor (all routed experts' projections) must have a countable size.
  LATENTMOE_CHECK(checked_product({num_experts, 3, intermediate_size, latent_size}).has_value(),
                  "n_routed_experts * moe_intermediate_size * moe_latent_size overflows (", num_experts, " * ",
                  intermediate_size, " * ", latent_size, ")");
}

std::string LayerConfig::to_json() const {
  json out = json::object();
  out["hidden_size"] = hidden_size;
  out["moe_latent_size"] = latent_size;
  out["n_routed_experts"] = num_experts;
  out["num_experts_per_tok"] = top_k;
  out["moe_intermediate_size"] = intermediate_size;
  out["n_shared_experts"] = num_shared_experts;
  out["shared_expert_intermediate_size"] = shared_intermediate_size;
  out["hidden_act"] = std::string(to_string(activation));
  out["situ_beta"] = situ_beta;
  out["situ_linear_beta"] = situ_linear_beta;
  out["scoring_func"] = std::string(to_string(scoring));
  out["n_group"] = n_group;
  out["topk_group"] = topk_group;
  out["norm_topk_prob"] = norm_topk_prob;
  out["routed_scaling_factor"] = routed_scaling_factor;
  out["latent_moe_use_norm"] = use_latent_norm;
  out["rms_norm_eps"] = rms_norm_eps;
  out["zero_expert_num"] = zero_expert_num;
  if (has_mxfp4_experts()) out["quantization_config"] = detail::mxfp4_quantization_config();
  return out.dump(2);
}

LayerConfig LayerConfig::from_json(std::string_view json_text, std::string_view source) {
  if (json_text.size() > kMaxConfigBytes) {
    detail::throw_error(source, ": config is larger than ", kMaxConfigBytes >> 20, " MiB (", json_text.size(),
                        " bytes)");
  }
  const json root = detail::parse_json(json_text, source, kMaxConfigDepth);
  if (!root.is_object()) {
    detail::JsonReader(root, source).fail("the top level must be a JSON object, got ", detail::json_type_name(root));
  }
  // A published multimodal config keeps the language model's keys under text_config: read the layer
  // from there when the top level has no hidden_size.
  const json* layer_root = &root;
  std::string layer_source(source);
  if (const json* text_config = detail::json_member(root, "text_config");
      detail::json_member(root, "hidden_size") == nullptr && text_config != nullptr && text_config->is_object()) {
    layer_root = text_config;
    layer_source += ": text_config";
  }
  detail::JsonReader reader(*layer_root, layer_source);

  LayerConfig config;
  config.hidden_size = reader.required_int("hidden_size");
  config.latent_size = reader.required_int("moe_latent_size", "routed_expert_hidden_size");
  config.num_experts = reader.required_int("n_routed_experts", "num_experts");
  config.top_k = reader.required_int("num_experts_per_tok", "num_experts_per_token");
  config.intermediate_size = reader.required_int("moe_intermediate_size");

  const bool shared_count_given = reader.has("n_shared_experts", "num_shared_experts");
  config.num_shared_experts = reader.optional_int("n_shared_experts", "num_shared_experts", 0);
  if (reader.has("shared_expert_intermediate_size", "moe_shared_expert_intermediate_size")) {
    // An explicit width wins over n_shared_experts * I (Qwen2-MoE style configs give only the width).
    config.shared_intermediate_size =
        reader.optional_int("shared_expert_intermediate_size", "moe_shared_expert_intermediate_size", 0);
    if (shared_count_given && config.num_shared_experts == 0 && config.shared_intermediate_size > 0) {
      reader.fail("n_shared_experts is 0 but shared_expert_intermediate_size is ", config.shared_intermediate_size,
                  "; set n_shared_experts > 0 or the width to 0");
    }
    if (!shared_count_given) config.num_shared_experts = config.shared_intermediate_size > 0 ? 1 : 0;
  } else {
    auto product = checked_product({config.num_shared_experts, config.intermediate_size});
    if (!product.has_value() || config.num_shared_experts < 0 || config.intermediate_size < 0) {
      // Out-of-range inputs: leave the product alone and let validate() name the bad key.
      config.shared_intermediate_size = 0;
    } else {
      config.shared_intermediate_size = *product;
    }
  }

  const std::string act = reader.required_string("hidden_act");
  if (act == "silu") {
    config.activation = Activation::silu;
  } else if (act == "situ") {
    config.activation = Activation::situ;
  } else if (act == "relu2") {
    config.activation = Activation::relu2;
  } else {
    reader.fail("unknown hidden_act '", act, "'; accepted: silu, situ, relu2");
  }
  config.situ_beta = reader.optional_double("situ_beta", config.situ_beta);
  config.situ_linear_beta = reader.optional_double("situ_linear_beta", config.situ_linear_beta);

  if (auto scoring = reader.optional_string("scoring_func")) {
    if (*scoring == "sigmoid") {
      config.scoring = ScoringFunc::sigmoid;
    } else if (*scoring == "softmax") {
      config.scoring = ScoringFunc::softmax;
    } else {
      reader.fail("unknown scoring_func '", *scoring, "'; accepted: sigmoid, softmax");
    }
  }
  config.n_group = reader.optional_int("n_group", {}, config.n_group);
  config.topk_group = reader.optional_int("topk_group", {}, config.topk_group);
  config.norm_topk_prob = reader.optional_bool("norm_topk_prob", "moe_renormalize", config.norm_topk_prob);
  config.routed_scaling_factor = reader.optional_double("routed_scaling_factor", config.routed_scaling_factor);
  config.use_latent_norm = reader.optional_bool("latent_moe_use_norm", {}, config.use_latent_norm);
  config.rms_norm_eps = reader.optional_double("rms_norm_eps", config.rms_norm_eps);
  config.zero_expert_num = reader.optional_int("zero_expert_num", {}, config.zero_expert_num);

  // quantization_config: at the top level, else beside the layer keys (text_config).
  const json* quantization = nullptr;
  std::string_view quantization_source = source;
  for (const json* object : {static_cast<const json*>(&root), layer_root}) {
    const json* found = detail::json_member(*object, "quantization_config");
    if (quantization != nullptr || found == nullptr) continue;
    quantization = found;
    if (object == layer_root) quantization_source = layer_source;
  }
  if (quantization != nullptr) {
    config.experts_format = detail::experts_format(*quantization, quantization_source, config.is_gated());
  }

  try {
    config.validate();
  } catch (const Error& error) {
    reader.fail(error);
  }
  return config;
}

LayerConfig LayerConfig::from_file(const std::string& path) {
  return from_json(detail::read_bounded_file(path, kMaxConfigBytes, "config file"), path);
}

void validate_parallel(const LayerConfig& config, const ParallelConfig& parallel) {
  LATENTMOE_CHECK(parallel.tp_size >= 1, "tp must be >= 1, got ", parallel.tp_size);
  LATENTMOE_CHECK(parallel.rank >= 0 && parallel.rank < parallel.tp_size, "rank ", parallel.rank,
                  " is outside [0, tp = ", parallel.tp_size, ")");
  const int64_t tp = parallel.tp_size;
  auto check_divides = [tp](std::string_view key, int64_t size) {
    LATENTMOE_CHECK(size % tp == 0, "tp ", tp, " does not divide ", key, " ", size);
  };
  check_divides("hidden_size", config.hidden_size);
  check_divides("moe_latent_size", config.latent_size);
  check_divides("moe_intermediate_size", config.intermediate_size);
  if (config.has_shared_expert()) check_divides("shared_expert_intermediate_size", config.shared_intermediate_size);
  if (config.has_mxfp4_experts()) {
    const int64_t rank_i = config.intermediate_size / tp;
    LATENTMOE_CHECK(rank_i % kMxfp4GroupSize == 0, "tp ", tp, ": MXFP4 experts need moe_intermediate_size / tp ",
                    "to be a multiple of the group size ", kMxfp4GroupSize,
                    " (a rank's slice of a packed row must not split a scale group); moe_intermediate_size ",
                    config.intermediate_size, " / tp ", tp, " = ", rank_i);
  }
}

}  // namespace latentmoe

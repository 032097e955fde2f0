// The layer configuration (DESIGN section 3): parsed from a Hugging Face style JSON config,
// aliases accepted, unknown keys ignored, every missing or inconsistent key reported by name.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "latentmoe/parallel.h"

namespace latentmoe {

// Limits on a config's text (docs/RELIABILITY.md): from_json / from_file refuse a larger text, and
// JSON nested deeper (arrays and objects together) before parsing it; a key given twice in one
// object is an error too.
inline constexpr size_t kMaxConfigBytes = size_t{16} << 20;  // 16 MiB
inline constexpr int kMaxConfigDepth = 64;

enum class Activation { silu, situ, relu2 };
enum class ScoringFunc { sigmoid, softmax };
// How the routed experts' weights are stored: dense (F32/BF16/F16, converted to the compute dtype at
// load) or MXFP4 (compressed-tensors mxfp4-pack-quantized, declared by the config's
// quantization_config; latentmoe/mxfp4.h). The router, latent projections, norm and shared expert
// are always dense.
enum class ExpertWeightFormat { dense, mxfp4 };

std::string_view to_string(Activation activation);
std::string_view to_string(ScoringFunc scoring);
std::string_view to_string(ExpertWeightFormat format);

struct LayerConfig {
  int64_t hidden_size = 0;                   // d         (hidden_size)
  int64_t latent_size = 0;                   // l         (moe_latent_size | routed_expert_hidden_size)
  int64_t num_experts = 0;                   // E         (n_routed_experts | num_experts)
  int64_t top_k = 0;                         // k         (num_experts_per_tok | num_experts_per_token)
  int64_t intermediate_size = 0;             // I         (moe_intermediate_size)
  int64_t num_shared_experts = 0;            //           (n_shared_experts | num_shared_experts)
  int64_t shared_intermediate_size = 0;      // Is        (shared_expert_intermediate_size | moe_shared_...)
  Activation activation = Activation::silu;  //    (hidden_act)
  double situ_beta = 4.0;
  double situ_linear_beta = 25.0;
  ScoringFunc scoring = ScoringFunc::sigmoid;  // (scoring_func)
  int64_t n_group = 1;
  int64_t topk_group = 1;
  bool norm_topk_prob = true;  // (norm_topk_prob | moe_renormalize)
  double routed_scaling_factor = 1.0;
  bool use_latent_norm = false;  // (latent_moe_use_norm)
  double rms_norm_eps = 1e-5;
  int64_t zero_expert_num = 0;  // Z
  // (quantization_config: mxfp4 when it covers the routed experts; docs/CONFIG.md section 1)
  ExpertWeightFormat experts_format = ExpertWeightFormat::dense;

  bool has_shared_expert() const { return shared_intermediate_size > 0; }
  bool is_gated() const { return activation != Activation::relu2; }
  // E + Z: the width of the router logits.
  int64_t num_router_outputs() const { return num_experts + zero_expert_num; }
  bool has_mxfp4_experts() const { return experts_format == ExpertWeightFormat::mxfp4; }

  // Throws Error naming the first inconsistent key (by its JSON name).
  void validate() const;

  // The config as a JSON object with the primary key names (docs/CONFIG.md); from_json() of the
  // result gives back an equal config.
  std::string to_json() const;

  bool operator==(const LayerConfig&) const = default;

  // Parses JSON text and validates the result; `source` names it in error messages (a path, say).
  // The rules (types, aliases, defaults, null) are in docs/CONFIG.md.
  static LayerConfig from_json(std::string_view json_text, std::string_view source = "config");
  static LayerConfig from_file(const std::string& path);
};

// Throws unless the parallel layout is possible for this layer: 1 <= tp, 0 <= rank < tp, and tp
// divides d, l, I and (when there is a shared expert) Is; with MXFP4 experts also I / tp a multiple
// of 32, so that no rank's slice splits a scale group.
void validate_parallel(const LayerConfig& config, const ParallelConfig& parallel);

}  // namespace latentmoe

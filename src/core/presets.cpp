#include "latentmoe/presets.h"

#include "latentmoe/error.h"

namespace latentmoe {

LayerConfig kimi_k3_config() {
  LayerConfig config;
  config.hidden_size = 7168;
  config.latent_size = 3584;
  config.num_experts = 896;
  config.top_k = 16;
  config.intermediate_size = 3072;
  config.num_shared_experts = 1;
  config.shared_intermediate_size = 6144;
  config.activation = Activation::situ;
  config.scoring = ScoringFunc::sigmoid;
  config.norm_topk_prob = true;
  config.routed_scaling_factor = 1.0;
  config.use_latent_norm = true;
  config.rms_norm_eps = 1e-5;
  return config;
}

LayerConfig nemotron3_super_config() {
  LayerConfig config;
  config.hidden_size = 4096;
  config.latent_size = 1024;
  config.num_experts = 512;
  config.top_k = 22;
  config.intermediate_size = 2688;
  config.num_shared_experts = 1;
  config.shared_intermediate_size = 5376;
  config.activation = Activation::relu2;
  config.scoring = ScoringFunc::sigmoid;
  config.norm_topk_prob = true;
  config.routed_scaling_factor = 5.0;
  config.use_latent_norm = false;
  return config;
}

LayerConfig preset_config(std::string_view name) {
  if (name == "kimi-k3") return kimi_k3_config();
  if (name == "nemotron3-super") return nemotron3_super_config();
  detail::throw_error("unknown preset '", name, "' (expected kimi-k3 or nemotron3-super)");
}

LayerConfig resized(const LayerConfig& config, const LayerSizes& sizes) {
  LayerConfig result = config;
  result.hidden_size = sizes.hidden_size;
  result.latent_size = sizes.latent_size;
  result.num_experts = sizes.num_experts;
  result.top_k = sizes.top_k;
  result.intermediate_size = sizes.intermediate_size;
  result.shared_intermediate_size = sizes.shared_intermediate_size;
  result.num_shared_experts = sizes.shared_intermediate_size > 0 ? 1 : 0;
  result.validate();
  return result;
}

}  // namespace latentmoe

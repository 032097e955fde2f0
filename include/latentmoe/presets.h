// The reference shapes of DESIGN section 5, and scaled-down models with the same structure (the
// demo and the tests use those: same activation, routing, norm and scaling, small sizes).
#pragma once

#include <string_view>

#include "latentmoe/config.h"

namespace latentmoe {

// kimi-k3: d 7168, l 3584, E 896, k 16, I 3072, Is 6144, situ, latent norm, sigmoid + bias, scaling 1.
LayerConfig kimi_k3_config();
// nemotron3-super: d 4096, l 1024, E 512, k 22, I 2688, Is 5376, relu2, no latent norm, scaling 5.
LayerConfig nemotron3_super_config();
// "kimi-k3" or "nemotron3-super"; throws Error naming the accepted names otherwise.
LayerConfig preset_config(std::string_view name);

// `config` with new sizes (everything else kept), validated.
struct LayerSizes {
  int64_t hidden_size, latent_size, num_experts, top_k, intermediate_size, shared_intermediate_size;
};
LayerConfig resized(const LayerConfig& config, const LayerSizes& sizes);

}  // namespace latentmoe

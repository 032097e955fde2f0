#include "tool_common.h"

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <utility>

#include "latentmoe/error.h"
#include "latentmoe/presets.h"

namespace latentmoe::tools {

LayerConfig scaled_down(const LayerConfig& config, int scale, std::string_view label) {
  LATENTMOE_CHECK(scale >= 1, "--scale ", scale, " is not a positive integer");
  if (scale == 1) return config;
  const std::pair<const char*, int64_t> sizes[] = {{"hidden_size", config.hidden_size},
                                                   {"latent_size", config.latent_size},
                                                   {"num_experts", config.num_experts},
                                                   {"intermediate_size", config.intermediate_size},
                                                   {"shared_intermediate_size", config.shared_intermediate_size}};
  for (const auto& [name, size] : sizes) {
    LATENTMOE_CHECK(size % scale == 0, "--scale ", scale, " does not divide ", name, " ", size, " of ", label);
  }
  const int64_t experts = config.num_experts / scale;
  return resized(config,
                 {config.hidden_size / scale, config.latent_size / scale, experts, std::min(config.top_k, experts),
                  config.intermediate_size / scale, config.shared_intermediate_size / scale});
}

std::string cpu_model() {
  std::string model;
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; model.empty() && std::getline(cpuinfo, line);) {
    if (line.rfind("model name", 0) == 0 && line.find(':') != std::string::npos) {
      model = line.substr(line.find(':') + 1);
      model.erase(0, model.find_first_not_of(" \t"));
    }
  }
  return model.empty() ? "CPU" : model;
}

}  // namespace latentmoe::tools

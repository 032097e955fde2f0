#pragma once

#include <string>

namespace latentmoe::tools {

// "latentmoe 0.1.0 (backends: cpu, cuda)"
inline std::string version_string() {
  std::string text = std::string("latentmoe ") + LATENTMOE_VERSION + " (backends: cpu";
#ifdef LATENTMOE_WITH_CUDA
  text += ", cuda";
#endif
  return text + ")";
}

}  // namespace latentmoe::tools

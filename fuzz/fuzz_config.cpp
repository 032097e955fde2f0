// libFuzzer target: the config parser. Any input either parses into a config that validates, or
// throws latentmoe::Error; nothing else (a crash, another exception, a leak, a hang) is allowed.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "latentmoe/config.h"
#include "latentmoe/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const latentmoe::LayerConfig config =
        latentmoe::LayerConfig::from_json(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz");
    config.validate();
    (void)latentmoe::LayerConfig::from_json(config.to_json(), "round trip");  // what it writes, it reads
  } catch (const latentmoe::Error&) {
  }
  return 0;
}

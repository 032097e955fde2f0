// libFuzzer target: the JSON files a user hands over, the layer config and the tune table (both read
// from the same bytes). Any input either parses (a config that then validates, a table whose policy
// lookups answer) or throws latentmoe::Error; nothing else (a crash, another exception, a leak, a
// hang) is allowed.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "latentmoe/config.h"
#include "latentmoe/error.h"
#include "latentmoe/tune.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const latentmoe::LayerConfig config =
        latentmoe::LayerConfig::from_json(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz");
    config.validate();
    (void)latentmoe::LayerConfig::from_json(config.to_json(), "round trip");  // what it writes, it reads
  } catch (const latentmoe::Error&) {
  }
  try {
    const latentmoe::TuneTable table =
        latentmoe::TuneTable::from_json(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz");
    for (const latentmoe::TuneEntry& entry : table.entries) {  // each entry's own key, and one no entry has
      (void)table.find(entry.tp_size, entry.dtype.value_or(latentmoe::DType::bf16), entry.hidden_size.value_or(64),
                       entry.latent_size.value_or(32));
    }
    (void)table.find(3, latentmoe::DType::f16, 7, 5);
    (void)latentmoe::TuneTable::from_json(table.to_json(), "round trip");
  } catch (const latentmoe::Error&) {
  }
  return 0;
}

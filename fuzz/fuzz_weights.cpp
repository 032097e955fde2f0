// libFuzzer target: the weight loader on two tiny layers (dense experts, and MXFP4 experts under the
// Kimi K3 names), each at tp 1 and as rank 1 of tp 2, converting to bf16. Any file either loads
// weights that validate or throws latentmoe::Error.
#include <cstddef>
#include <cstdint>

#include "fuzz_common.h"
#include "latentmoe/error.h"
#include "latentmoe/safetensors.h"
#include "latentmoe/weights.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const latentmoe::LayerConfig configs[] = {latentmoe::fuzz::tiny_config(),
                                                   latentmoe::fuzz::tiny_mxfp4_config()};
  try {
    const latentmoe::SafetensorsFile file = latentmoe::SafetensorsFile::open(latentmoe::fuzz::scratch_file(data, size));
    for (const latentmoe::LayerConfig& config : configs) {
      for (const latentmoe::ParallelConfig parallel : {latentmoe::ParallelConfig{1, 0, false}, {2, 1, false}}) {
        try {
          const latentmoe::LayerWeights weights =
              latentmoe::load_layer_weights(file, config, "", parallel, latentmoe::DType::bf16);
          latentmoe::validate_layer_weights(weights, config, parallel.tp_size);
        } catch (const latentmoe::Error&) {  // this layout refused: the next one still runs
        }
      }
    }
  } catch (const latentmoe::Error&) {
  }
  return 0;
}

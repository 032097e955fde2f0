// libFuzzer target: the safetensors reader. Any file either opens (every entry then reads) or
// throws latentmoe::Error.
#include <cstddef>
#include <cstdint>

#include "fuzz_common.h"
#include "latentmoe/error.h"
#include "latentmoe/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const latentmoe::SafetensorsFile file = latentmoe::SafetensorsFile::open(latentmoe::fuzz::scratch_file(data, size));
    for (const latentmoe::SafetensorsEntry& entry : file.entries()) (void)file.read(entry.name);
  } catch (const latentmoe::Error&) {
  }
  return 0;
}

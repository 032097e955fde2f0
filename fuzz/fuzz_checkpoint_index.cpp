// libFuzzer target: a sharded checkpoint's index (model.safetensors.index.json) from arbitrary
// bytes, opened as a folder and looked up. The folder also holds one valid shard, "a.safetensors"
// (tensor "x"), so that an index naming it reaches the shard-opening path. Any input either opens
// and answers look-ups or throws latentmoe::Error; no look-up may open a file outside the folder.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>

#include "latentmoe/checkpoint.h"
#include "latentmoe/error.h"
#include "latentmoe/safetensors.h"
#include "latentmoe/tensor.h"

namespace {

// This process's checkpoint folder (under the temporary directory), made once with the valid shard in
// it, and removed when the fuzzer exits normally (at the end of -max_total_time or -runs).
class ScratchFolder {
 public:
  ScratchFolder()
      : path_(std::filesystem::temp_directory_path() / ("latentmoe_fuzz_index_" + std::to_string(::getpid()))) {
    std::filesystem::create_directories(path_);
    latentmoe::HostTensor x(latentmoe::DType::f32, {2, 3});
    latentmoe::write_safetensors((path_ / "a.safetensors").string(), {{"x", x.view()}});
  }
  ~ScratchFolder() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

const std::filesystem::path& folder() {
  static const ScratchFolder scratch;
  return scratch.path();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string index = (folder() / "model.safetensors.index.json").string();
  std::FILE* file = std::fopen(index.c_str(), "wb");
  if (file == nullptr) __builtin_trap();
  if (size > 0 && std::fwrite(data, 1, size, file) != size) __builtin_trap();
  std::fclose(file);
  try {
    const latentmoe::Checkpoint checkpoint = latentmoe::Checkpoint::open(folder().string());
    int looked_up = 0;
    for (const std::string& name : checkpoint.names("")) {
      if (++looked_up > 16) break;  // bounded work per input
      try {
        if (const latentmoe::SafetensorsEntry* entry = checkpoint.find(name)) (void)checkpoint.read(entry->name);
      } catch (const latentmoe::Error&) {  // a missing or broken shard: the next name still runs
      }
    }
  } catch (const latentmoe::Error&) {
  }
  return 0;
}

// latentmoe inspect FILE: the tensors of a safetensors file (name, dtype, shape, bytes) and its metadata.
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>

#include "commands.h"
#include "latentmoe/safetensors.h"

namespace latentmoe::tools {

void register_inspect_command(CLI::App& app) {
  auto path = std::make_shared<std::string>();
  CLI::App* command = app.add_subcommand("inspect", "List the tensors of a safetensors file");
  command->add_option("file", *path, "The safetensors file")->required();
  command->callback([path] {
    const SafetensorsFile file = SafetensorsFile::open(*path);
    uint64_t total_bytes = 0;
    size_t name_width = 4;
    for (const auto& entry : file.entries()) name_width = std::max(name_width, entry.name.size());
    std::printf("%-*s  %-7s  %-24s  %s\n", static_cast<int>(name_width), "name", "dtype", "shape", "bytes");
    for (const auto& entry : file.entries()) {
      const std::string shape = shape_string(entry.shape);
      const uint64_t bytes = entry.end - entry.begin;
      total_bytes += bytes;
      std::printf("%-*s  %-7s  %-24s  %llu\n", static_cast<int>(name_width), entry.name.c_str(),
                  std::string(dtype_name(entry.dtype)).c_str(), shape.c_str(), static_cast<unsigned long long>(bytes));
    }
    std::printf("# %zu tensors, %llu bytes\n", file.entries().size(), static_cast<unsigned long long>(total_bytes));
    for (const auto& [key, value] : file.metadata()) std::printf("# metadata %s = %s\n", key.c_str(), value.c_str());
  });
}

}  // namespace latentmoe::tools

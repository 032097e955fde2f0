// latentmoe inspect PATH [--prefix P]: the tensors of a safetensors file (name, dtype, shape, bytes)
// and its metadata; for a sharded checkpoint (a folder or its index), a summary of the index (no
// shard is opened) or, with --prefix, the tensors under the prefix and the shards holding them.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <set>
#include <string>

#include "commands.h"
#include "latentmoe/checkpoint.h"
#include "latentmoe/safetensors.h"

namespace latentmoe::tools {
namespace {

struct InspectArguments {
  std::string path, prefix;
};

void print_metadata(const std::map<std::string, std::string>& metadata) {
  for (const auto& [key, value] : metadata) std::printf("# metadata %s = %s\n", key.c_str(), value.c_str());
}

void inspect_file(const SafetensorsFile& file, const std::string& prefix) {
  std::vector<const SafetensorsEntry*> listed;
  for (const auto& entry : file.entries()) {
    if (entry.name.compare(0, prefix.size(), prefix) == 0) listed.push_back(&entry);
  }
  uint64_t total_bytes = 0;
  size_t name_width = 4;
  for (const auto* entry : listed) name_width = std::max(name_width, entry->name.size());
  std::printf("%-*s  %-7s  %-24s  %s\n", static_cast<int>(name_width), "name", "dtype", "shape", "bytes");
  for (const auto* entry : listed) {
    const std::string shape = shape_string(entry->shape);
    const uint64_t bytes = entry->end - entry->begin;
    total_bytes += bytes;
    std::printf("%-*s  %-7s  %-24s  %llu\n", static_cast<int>(name_width), entry->name.c_str(),
                std::string(dtype_name(entry->dtype)).c_str(), shape.c_str(), static_cast<unsigned long long>(bytes));
  }
  std::printf("# %zu tensors, %llu bytes\n", listed.size(), static_cast<unsigned long long>(total_bytes));
  print_metadata(file.metadata());
}

// The index alone: how many tensors, in which shards.
void inspect_index_summary(const Checkpoint& checkpoint) {
  const std::vector<std::string> shards = checkpoint.shard_names();
  std::printf("# %s: %zu tensors in %zu shards\n", checkpoint.index_path().c_str(), checkpoint.size(), shards.size());
  size_t name_width = 5;
  for (const auto& shard : shards) name_width = std::max(name_width, shard.size());
  std::printf("%-*s  %s\n", static_cast<int>(name_width), "shard", "tensors");
  for (const auto& shard : shards) {
    std::printf("%-*s  %zu\n", static_cast<int>(name_width), shard.c_str(), checkpoint.tensor_count_in_shard(shard));
  }
  print_metadata(checkpoint.metadata());
}

// The tensors under `prefix`, read from the shards that hold them (only those are opened). Every
// look-up is done before anything is printed, so a bad shard leaves only the error line.
void inspect_index_prefix(const Checkpoint& checkpoint, const std::string& prefix) {
  struct Row {
    const std::string* name;
    const SafetensorsEntry* entry;
    const std::string* shard;
  };
  const std::vector<std::string> names = checkpoint.names(prefix);
  std::vector<Row> rows;
  std::set<std::string> used_shards;
  size_t name_width = 4;
  for (const auto& name : names) {
    rows.push_back({&name, &checkpoint.at(name), &checkpoint.shard_of(name)});
    used_shards.insert(*rows.back().shard);
    name_width = std::max(name_width, name.size());
  }
  std::printf("%-*s  %-7s  %-24s  %-12s  %s\n", static_cast<int>(name_width), "name", "dtype", "shape", "bytes",
              "shard");
  uint64_t total_bytes = 0;
  for (const Row& row : rows) {
    const uint64_t bytes = row.entry->end - row.entry->begin;
    total_bytes += bytes;
    std::printf("%-*s  %-7s  %-24s  %-12llu  %s\n", static_cast<int>(name_width), row.name->c_str(),
                std::string(dtype_name(row.entry->dtype)).c_str(), shape_string(row.entry->shape).c_str(),
                static_cast<unsigned long long>(bytes), row.shard->c_str());
  }
  std::printf("# %zu tensors under prefix %s, %llu bytes, in %zu of %zu shards\n", rows.size(), prefix.c_str(),
              static_cast<unsigned long long>(total_bytes), used_shards.size(), checkpoint.shard_names().size());
}

}  // namespace

void register_inspect_command(CLI::App& app) {
  auto args = std::make_shared<InspectArguments>();
  CLI::App* command = app.add_subcommand("inspect", "List the tensors of a safetensors file or a sharded checkpoint");
  command->add_option("file", args->path, "A safetensors file, a checkpoint folder or its model.safetensors.index.json")
      ->required();
  command->add_option("--prefix", args->prefix, "List only the tensors whose names start with this");
  command->callback([args] {
    const Checkpoint checkpoint = Checkpoint::open(args->path);
    if (const SafetensorsFile* file = checkpoint.single_file()) {
      inspect_file(*file, args->prefix);
    } else if (args->prefix.empty()) {
      inspect_index_summary(checkpoint);
    } else {
      inspect_index_prefix(checkpoint, args->prefix);
    }
  });
}

}  // namespace latentmoe::tools

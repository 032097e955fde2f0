// Writes Hugging Face style sharded checkpoints for tests: safetensors shards plus
// model.safetensors.index.json ({"metadata": {"total_size": N}, "weight_map": {name: shard}}).
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "latentmoe/safetensors.h"
#include "latentmoe/tensor.h"

namespace latentmoe::testing {

inline std::string shard_file_name(int shard, int num_shards) {
  char name[64];
  std::snprintf(name, sizeof(name), "model-%05d-of-%05d.safetensors", shard + 1, num_shards);
  return name;
}

// Writes the index for `weight_map` (tensor name -> shard file name) to `path`.
inline void write_index(const std::filesystem::path& path,
                        const std::vector<std::pair<std::string, std::string>>& weight_map, uint64_t total_size = 0) {
  nlohmann::ordered_json index;
  index["metadata"] = {{"total_size", total_size}};
  index["weight_map"] = nlohmann::ordered_json::object();
  for (const auto& [name, shard] : weight_map) index["weight_map"][name] = shard;
  std::ofstream(path) << index.dump(2);
}

// Writes `tensors` over `num_shards` files in `folder` (tensor i in shard i % num_shards) and the
// index; returns the index path.
inline std::string write_sharded_checkpoint(const std::filesystem::path& folder,
                                            const std::vector<std::pair<std::string, HostTensor>>& tensors,
                                            int num_shards) {
  std::filesystem::create_directories(folder);
  std::vector<std::vector<std::pair<std::string, TensorView>>> shards(num_shards);
  std::vector<std::pair<std::string, std::string>> weight_map;
  uint64_t total_size = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const int shard = static_cast<int>(i % num_shards);
    shards[shard].emplace_back(tensors[i].first, tensors[i].second.view());
    weight_map.emplace_back(tensors[i].first, shard_file_name(shard, num_shards));
    total_size += tensors[i].second.nbytes();
  }
  for (int shard = 0; shard < num_shards; ++shard) {
    write_safetensors((folder / shard_file_name(shard, num_shards)).string(), shards[shard], {{"format", "pt"}});
  }
  const std::filesystem::path index = folder / "model.safetensors.index.json";
  write_index(index, weight_map, total_size);
  return index.string();
}

// Every tensor of one safetensors file, read into memory (for re-writing it sharded).
inline std::vector<std::pair<std::string, HostTensor>> read_all_tensors(const std::string& path) {
  const SafetensorsFile file = SafetensorsFile::open(path);
  std::vector<std::pair<std::string, HostTensor>> tensors;
  for (const auto& entry : file.entries()) tensors.emplace_back(entry.name, file.read(entry.name));
  return tensors;
}

}  // namespace latentmoe::testing

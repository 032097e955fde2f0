// A model's weights as published: one safetensors file, or a Hugging Face sharded checkpoint (a
// folder of safetensors shards and model.safetensors.index.json mapping every tensor name to the
// shard that holds it). Shards are memory-mapped lazily, only when a tensor they hold is asked for.
//
// Index format: {"metadata": {...}, "weight_map": {"tensor name": "shard file name", ...}}; other
// top-level keys are ignored. docs/FILES.md ("Sharded checkpoints") gives the rules and limits.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "latentmoe/safetensors.h"
#include "latentmoe/tensor.h"

namespace latentmoe {

// The largest index JSON read (bytes). A real index of 10^5+ tensors is about 10 MB.
inline constexpr uint64_t kMaxCheckpointIndexBytes = uint64_t{64} << 20;
// The deepest nesting accepted in an index (the top-level object counts 1). A valid index needs 2
// (the object, weight_map); the third level lets metadata hold a list.
inline constexpr size_t kMaxCheckpointIndexDepth = 3;
// The most tensors an index may list (bounds memory: a 64 MiB index of tiny names could otherwise
// list 8 million). The largest published checkpoints list about 10^5.
inline constexpr size_t kMaxCheckpointTensors = 4'000'000;

// One tensor of a checkpoint: its entry (dtype, shape, offsets inside its shard) and the open shard.
struct CheckpointTensor {
  const SafetensorsEntry* entry = nullptr;
  const SafetensorsFile* file = nullptr;  // the shard holding it (valid while the Checkpoint lives)

  const std::byte* bytes() const { return file->bytes(*entry); }  // inside the mapping; may be unaligned
  const std::string& path() const { return file->path(); }        // the shard, for error messages
};

class Checkpoint {
 public:
  // `path` is one of:
  //  - a safetensors file (anything that is not a directory and does not end in ".json"),
  //  - a folder: its model.safetensors.index.json when present; else its one *.safetensors file
  //    (names starting with '.' are ignored); none or several is an Error listing what was found,
  //  - an index JSON (a path ending in ".json"); shard names resolve against its folder.
  // The index is read whole and checked (regular file, size, depth, duplicate names, value types,
  // shard names); no shard is opened here. Every error is "<path>: <problem>".
  static Checkpoint open(const std::string& path);

  // Wraps an opened file: owning it, or (view) borrowing one that must outlive the Checkpoint.
  explicit Checkpoint(SafetensorsFile file);
  static Checkpoint view(const SafetensorsFile& file);

  Checkpoint(Checkpoint&&) noexcept;
  Checkpoint& operator=(Checkpoint&&) noexcept;
  ~Checkpoint();

  // As given to open (the file, folder or index); for a wrapped file, the file's path.
  const std::string& path() const;
  bool is_sharded() const;
  // The index read (empty for a single file).
  const std::string& index_path() const;
  // The single safetensors file; nullptr when sharded.
  const SafetensorsFile* single_file() const;
  // The index's "metadata" scalars as text (strings verbatim, numbers and literals as written);
  // for a single file, its __metadata__.
  const std::map<std::string, std::string>& metadata() const;

  // Names, counts and shards, from the index alone (no shard is opened).
  size_t size() const;                                                 // tensors
  std::vector<std::string> names(std::string_view prefix = "") const;  // sorted, those starting with prefix
  bool contains(std::string_view name) const;
  // Shard file names as the index spells them, sorted (a single file: its path).
  std::vector<std::string> shard_names() const;
  // The shard name `name` is mapped to (a single file: its path); Error when not in the checkpoint.
  const std::string& shard_of(std::string_view name) const;
  size_t tensor_count_in_shard(std::string_view shard_name) const;

  // Look-ups open the shard holding the tensor on first need (thread-safe) and keep it open for
  // the Checkpoint's lifetime. A name the index does not list is nullopt / nullptr. Errors: the
  // shard cannot be opened or is invalid ("<index>: shard \"s\" (holding tensor \"t\"): <why>"),
  // or does not hold the tensor ("<index>: tensor \"t\" is mapped to shard \"s\", which has no
  // tensor of that name"). A tensor a shard holds but the index maps elsewhere is never seen.
  std::optional<CheckpointTensor> tensor(std::string_view name) const;

  // The same, shaped like SafetensorsFile's (so code written for one file reads a checkpoint):
  const SafetensorsEntry* find(std::string_view name) const;  // nullptr when absent
  const SafetensorsEntry& at(std::string_view name) const;    // Error "<path>: no tensor named <name>"
  // Bytes of an entry returned by find/at/tensor of this checkpoint (Error for any other entry).
  const std::byte* bytes(const SafetensorsEntry& entry) const;
  // The path of the file holding an entry of this checkpoint (for error messages).
  const std::string& file_path(const SafetensorsEntry& entry) const;
  // A copy in a new aligned host tensor, as SafetensorsFile::read.
  HostTensor read(std::string_view name) const;

  // Shards opened so far (a single file counts 1).
  size_t open_shard_count() const;
  // Opens every shard and checks that each holds every tensor mapped to it; the first problem
  // throws as a look-up would. Optional: look-ups check what they touch.
  void verify() const;

 private:
  struct State;
  explicit Checkpoint(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace latentmoe

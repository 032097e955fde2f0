#include "latentmoe/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <new>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>

#include "core/bounded_file.h"
#include "latentmoe/error.h"

namespace latentmoe {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kIndexFileName = "model.safetensors.index.json";
constexpr const char* kShardNameRule = "shard names must be relative paths that stay inside the checkpoint folder";

std::string errno_text(int error) { return std::strerror(error); }

bool ends_with(std::string_view text, std::string_view suffix) {
  return text.size() >= suffix.size() && text.substr(text.size() - suffix.size()) == suffix;
}

// Why `name` may not name a shard, or nullptr. The rules are lexical: no absolute path, no "..",
// so a hostile index cannot point outside the folder by name. (Symlinks inside the folder are
// followed: a Hugging Face cache snapshot is a folder of symlinks into ../../blobs.)
const char* shard_name_problem(std::string_view name) {
  if (name.empty()) return "is empty";
  if (name.find('\0') != std::string_view::npos) return "contains a NUL byte";
  if (name.front() == '/') return "is an absolute path";
  size_t begin = 0;
  while (true) {
    const size_t slash = name.find('/', begin);
    const std::string_view part = name.substr(begin, slash == std::string_view::npos ? slash : slash - begin);
    if (part.empty()) return "has an empty path component";
    if (part == "..") return "has a \"..\" component";
    if (part == ".") return "has a \".\" component";
    if (slash == std::string_view::npos) return nullptr;
    begin = slash + 1;
  }
}

// The index as read: tensor name -> shard number, and the shards by name.
struct ParsedIndex {
  std::vector<std::pair<std::string, uint32_t>> tensors;  // sorted by name once parsed
  std::vector<std::string> shard_names;                   // by shard number (first-listed order)
  std::map<std::string, uint32_t, std::less<>> shard_ids;
  std::map<std::string, std::string> metadata;
};

// Reads the index from the JSON parser's SAX events (no document is built): nesting deeper than
// kMaxCheckpointIndexDepth is refused before the deeper level is read, every weight_map value must
// be a string naming an acceptable shard, and the first problem throws "<path>: <problem>".
// Duplicate tensor names are found afterwards by one sort, so the whole read is O(n log n).
class IndexReader {
 public:
  IndexReader(const std::string& path, ParsedIndex& index) : path_(path), index_(index) {}

  bool null() { return scalar("null", false); }
  bool boolean(bool value) { return scalar(value ? "true" : "false", false); }
  bool number_integer(json::number_integer_t value) { return scalar(std::to_string(value), false); }
  bool number_unsigned(json::number_unsigned_t value) { return scalar(std::to_string(value), false); }
  bool number_float(json::number_float_t /*value*/, const json::string_t& text) { return scalar(text, false); }
  bool string(json::string_t& value) { return scalar(value, true); }
  bool binary(json::binary_t& /*value*/) { return scalar("", false); }

  bool start_object(std::size_t /*size*/) { return open(/*is_object=*/true); }
  bool start_array(std::size_t /*size*/) { return open(/*is_object=*/false); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }

  bool key(json::string_t& key) {
    if (depth_ == 1) {
      LATENTMOE_CHECK(top_keys_.insert(key).second, path_, ": duplicate key \"", key, "\"");
      section_ = key == "weight_map" ? Section::weight_map : key == "metadata" ? Section::metadata : Section::other;
    } else if (depth_ == 2 && section_ == Section::metadata) {
      LATENTMOE_CHECK(metadata_keys_.insert(key).second, path_, ": duplicate key \"", key, "\" in metadata");
      key_ = std::move(key);
    } else if (depth_ == 2 && section_ == Section::weight_map) {
      key_ = std::move(key);  // duplicates are found by the sort afterwards
    }
    return true;
  }

  bool parse_error(std::size_t /*position*/, const std::string& /*last_token*/, const json::exception& error) {
    detail::throw_error(path_, ": index is not valid JSON: ", error.what());
  }

  bool saw_weight_map() const { return top_keys_.count("weight_map") > 0; }

 private:
  enum class Section { other, metadata, weight_map };

  bool open(bool is_object) {
    if (depth_ >= kMaxCheckpointIndexDepth) {
      detail::throw_error(path_, ": index is nested more than ", kMaxCheckpointIndexDepth,
                          " levels deep (an index needs 2)");
    }
    ++depth_;
    if (depth_ == 1) {
      LATENTMOE_CHECK(is_object, path_, ": index is not a JSON object");
    } else if (depth_ == 2) {
      LATENTMOE_CHECK(is_object || section_ != Section::weight_map, path_, ": weight_map is not a JSON object");
      LATENTMOE_CHECK(is_object || section_ != Section::metadata, path_, ": metadata is not a JSON object");
    } else if (depth_ == 3) {
      LATENTMOE_CHECK(section_ != Section::weight_map, path_, ": weight_map value of \"", key_,
                      "\" is not a string (a shard file name)");
      // A list or object in metadata (or elsewhere) is allowed and not kept.
    }
    return true;
  }

  bool close() {
    --depth_;
    return true;
  }

  bool scalar(const std::string& text, bool is_string) {
    switch (depth_) {
      case 0:
        detail::throw_error(path_, ": index is not a JSON object");
      case 1:
        LATENTMOE_CHECK(section_ != Section::weight_map, path_, ": weight_map is not a JSON object");
        LATENTMOE_CHECK(section_ != Section::metadata, path_, ": metadata is not a JSON object");
        return true;
      case 2:
        if (section_ == Section::weight_map) {
          LATENTMOE_CHECK(is_string, path_, ": weight_map value of \"", key_, "\" is not a string (a shard file name)");
          add_tensor(text);
        } else if (section_ == Section::metadata) {
          index_.metadata.emplace(std::move(key_), text);
        }
        return true;
      default:
        return true;
    }
  }

  void add_tensor(const std::string& shard) {
    LATENTMOE_CHECK(index_.tensors.size() < kMaxCheckpointTensors, path_, ": weight_map lists more than ",
                    kMaxCheckpointTensors, " tensors");
    auto found = index_.shard_ids.find(shard);
    if (found == index_.shard_ids.end()) {
      if (const char* problem = shard_name_problem(shard)) {
        detail::throw_error(path_, ": weight_map value of \"", key_, "\": shard name \"", shard, "\" ", problem, "; ",
                            kShardNameRule);
      }
      found = index_.shard_ids.emplace(shard, static_cast<uint32_t>(index_.shard_names.size())).first;
      index_.shard_names.push_back(shard);
    }
    index_.tensors.emplace_back(std::move(key_), found->second);
  }

  const std::string& path_;
  ParsedIndex& index_;
  size_t depth_ = 0;  // containers open (the index object is depth 1)
  Section section_ = Section::other;
  std::string key_;  // the current key inside weight_map or metadata
  std::set<std::string> top_keys_;
  std::set<std::string> metadata_keys_;
};

ParsedIndex parse_index(const std::string& path, const std::string& text) {
  ParsedIndex index;
  // nlohmann would take a NUL byte for the end of the input; the index must be JSON throughout.
  if (const void* nul = std::memchr(text.data(), 0, text.size())) {
    detail::throw_error(path, ": index is not valid JSON: NUL byte at offset ",
                        static_cast<const char*>(nul) - text.data());
  }
  IndexReader reader(path, index);
  // Every problem throws from inside; false would only mean a handler declined, which none does.
  LATENTMOE_CHECK(json::sax_parse(text.begin(), text.end(), &reader), path, ": index is not valid JSON");
  LATENTMOE_CHECK(reader.saw_weight_map(), path, ": index has no \"weight_map\"");

  std::sort(index.tensors.begin(), index.tensors.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  const auto duplicate = std::adjacent_find(index.tensors.begin(), index.tensors.end(),
                                            [](const auto& a, const auto& b) { return a.first == b.first; });
  LATENTMOE_CHECK(duplicate == index.tensors.end(), path, ": weight_map lists tensor \"",
                  duplicate == index.tensors.end() ? std::string() : duplicate->first, "\" twice");
  return index;
}

}  // namespace

struct Checkpoint::State {
  std::string path;        // the safetensors file or the index read
  std::string index_path;  // empty for a single file
  std::map<std::string, std::string> metadata;

  // A single file (owned or borrowed).
  std::unique_ptr<SafetensorsFile> owned;
  const SafetensorsFile* single = nullptr;

  // A sharded checkpoint.
  struct Shard {
    std::string name;  // as the index spells it
    std::string path;  // resolved against the index's folder
    size_t tensor_count = 0;
    std::unique_ptr<SafetensorsFile> file;  // opened on first need, then kept
  };
  std::vector<std::pair<std::string, uint32_t>> tensors;  // sorted by name
  std::vector<Shard> shards;                              // by shard number
  std::map<std::string, uint32_t, std::less<>> shard_ids;
  std::mutex mutex;  // guards opening shards

  const std::pair<std::string, uint32_t>* lookup(std::string_view name) const {
    auto found = std::lower_bound(tensors.begin(), tensors.end(), name,
                                  [](const auto& slot, std::string_view key) { return slot.first < key; });
    return found != tensors.end() && found->first == name ? &*found : nullptr;
  }

  // The shard, opened if need be; `tensor` names what it was opened for in an error.
  const SafetensorsFile& shard_file(uint32_t id, std::string_view tensor) {
    std::lock_guard<std::mutex> lock(mutex);
    Shard& shard = shards[id];
    if (!shard.file) {
      try {
        shard.file = std::make_unique<SafetensorsFile>(SafetensorsFile::open(shard.path));
      } catch (const Error& error) {
        detail::throw_error(index_path, ": shard \"", shard.name, "\" (holding tensor \"", tensor, "\"): ", error);
      }
    }
    return *shard.file;
  }

  size_t open_count() {
    std::lock_guard<std::mutex> lock(mutex);
    return static_cast<size_t>(
        std::count_if(shards.begin(), shards.end(), [](const Shard& shard) { return shard.file != nullptr; }));
  }
};

Checkpoint::Checkpoint(std::unique_ptr<State> state) : state_(std::move(state)) {}
Checkpoint::Checkpoint(Checkpoint&&) noexcept = default;
Checkpoint& Checkpoint::operator=(Checkpoint&&) noexcept = default;
Checkpoint::~Checkpoint() = default;

Checkpoint::Checkpoint(SafetensorsFile file) : state_(std::make_unique<State>()) {
  state_->owned = std::make_unique<SafetensorsFile>(std::move(file));
  state_->single = state_->owned.get();
  state_->path = state_->single->path();
  state_->metadata = state_->single->metadata();
}

Checkpoint Checkpoint::view(const SafetensorsFile& file) {
  auto state = std::make_unique<State>();
  state->single = &file;
  state->path = file.path();
  state->metadata = file.metadata();
  return Checkpoint(std::move(state));
}

Checkpoint Checkpoint::open(const std::string& path) {
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0) detail::throw_error(path, ": cannot open: ", errno_text(errno));

  std::string index_path;
  if (S_ISDIR(info.st_mode)) {
    const std::string candidate = (fs::path(path) / kIndexFileName).string();
    // lstat: an index that exists in any form (a FIFO, a dangling symlink) is used and then refused
    // with its own error, never silently replaced by the folder's safetensors file.
    struct stat index_info {};
    if (::lstat(candidate.c_str(), &index_info) == 0) {
      index_path = candidate;
    } else if (errno != ENOENT) {
      detail::throw_error(candidate, ": cannot open: ", errno_text(errno));
    } else {
      // No index: the folder's one safetensors file.
      std::vector<std::string> found;
      std::error_code error;
      fs::directory_iterator entries(path, error);
      if (error) detail::throw_error(path, ": cannot list the folder: ", error.message());
      for (; entries != fs::directory_iterator(); entries.increment(error)) {
        if (error) detail::throw_error(path, ": cannot list the folder: ", error.message());
        const std::string name = entries->path().filename().string();
        if (!name.empty() && name.front() != '.' && ends_with(name, ".safetensors")) found.push_back(name);
      }
      if (error) detail::throw_error(path, ": cannot list the folder: ", error.message());
      std::sort(found.begin(), found.end());
      LATENTMOE_CHECK(!found.empty(), path, ": no ", kIndexFileName, " and no .safetensors file in this folder");
      if (found.size() > 1) {
        std::string listed;
        for (size_t i = 0; i < found.size() && i < 4; ++i) listed += (i > 0 ? ", " : "") + found[i];
        if (found.size() > 4) listed += ", ...";
        detail::throw_error(path, ": no ", kIndexFileName, " and ", found.size(), " .safetensors files (", listed,
                            "); name one file or the index");
      }
      return Checkpoint(SafetensorsFile::open((fs::path(path) / found.front()).string()));
    }
  } else if (ends_with(path, ".json")) {
    index_path = path;
  } else {
    return Checkpoint(SafetensorsFile::open(path));
  }

  auto state = std::make_unique<State>();
  state->path = index_path;
  state->index_path = index_path;
  const std::string text = detail::read_bounded_file(index_path, kMaxCheckpointIndexBytes, "index");
  ParsedIndex index;
  try {
    index = parse_index(index_path, text);
  } catch (const std::bad_alloc&) {
    detail::throw_error(index_path, ": out of memory while reading the ", text.size(), "-byte index");
  }
  const fs::path folder = fs::path(index_path).parent_path();
  state->shards.resize(index.shard_names.size());
  for (size_t id = 0; id < index.shard_names.size(); ++id) {
    state->shards[id].name = index.shard_names[id];
    state->shards[id].path = (folder / index.shard_names[id]).string();
  }
  for (const auto& [name, id] : index.tensors) ++state->shards[id].tensor_count;
  state->tensors = std::move(index.tensors);
  state->shard_ids = std::move(index.shard_ids);
  state->metadata = std::move(index.metadata);
  return Checkpoint(std::move(state));
}

const std::string& Checkpoint::path() const { return state_->path; }

bool Checkpoint::is_sharded() const { return state_->single == nullptr; }

const std::string& Checkpoint::index_path() const { return state_->index_path; }

const SafetensorsFile* Checkpoint::single_file() const { return state_->single; }

const std::map<std::string, std::string>& Checkpoint::metadata() const { return state_->metadata; }

size_t Checkpoint::size() const {
  return state_->single != nullptr ? state_->single->entries().size() : state_->tensors.size();
}

std::vector<std::string> Checkpoint::names(std::string_view prefix) const {
  std::vector<std::string> result;
  if (const SafetensorsFile* file = state_->single) {
    for (const SafetensorsEntry& entry : file->entries()) {
      if (entry.name.compare(0, prefix.size(), prefix) == 0) result.push_back(entry.name);
    }
    std::sort(result.begin(), result.end());
    return result;
  }
  auto it = std::lower_bound(state_->tensors.begin(), state_->tensors.end(), prefix,
                             [](const auto& slot, std::string_view key) { return slot.first < key; });
  for (; it != state_->tensors.end() && it->first.compare(0, prefix.size(), prefix) == 0; ++it) {
    result.push_back(it->first);
  }
  return result;
}

bool Checkpoint::contains(std::string_view name) const {
  if (const SafetensorsFile* file = state_->single) return file->find(name) != nullptr;
  return state_->lookup(name) != nullptr;
}

std::vector<std::string> Checkpoint::shard_names() const {
  if (state_->single != nullptr) return {state_->single->path()};
  std::vector<std::string> result;
  for (const auto& [name, id] : state_->shard_ids) result.push_back(name);
  return result;
}

const std::string& Checkpoint::shard_of(std::string_view name) const {
  if (const SafetensorsFile* file = state_->single) {
    LATENTMOE_CHECK(file->find(name) != nullptr, state_->path, ": no tensor named ", name);
    return file->path();
  }
  const auto* slot = state_->lookup(name);
  LATENTMOE_CHECK(slot != nullptr, state_->path, ": no tensor named ", name);
  return state_->shards[slot->second].name;
}

size_t Checkpoint::tensor_count_in_shard(std::string_view shard_name) const {
  if (const SafetensorsFile* file = state_->single) {
    return shard_name == file->path() ? file->entries().size() : 0;
  }
  auto found = state_->shard_ids.find(shard_name);
  return found == state_->shard_ids.end() ? 0 : state_->shards[found->second].tensor_count;
}

std::optional<CheckpointTensor> Checkpoint::tensor(std::string_view name) const {
  if (const SafetensorsFile* file = state_->single) {
    const SafetensorsEntry* entry = file->find(name);
    if (entry == nullptr) return std::nullopt;
    return CheckpointTensor{entry, file};
  }
  const auto* slot = state_->lookup(name);
  if (slot == nullptr) return std::nullopt;
  const SafetensorsFile& file = state_->shard_file(slot->second, name);
  const SafetensorsEntry* entry = file.find(name);
  LATENTMOE_CHECK(entry != nullptr, state_->index_path, ": tensor \"", name, "\" is mapped to shard \"",
                  state_->shards[slot->second].name, "\", which has no tensor of that name");
  return CheckpointTensor{entry, &file};
}

const SafetensorsEntry* Checkpoint::find(std::string_view name) const {
  const std::optional<CheckpointTensor> found = tensor(name);
  return found ? found->entry : nullptr;
}

const SafetensorsEntry& Checkpoint::at(std::string_view name) const {
  const SafetensorsEntry* entry = find(name);
  LATENTMOE_CHECK(entry != nullptr, state_->path, ": no tensor named ", name);
  return *entry;
}

const std::byte* Checkpoint::bytes(const SafetensorsEntry& entry) const {
  // The entry must be the one this checkpoint hands out for its name: an entry of another file has
  // offsets that mean nothing here.
  const std::optional<CheckpointTensor> found = tensor(entry.name);
  LATENTMOE_CHECK(found && found->entry == &entry, state_->path, ": tensor \"", entry.name,
                  "\" is not an entry of this checkpoint");
  return found->bytes();
}

const std::string& Checkpoint::file_path(const SafetensorsEntry& entry) const {
  const std::optional<CheckpointTensor> found = tensor(entry.name);
  LATENTMOE_CHECK(found && found->entry == &entry, state_->path, ": tensor \"", entry.name,
                  "\" is not an entry of this checkpoint");
  return found->path();
}

HostTensor Checkpoint::read(std::string_view name) const {
  if (const SafetensorsFile* file = state_->single) return file->read(name);
  const std::optional<CheckpointTensor> found = tensor(name);
  LATENTMOE_CHECK(found.has_value(), state_->path, ": no tensor named ", name);
  return found->file->read(name);
}

size_t Checkpoint::open_shard_count() const { return state_->single != nullptr ? 1 : state_->open_count(); }

void Checkpoint::verify() const {
  if (state_->single != nullptr) return;
  for (const auto& [name, id] : state_->tensors) (void)tensor(name);
}

}  // namespace latentmoe

#include "latentmoe/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <utility>

#include "latentmoe/error.h"

namespace latentmoe {
namespace {

using nlohmann::json;

// The reference implementation refuses headers above 100 MB; so do we, before allocating anything.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
constexpr const char* kMetadataKey = "__metadata__";

std::string errno_text(int error) { return std::strerror(error); }

// A non-negative JSON integer that fits in uint64 (nlohmann parses "-0" as a signed zero).
std::optional<uint64_t> as_non_negative_integer(const json& value) {
  if (value.is_number_unsigned()) return value.get<uint64_t>();
  if (value.is_number_integer()) {
    int64_t signed_value = value.get<int64_t>();
    if (signed_value >= 0) return static_cast<uint64_t>(signed_value);
  }
  return std::nullopt;
}

// Remembers the first key that occurs twice in one JSON object, at any depth: nlohmann keeps the
// last value silently, which would let two different tensors hide behind one name.
class DuplicateKeyFinder {
 public:
  bool operator()(int /*depth*/, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start:
        open_keys_.emplace_back();
        break;
      case json::parse_event_t::object_end:
        if (!open_keys_.empty()) open_keys_.pop_back();
        break;
      case json::parse_event_t::key: {
        const std::string& key = parsed.get_ref<const std::string&>();
        if (open_keys_.size() == 1) current_top_key_ = key;
        if (!open_keys_.empty() && !open_keys_.back().insert(key).second && !duplicate_) {
          duplicate_ = open_keys_.size() == 1 ? "duplicate tensor name \"" + key + "\""
                                              : "duplicate field \"" + key + "\" in \"" + current_top_key_ + "\"";
        }
        break;
      }
      default:
        break;
    }
    return true;
  }
  const std::optional<std::string>& duplicate() const { return duplicate_; }

 private:
  std::vector<std::set<std::string>> open_keys_;
  std::string current_top_key_;
  std::optional<std::string> duplicate_;
};

SafetensorsEntry parse_entry(const std::string& path, const std::string& name, const json& value) {
  LATENTMOE_CHECK(value.is_object(), path, ": tensor \"", name, "\": entry is not a JSON object");
  for (const auto& [key, field] : value.items()) {
    LATENTMOE_CHECK(key == "dtype" || key == "shape" || key == "data_offsets", path, ": tensor \"", name,
                    "\": unexpected field \"", key, "\"");
  }
  for (const char* key : {"dtype", "shape", "data_offsets"}) {
    LATENTMOE_CHECK(value.contains(key), path, ": tensor \"", name, "\": missing field \"", key, "\"");
  }

  SafetensorsEntry entry;
  entry.name = name;
  const json& dtype = value.at("dtype");
  LATENTMOE_CHECK(dtype.is_string(), path, ": tensor \"", name, "\": dtype is not a string");
  auto parsed_dtype = parse_dtype(dtype.get_ref<const std::string&>());
  LATENTMOE_CHECK(parsed_dtype.has_value(), path, ": tensor \"", name, "\": unknown dtype \"",
                  dtype.get_ref<const std::string&>(), "\"");
  entry.dtype = *parsed_dtype;

  const json& shape = value.at("shape");
  LATENTMOE_CHECK(shape.is_array(), path, ": tensor \"", name, "\": shape is not an array");
  uint64_t numel = 1;
  bool numel_overflow = false;
  for (const json& extent : shape) {
    auto dim = as_non_negative_integer(extent);
    // (Never dump() the offending value: a deeply nested array would recurse.)
    LATENTMOE_CHECK(dim.has_value() && *dim <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()), path,
                    ": tensor \"", name, "\": shape element ", entry.shape.size(),
                    " is not a non-negative integer (shape must be a list of them)");
    entry.shape.push_back(static_cast<int64_t>(*dim));
    // Checked as we go, like the reference reader: a huge extent overflows even next to a zero.
    if (__builtin_mul_overflow(numel, *dim, &numel)) numel_overflow = true;
  }
  uint64_t nbytes = 0;
  LATENTMOE_CHECK(!numel_overflow && !__builtin_mul_overflow(numel, dtype_size(entry.dtype), &nbytes), path,
                  ": tensor \"", name, "\": shape ", shape_string(entry.shape), " is too large (size overflows)");

  const json& offsets = value.at("data_offsets");
  LATENTMOE_CHECK(offsets.is_array() && offsets.size() == 2, path, ": tensor \"", name,
                  "\": data_offsets is not an array of two integers");
  auto begin = as_non_negative_integer(offsets[0]);
  auto end = as_non_negative_integer(offsets[1]);
  LATENTMOE_CHECK(begin.has_value() && end.has_value(), path, ": tensor \"", name,
                  "\": data_offsets are not non-negative integers");
  LATENTMOE_CHECK(*begin <= *end, path, ": tensor \"", name, "\": data_offsets [", *begin, ", ", *end,
                  "] begin after end");
  entry.begin = *begin;
  entry.end = *end;
  LATENTMOE_CHECK(entry.end - entry.begin == nbytes, path, ": tensor \"", name, "\": ", dtype_name(entry.dtype),
                  " shape ", shape_string(entry.shape), " needs ", nbytes, " bytes but data_offsets [", entry.begin,
                  ", ", entry.end, "] span ", entry.end - entry.begin);
  return entry;
}

// Closes a file descriptor on every path out of a scope.
struct FdGuard {
  int fd = -1;
  ~FdGuard() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

struct SafetensorsFile::State {
  std::string path;
  void* mapping = nullptr;  // the whole file, read-only; nullptr only for a moved-from state
  size_t mapping_size = 0;
  const std::byte* data = nullptr;  // start of the data section inside the mapping
  uint64_t data_size = 0;
  std::vector<SafetensorsEntry> entries;
  std::map<std::string, size_t, std::less<>> index;  // name -> position in entries
  std::map<std::string, std::string> metadata;

  State() = default;
  State(const State&) = delete;
  State& operator=(const State&) = delete;
  ~State() {
    if (mapping != nullptr) ::munmap(mapping, mapping_size);
  }
};

SafetensorsFile::SafetensorsFile(std::unique_ptr<State> state) : state_(std::move(state)) {}
SafetensorsFile::SafetensorsFile(SafetensorsFile&&) noexcept = default;
SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&&) noexcept = default;
SafetensorsFile::~SafetensorsFile() = default;

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  auto state = std::make_unique<State>();
  state->path = path;

  FdGuard file{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  if (file.fd < 0) detail::throw_error(path, ": cannot open: ", errno_text(errno));
  struct stat info {};
  if (::fstat(file.fd, &info) != 0) detail::throw_error(path, ": cannot stat: ", errno_text(errno));
  LATENTMOE_CHECK(S_ISREG(info.st_mode), path, ": not a regular file");
  const uint64_t file_size = static_cast<uint64_t>(info.st_size);
  LATENTMOE_CHECK(file_size >= 8, path, ": file is ", file_size, " bytes, shorter than the 8-byte header length");

  void* mapping = ::mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, file.fd, 0);
  if (mapping == MAP_FAILED) detail::throw_error(path, ": cannot map: ", errno_text(errno));
  state->mapping = mapping;
  state->mapping_size = file_size;
  const auto* bytes = static_cast<const unsigned char*>(mapping);

  uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i) header_size = (header_size << 8) | bytes[i];  // little-endian
  LATENTMOE_CHECK(header_size <= kMaxHeaderBytes, path, ": header length ", header_size, " exceeds the limit of ",
                  kMaxHeaderBytes, " bytes");
  LATENTMOE_CHECK(header_size <= file_size - 8, path, ": header length ", header_size, " runs past the end of the ",
                  file_size, "-byte file");
  state->data = reinterpret_cast<const std::byte*>(bytes + 8 + header_size);
  state->data_size = file_size - 8 - header_size;

  const char* header_begin = reinterpret_cast<const char*>(bytes + 8);
  // nlohmann stops at a NUL byte as if the input ended there; the header must be JSON throughout.
  if (const void* nul = std::memchr(header_begin, 0, header_size)) {
    detail::throw_error(path, ": header is not valid JSON: NUL byte at header offset ",
                        static_cast<const char*>(nul) - header_begin);
  }
  DuplicateKeyFinder duplicates;
  json header;
  try {
    header = json::parse(header_begin, header_begin + header_size, std::ref(duplicates));
  } catch (const json::exception& error) {
    detail::throw_error(path, ": header is not valid JSON: ", error.what());
  }
  if (duplicates.duplicate()) detail::throw_error(path, ": ", *duplicates.duplicate());
  LATENTMOE_CHECK(header.is_object(), path, ": header is not a JSON object");

  for (const auto& [name, value] : header.items()) {
    if (name == kMetadataKey) {
      LATENTMOE_CHECK(value.is_object(), path, ": __metadata__ is not a JSON object");
      for (const auto& [key, text] : value.items()) {
        LATENTMOE_CHECK(text.is_string(), path, ": __metadata__ value of \"", key, "\" is not a string");
        state->metadata.emplace(key, text.get<std::string>());
      }
      continue;
    }
    SafetensorsEntry entry = parse_entry(path, name, value);
    LATENTMOE_CHECK(entry.end <= state->data_size, path, ": tensor \"", name, "\": data_offsets [", entry.begin, ", ",
                    entry.end, "] run past the data section (", state->data_size, " bytes)");
    state->entries.push_back(std::move(entry));
  }

  // The entries must tile the data section exactly: no overlap, no hole, nothing after the last.
  std::sort(state->entries.begin(), state->entries.end(), [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  uint64_t covered = 0;
  const SafetensorsEntry* previous = nullptr;
  for (const SafetensorsEntry& entry : state->entries) {
    if (entry.begin < covered) {
      detail::throw_error(path, ": tensor \"", entry.name, "\" (bytes [", entry.begin, ", ", entry.end,
                          ")) overlaps tensor \"", previous->name, "\" (bytes [", previous->begin, ", ", previous->end,
                          "))");
    }
    LATENTMOE_CHECK(entry.begin == covered, path, ": data section has a hole: bytes [", covered, ", ", entry.begin,
                    ") before tensor \"", entry.name, "\" belong to no tensor");
    covered = entry.end;
    previous = &entry;
  }
  LATENTMOE_CHECK(covered == state->data_size, path, ": data section has ", state->data_size - covered,
                  " bytes after the last tensor that belong to no tensor");

  for (size_t i = 0; i < state->entries.size(); ++i) state->index.emplace(state->entries[i].name, i);
  return SafetensorsFile(std::move(state));
}

const std::string& SafetensorsFile::path() const { return state_->path; }

const std::vector<SafetensorsEntry>& SafetensorsFile::entries() const { return state_->entries; }

const std::map<std::string, std::string>& SafetensorsFile::metadata() const { return state_->metadata; }

const SafetensorsEntry* SafetensorsFile::find(std::string_view name) const {
  auto found = state_->index.find(name);
  return found == state_->index.end() ? nullptr : &state_->entries[found->second];
}

const SafetensorsEntry& SafetensorsFile::at(std::string_view name) const {
  const SafetensorsEntry* entry = find(name);
  LATENTMOE_CHECK(entry != nullptr, state_->path, ": no tensor named ", name);
  return *entry;
}

const std::byte* SafetensorsFile::bytes(const SafetensorsEntry& entry) const {
  // An entry of another file could point anywhere; refuse anything outside this data section.
  LATENTMOE_CHECK(entry.begin <= entry.end && entry.end <= state_->data_size, state_->path, ": tensor \"", entry.name,
                  "\" is not inside this file's data section");
  return state_->data + entry.begin;
}

HostTensor SafetensorsFile::read(std::string_view name) const {
  const SafetensorsEntry& entry = at(name);
  // A 0-d tensor (shape []) becomes a HostTensor of shape [] holding one element.
  HostTensor result(entry.dtype, entry.shape);
  LATENTMOE_CHECK(result.nbytes() == entry.end - entry.begin, state_->path, ": tensor \"", entry.name,
                  "\" size mismatch");
  if (result.nbytes() > 0) std::memcpy(result.data(), bytes(entry), result.nbytes());
  return result;
}

// --- writer ------------------------------------------------------------------------------------

namespace {

// Writes through a file descriptor, retrying short writes and EINTR; buffers small pieces.
class FileWriter {
 public:
  FileWriter(int fd, std::string path) : fd_(fd), path_(std::move(path)) { buffer_.reserve(kBufferBytes); }

  void write(const void* data, size_t size) {
    const auto* bytes = static_cast<const char*>(data);
    if (buffer_.size() + size > kBufferBytes) flush();
    if (size >= kBufferBytes) {
      write_through(bytes, size);
    } else {
      buffer_.insert(buffer_.end(), bytes, bytes + size);
    }
  }

  void flush() {
    write_through(buffer_.data(), buffer_.size());
    buffer_.clear();
  }

 private:
  static constexpr size_t kBufferBytes = size_t{1} << 20;

  void write_through(const char* bytes, size_t size) {
    while (size > 0) {
      ssize_t written = ::write(fd_, bytes, size);
      if (written < 0 && errno == EINTR) continue;
      if (written <= 0) detail::throw_error(path_, ": write failed: ", errno_text(written < 0 ? errno : EIO));
      bytes += written;
      size -= static_cast<size_t>(written);
    }
  }

  int fd_;
  std::string path_;
  std::vector<char> buffer_;
};

// Writes a view's elements in row-major order, whatever its strides.
void write_view(FileWriter& writer, const TensorView& view) {
  const int64_t numel = view.numel();
  if (numel == 0) return;
  const size_t element = dtype_size(view.dtype());
  if (view.is_contiguous()) {
    writer.write(view.data(), static_cast<size_t>(numel) * element);
    return;
  }
  const int rank = view.rank();
  const int64_t row_length = view.size(rank - 1);
  const int64_t num_rows = numel / row_length;
  std::array<int64_t, TensorView::kMaxRank> index{};
  const auto* base = static_cast<const std::byte*>(view.data());
  for (int64_t row = 0; row < num_rows; ++row) {
    int64_t offset = 0;
    for (int dim = 0; dim < rank - 1; ++dim) offset += index[dim] * view.stride(dim);
    const int64_t column_stride = view.stride(rank - 1);
    if (column_stride == 1) {
      writer.write(base + offset * static_cast<int64_t>(element), static_cast<size_t>(row_length) * element);
    } else {
      for (int64_t column = 0; column < row_length; ++column) {
        writer.write(base + (offset + column * column_stride) * static_cast<int64_t>(element), element);
      }
    }
    for (int dim = rank - 2; dim >= 0; --dim) {
      if (++index[dim] < view.size(dim)) break;
      index[dim] = 0;
    }
  }
}

// Removes the temporary file unless the write got as far as renaming it into place.
struct TempFileGuard {
  std::string path;
  int fd = -1;
  bool committed = false;
  ~TempFileGuard() {
    if (fd >= 0) ::close(fd);
    if (!committed && !path.empty()) ::unlink(path.c_str());
  }
};

}  // namespace

void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, TensorView>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  // Everything is checked before the temporary file exists.
  std::set<std::string_view> names;
  for (const auto& [name, view] : tensors) {
    LATENTMOE_CHECK(name != kMetadataKey, path, ": a tensor cannot be named ", kMetadataKey);
    LATENTMOE_CHECK(names.insert(name).second, path, ": duplicate tensor name \"", name, "\"");
    LATENTMOE_CHECK(view.defined(), path, ": tensor \"", name, "\" is undefined");
    LATENTMOE_CHECK(view.device() == Device::cpu, path, ": tensor \"", name, "\" is not in host memory");
  }

  std::string header_text;
  try {
    nlohmann::ordered_json header = nlohmann::ordered_json::object();
    if (!metadata.empty()) {
      header[kMetadataKey] = nlohmann::ordered_json::object();
      for (const auto& [key, value] : metadata) header[kMetadataKey][key] = value;
    }
    uint64_t offset = 0;
    for (const auto& [name, view] : tensors) {
      const uint64_t nbytes = static_cast<uint64_t>(view.numel()) * dtype_size(view.dtype());
      header[name] = {{"dtype", std::string(dtype_name(view.dtype()))},
                      {"shape", view.shape()},
                      {"data_offsets", {offset, offset + nbytes}}};
      offset += nbytes;
    }
    header_text = header.dump();
  } catch (const nlohmann::json::exception& error) {
    detail::throw_error(path, ": cannot encode the header (names and metadata must be UTF-8): ", error.what());
  }
  // Pad with spaces so the data section starts 8-byte aligned (as the reference writer does).
  header_text.append((8 - header_text.size() % 8) % 8, ' ');

  const std::filesystem::path target(path);
  LATENTMOE_CHECK(!target.filename().empty(), path, ": not a file path");
  std::filesystem::path directory = target.parent_path();
  if (directory.empty()) directory = ".";

  // A unique temporary name in the target's directory, so the final rename cannot cross file systems.
  static std::atomic<uint64_t> counter{0};
  TempFileGuard temp;
  for (int attempt = 0; attempt < 100 && temp.fd < 0; ++attempt) {
    std::ostringstream name;
    name << '.' << target.filename().string() << ".tmp." << ::getpid() << '.' << counter.fetch_add(1);
    const std::string candidate = (directory / name.str()).string();
    int fd = ::open(candidate.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd >= 0) {
      temp.fd = fd;
      temp.path = candidate;
    } else if (int error = errno; error != EEXIST) {
      detail::throw_error(path, ": cannot create a file in directory ", directory.string(), ": ", errno_text(error));
    }
  }
  LATENTMOE_CHECK(temp.fd >= 0, path, ": cannot find a free temporary file name in ", directory.string());

  FileWriter writer(temp.fd, temp.path);
  unsigned char length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<unsigned char>(uint64_t{header_text.size()} >> (8 * i));
  writer.write(length, sizeof(length));
  writer.write(header_text.data(), header_text.size());
  for (const auto& [name, view] : tensors) write_view(writer, view);
  writer.flush();

  if (::fsync(temp.fd) != 0) detail::throw_error(temp.path, ": fsync failed: ", errno_text(errno));
  int fd = temp.fd;
  temp.fd = -1;
  if (::close(fd) != 0) detail::throw_error(temp.path, ": close failed: ", errno_text(errno));
  if (::rename(temp.path.c_str(), path.c_str()) != 0) {
    detail::throw_error(path, ": cannot rename ", temp.path, " into place: ", errno_text(errno));
  }
  temp.committed = true;

  // Make the rename itself durable; the file is complete either way, so failures here are ignored.
  FdGuard dir{::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)};
  if (dir.fd >= 0) (void)::fsync(dir.fd);
}

}  // namespace latentmoe

#include "latentmoe/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <new>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <utility>

#include "latentmoe/atomic_file.h"
#include "latentmoe/error.h"

namespace latentmoe {
namespace {

using nlohmann::json;

// The reference implementation refuses headers above 100 MB; so do we, before allocating anything.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
constexpr const char* kMetadataKey = "__metadata__";
// Deepest nesting the header may have (objects and arrays, the top-level object counting 1). A
// valid header needs 3; the slack lets a wrongly typed field still get its specific message.
constexpr size_t kMaxHeaderDepth = 8;

std::string errno_text(int error) { return std::strerror(error); }

// Reads the header straight from the JSON parser's SAX events into entries and metadata, without
// building a JSON document:
//  - memory is linear in the header (the entries themselves; nlohmann's document would cost far
//    more, and its destructor allocates, so running out of memory while building one terminates);
//  - nesting deeper than kMaxHeaderDepth is refused before the deeper level is read (a valid
//    header needs 3: the header, an entry, its shape);
//  - a name or field that occurs twice in one object is an error (a document would keep the last
//    value silently, letting two tensors hide behind one name), found with one map lookup;
//  - the first problem throws Error "<path>: <problem>" from inside the parser.
// (Building a document through nlohmann's callback parser rescanned the whole header object after
// each entry, so n tensors cost O(n^2); everything here is O(n log n).)
class HeaderReader {
 public:
  HeaderReader(const std::string& path, uint64_t data_size, std::vector<SafetensorsEntry>& entries,
               std::map<std::string, size_t, std::less<>>& index, std::map<std::string, std::string>& metadata)
      : path_(path), data_size_(data_size), entries_(entries), index_(index), metadata_(metadata) {}

  bool null() { return scalar(Scalar{}); }
  bool boolean(bool /*value*/) { return scalar(Scalar{}); }
  bool number_integer(json::number_integer_t value) {
    Scalar scalar_value;
    if (value >= 0) scalar_value.integer = static_cast<uint64_t>(value);  // "-0" is a signed zero
    return scalar(scalar_value);
  }
  bool number_unsigned(json::number_unsigned_t value) {
    Scalar scalar_value;
    scalar_value.integer = value;
    return scalar(scalar_value);
  }
  bool number_float(json::number_float_t /*value*/, const json::string_t& /*text*/) { return scalar(Scalar{}); }
  bool string(json::string_t& value) {
    Scalar scalar_value;
    scalar_value.text = &value;
    return scalar(scalar_value);
  }
  bool binary(json::binary_t& /*value*/) { return scalar(Scalar{}); }

  bool start_object(std::size_t /*size*/) { return open(/*is_object=*/true); }
  bool start_array(std::size_t /*size*/) { return open(/*is_object=*/false); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }

  bool key(json::string_t& key) {
    if (skipping()) return true;
    if (depth_ == 1) {  // a tensor name or __metadata__
      if (key == kMetadataKey) {
        LATENTMOE_CHECK(!seen_metadata_, path_, ": duplicate tensor name \"", key, "\"");
        seen_metadata_ = true;
      } else {
        LATENTMOE_CHECK(index_.emplace(key, entries_.size()).second, path_, ": duplicate tensor name \"", key, "\"");
      }
      name_ = std::move(key);
    } else if (in_metadata_) {
      LATENTMOE_CHECK(metadata_.find(key) == metadata_.end(), path_, ": duplicate field \"", key, "\" in \"",
                      kMetadataKey, "\"");
      metadata_key_ = std::move(key);
    } else {  // a field of the entry name_
      field_ = key == "dtype"          ? Field::dtype
               : key == "shape"        ? Field::shape
               : key == "data_offsets" ? Field::data_offsets
                                       : Field::none;
      LATENTMOE_CHECK(field_ != Field::none, path_, ": tensor \"", name_, "\": unexpected field \"", key, "\"");
      bool& seen = field_ == Field::dtype   ? pending_.has_dtype
                   : field_ == Field::shape ? pending_.has_shape
                                            : pending_.has_offsets;
      LATENTMOE_CHECK(!seen, path_, ": duplicate field \"", key, "\" in \"", name_, "\"");
      seen = true;
    }
    return true;
  }

  bool parse_error(std::size_t /*position*/, const std::string& /*last_token*/, const json::exception& error) {
    detail::throw_error(path_, ": header is not valid JSON: ", error.what());
  }

 private:
  enum class Field { none, dtype, shape, data_offsets };

  // What a scalar event carries, as far as the header cares.
  struct Scalar {
    std::optional<uint64_t> integer;    // a non-negative integer
    const std::string* text = nullptr;  // a string
  };

  // An entry's fields as read, checked when its object ends (in the order the messages document).
  struct Pending {
    bool has_dtype = false, has_shape = false, has_offsets = false;
    const char* dtype_problem = nullptr;  // "is not a string"
    std::string dtype_text;
    bool shape_is_array = false;
    std::optional<size_t> bad_shape_element;
    std::vector<int64_t> shape;
    bool offsets_is_array = false;
    size_t offsets_count = 0;
    bool offsets_all_integers = true;
    uint64_t offsets[2] = {0, 0};
  };

  bool skipping() const { return skip_until_ > 0; }

  bool scalar(const Scalar& value) {
    if (skipping()) return true;
    switch (depth_) {
      case 0:
        detail::throw_error(path_, ": header is not a JSON object");
      case 1:
        if (name_ == kMetadataKey) detail::throw_error(path_, ": __metadata__ is not a JSON object");
        detail::throw_error(path_, ": tensor \"", name_, "\": entry is not a JSON object");
      case 2:
        if (in_metadata_) {
          LATENTMOE_CHECK(value.text != nullptr, path_, ": __metadata__ value of \"", metadata_key_,
                          "\" is not a string");
          metadata_.emplace(std::move(metadata_key_), *value.text);
        } else if (field_ == Field::dtype) {
          if (value.text != nullptr) {
            pending_.dtype_text = *value.text;
          } else {
            pending_.dtype_problem = "dtype is not a string";
          }
        }
        // A scalar shape or data_offsets leaves shape_is_array / offsets_is_array false.
        return true;
      default:  // depth 3: an element of shape or data_offsets
        element(value.integer);
        return true;
    }
  }

  void element(std::optional<uint64_t> integer) {
    if (field_ == Field::shape) {
      if (pending_.bad_shape_element) return;
      if (!integer || *integer > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        pending_.bad_shape_element = pending_.shape.size();
        return;
      }
      pending_.shape.push_back(static_cast<int64_t>(*integer));
    } else {  // data_offsets
      if (!integer) pending_.offsets_all_integers = false;
      if (integer && pending_.offsets_count < 2) pending_.offsets[pending_.offsets_count] = *integer;
      ++pending_.offsets_count;
    }
  }

  bool open(bool is_object) {
    if (depth_ >= kMaxHeaderDepth) {
      detail::throw_error(path_, ": header is nested more than ", kMaxHeaderDepth,
                          " levels deep (a safetensors header needs 3)");
    }
    ++depth_;
    if (skipping()) return true;
    switch (depth_) {
      case 1:
        LATENTMOE_CHECK(is_object, path_, ": header is not a JSON object");
        return true;
      case 2:
        if (name_ == kMetadataKey) {
          LATENTMOE_CHECK(is_object, path_, ": __metadata__ is not a JSON object");
          in_metadata_ = true;
        } else {
          LATENTMOE_CHECK(is_object, path_, ": tensor \"", name_, "\": entry is not a JSON object");
          pending_ = Pending{};
        }
        return true;
      case 3:
        LATENTMOE_CHECK(!in_metadata_, path_, ": __metadata__ value of \"", metadata_key_, "\" is not a string");
        if (field_ == Field::dtype) {
          pending_.dtype_problem = "dtype is not a string";
        } else if (field_ == Field::shape && !is_object) {
          pending_.shape_is_array = true;
          return true;
        } else if (field_ == Field::data_offsets && !is_object) {
          pending_.offsets_is_array = true;
          return true;
        }
        break;  // an object for shape / data_offsets: wrong type; its contents do not matter
      default:  // a container inside shape or data_offsets: an element of the wrong kind
        element(std::nullopt);
        break;
    }
    skip_until_ = depth_;  // ignore everything until this container closes
    return true;
  }

  bool close() {
    if (skip_until_ == depth_) {
      skip_until_ = 0;
    } else if (!skipping()) {
      if (depth_ == 2 && in_metadata_) {
        in_metadata_ = false;
      } else if (depth_ == 2) {
        finish_entry();
      }
    }
    --depth_;
    return true;
  }

  // Checks the entry that just ended, in the documented order, and keeps it.
  void finish_entry() {
    const std::string& name = name_;
    Pending& p = pending_;
    LATENTMOE_CHECK(p.has_dtype, path_, ": tensor \"", name, "\": missing field \"dtype\"");
    LATENTMOE_CHECK(p.has_shape, path_, ": tensor \"", name, "\": missing field \"shape\"");
    LATENTMOE_CHECK(p.has_offsets, path_, ": tensor \"", name, "\": missing field \"data_offsets\"");

    SafetensorsEntry entry;
    entry.name = name;
    LATENTMOE_CHECK(p.dtype_problem == nullptr, path_, ": tensor \"", name, "\": ", p.dtype_problem);
    auto parsed_dtype = parse_dtype(p.dtype_text);
    LATENTMOE_CHECK(parsed_dtype.has_value(), path_, ": tensor \"", name, "\": unknown dtype \"", p.dtype_text, "\"");
    entry.dtype = *parsed_dtype;

    LATENTMOE_CHECK(p.shape_is_array, path_, ": tensor \"", name, "\": shape is not an array");
    LATENTMOE_CHECK(!p.bad_shape_element, path_, ": tensor \"", name, "\": shape element ",
                    p.bad_shape_element.value_or(0), " is not a non-negative integer (shape must be a list of them)");
    // Checked at every step, like the reference reader: a huge extent overflows even next to a zero.
    uint64_t numel = 1;
    bool numel_overflow = false;
    for (int64_t dim : p.shape) {
      if (__builtin_mul_overflow(numel, static_cast<uint64_t>(dim), &numel)) numel_overflow = true;
    }
    entry.shape = std::move(p.shape);
    uint64_t nbytes = 0;
    LATENTMOE_CHECK(!numel_overflow && !__builtin_mul_overflow(numel, dtype_size(entry.dtype), &nbytes), path_,
                    ": tensor \"", name, "\": shape ", shape_string(entry.shape), " is too large (size overflows)");

    LATENTMOE_CHECK(p.offsets_is_array && p.offsets_count == 2, path_, ": tensor \"", name,
                    "\": data_offsets is not an array of two integers");
    LATENTMOE_CHECK(p.offsets_all_integers, path_, ": tensor \"", name,
                    "\": data_offsets are not non-negative integers");
    entry.begin = p.offsets[0];
    entry.end = p.offsets[1];
    LATENTMOE_CHECK(entry.begin <= entry.end, path_, ": tensor \"", name, "\": data_offsets [", entry.begin, ", ",
                    entry.end, "] begin after end");
    LATENTMOE_CHECK(entry.end - entry.begin == nbytes, path_, ": tensor \"", name, "\": ", dtype_name(entry.dtype),
                    " shape ", shape_string(entry.shape), " needs ", nbytes, " bytes but data_offsets [", entry.begin,
                    ", ", entry.end, "] span ", entry.end - entry.begin);
    LATENTMOE_CHECK(entry.end <= data_size_, path_, ": tensor \"", name, "\": data_offsets [", entry.begin, ", ",
                    entry.end, "] run past the data section (", data_size_, " bytes)");
    entries_.push_back(std::move(entry));
  }

  const std::string& path_;
  const uint64_t data_size_;
  std::vector<SafetensorsEntry>& entries_;
  std::map<std::string, size_t, std::less<>>& index_;
  std::map<std::string, std::string>& metadata_;

  size_t depth_ = 0;       // containers open (the header object is depth 1)
  size_t skip_until_ = 0;  // when non-zero: inside an ignored container opened at this depth
  bool seen_metadata_ = false;
  bool in_metadata_ = false;
  std::string name_;          // the current top-level key
  std::string metadata_key_;  // the current __metadata__ key
  Field field_ = Field::none;
  Pending pending_;
};

// Parses and checks the header: every entry, the metadata, and that the entries tile the data
// section exactly. Entries come back sorted by data offset, `index` mapping names to positions.
void read_header(const std::string& path, const char* header_begin, uint64_t header_size, uint64_t data_size,
                 std::vector<SafetensorsEntry>& entries, std::map<std::string, size_t, std::less<>>& index,
                 std::map<std::string, std::string>& metadata) {
  HeaderReader reader(path, data_size, entries, index, metadata);
  // Every problem throws from inside; false would only mean a handler declined, which none does.
  LATENTMOE_CHECK(json::sax_parse(header_begin, header_begin + header_size, &reader), path,
                  ": header is not valid JSON");

  // The entries must tile the data section exactly: no overlap, no hole, nothing after the last.
  std::sort(entries.begin(), entries.end(), [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  uint64_t covered = 0;
  const SafetensorsEntry* previous = nullptr;
  for (const SafetensorsEntry& entry : entries) {
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
  LATENTMOE_CHECK(covered == data_size, path, ": data section has ", data_size - covered,
                  " bytes after the last tensor that belong to no tensor");
  for (size_t i = 0; i < entries.size(); ++i) index.find(entries[i].name)->second = i;
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

  // Only a regular file: open() on a FIFO would block until a writer appears, and opening a device
  // can have side effects. stat() first, then open non-blocking and fstat() what was opened (the
  // path may have changed in between).
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0) detail::throw_error(path, ": cannot open: ", errno_text(errno));
  LATENTMOE_CHECK(S_ISREG(info.st_mode), path, ": not a regular file");
  FdGuard file{::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC)};
  if (file.fd < 0) detail::throw_error(path, ": cannot open: ", errno_text(errno));
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
  try {
    read_header(path, header_begin, header_size, state->data_size, state->entries, state->index, state->metadata);
  } catch (const std::bad_alloc&) {
    // Memory is linear in the header (at most kMaxHeaderBytes); a machine that cannot hold it
    // still gets one line naming the file.
    detail::throw_error(path, ": out of memory while reading the ", header_size, "-byte header");
  }
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

// Writes a view's elements in row-major order, whatever its strides.
void write_view(AtomicFile& writer, const TensorView& view) {
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

  uint64_t total_bytes = 8 + header_text.size();
  for (const auto& [name, view] : tensors) {
    total_bytes += static_cast<uint64_t>(view.numel()) * dtype_size(view.dtype());
  }
  AtomicFile file(path, total_bytes);  // refuses a non-regular target or a size over RLIMIT_FSIZE
  unsigned char length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<unsigned char>(uint64_t{header_text.size()} >> (8 * i));
  file.write(length, sizeof(length));
  file.write(header_text.data(), header_text.size());
  for (const auto& [name, view] : tensors) write_view(file, view);
  file.commit();
}

}  // namespace latentmoe

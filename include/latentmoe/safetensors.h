// safetensors files: a memory-mapped reader that checks every header field against the file, and
// an atomic writer (a temporary file renamed into place, so a failure leaves no partial output).
//
// Format: 8-byte little-endian header length N, N bytes of JSON
//   {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {..}}
// then the data section; offsets are relative to the data section's start.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "latentmoe/tensor.h"

namespace latentmoe {

struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::f32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets into the data section
  uint64_t end = 0;
};

class SafetensorsFile {
 public:
  // Maps the file and validates the whole header: the length, the JSON, every entry's dtype,
  // shape (non-negative, product times element size equals the byte span without overflow) and
  // offsets (inside the data section, not overlapping another entry). Throws Error naming the file
  // and the problem; never reads outside the mapping.
  // Hostile input: only a regular file is opened (a FIFO or device is refused without blocking);
  // the header is at most 100,000,000 bytes and 8 levels deep; it is read in one streaming pass,
  // O(n log n) in its n tensors, memory linear in its size (running out is an Error too).
  static SafetensorsFile open(const std::string& path);

  SafetensorsFile(SafetensorsFile&&) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept;
  ~SafetensorsFile();

  const std::string& path() const;
  // Entries in the order of their data offsets.
  const std::vector<SafetensorsEntry>& entries() const;
  const std::map<std::string, std::string>& metadata() const;
  // nullptr when there is no tensor of that name.
  const SafetensorsEntry* find(std::string_view name) const;
  // The entry, or Error "<path>: no tensor named <name>".
  const SafetensorsEntry& at(std::string_view name) const;

  // Read-only bytes of an entry inside the mapping (may be unaligned for its dtype).
  const std::byte* bytes(const SafetensorsEntry& entry) const;
  // A copy of the tensor in a new aligned host tensor of the same dtype.
  HostTensor read(std::string_view name) const;

 private:
  struct State;
  explicit SafetensorsFile(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

// Writes `tensors` (host views, any dtype, any order; names unique) to `path` atomically: a
// temporary ".lmoe.<pid>.<n>.tmp" in the same directory, renamed over `path`. Refuses an existing
// `path` that is not a regular file (FIFO, device, directory) and a file larger than the process's
// RLIMIT_FSIZE, before creating anything; on any failure nothing is left behind.
void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, TensorView>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace latentmoe

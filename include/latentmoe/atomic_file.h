// A file that appears whole or not at all (docs/FILES.md, "Writing"): the bytes go to a temporary
// file in the target's directory, which commit() fsyncs and renames over the target. Used by every
// writer of the library (safetensors outputs, tune tables).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace latentmoe {

class AtomicFile {
 public:
  // Checks before anything is created: an existing `path` that is not a regular file (a FIFO, a
  // device, a directory) is refused rather than replaced, and so is a file of `total_bytes` above the
  // process's file-size limit (RLIMIT_FSIZE: the write would be killed by SIGXFSZ part way). Then
  // creates the temporary file ".lmoe.<pid>.<n>.tmp" (its name does not contain the target's, so
  // any name up to the file-name limit can be written). Errors name `path`.
  AtomicFile(const std::string& path, uint64_t total_bytes);
  // Removes the temporary file unless commit() renamed it into place.
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  // Buffered; retries short writes and EINTR.
  void write(const void* data, size_t size);
  // Flushes, fsyncs, closes and renames the file over `path`, then fsyncs the directory (best effort).
  void commit();

 private:
  void flush();
  void write_through(const char* bytes, size_t size);

  std::string path_;
  std::string directory_;
  std::string temp_path_;
  int fd_ = -1;
  bool committed_ = false;
  std::vector<char> buffer_;
};

}  // namespace latentmoe

#include "latentmoe/atomic_file.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "latentmoe/error.h"

namespace latentmoe {
namespace {

constexpr size_t kBufferBytes = size_t{1} << 20;

std::string errno_text(int error) { return std::strerror(error); }

}  // namespace

AtomicFile::AtomicFile(const std::string& path, uint64_t total_bytes) : path_(path) {
  const std::filesystem::path target(path);
  LATENTMOE_CHECK(!target.filename().empty(), path, ": not a file path");
  std::filesystem::path directory = target.parent_path();
  if (directory.empty()) directory = ".";
  directory_ = directory.string();

  // The rename would replace whatever is at `path`: a FIFO, a device (/dev/null, a disk) or a
  // directory is refused rather than turned into a regular file. (A symlink is followed for the
  // check and replaced by the file.)
  struct stat existing {};
  if (::stat(path.c_str(), &existing) == 0) {
    LATENTMOE_CHECK(S_ISREG(existing.st_mode), path, ": exists and is not a regular file; refusing to replace it");
  }
  if (struct rlimit limit{}; ::getrlimit(RLIMIT_FSIZE, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY &&
                             total_bytes > static_cast<uint64_t>(limit.rlim_cur)) {
    detail::throw_error(path, ": the file would be ", total_bytes, " bytes, over the file size limit of ",
                        static_cast<uint64_t>(limit.rlim_cur), " bytes (RLIMIT_FSIZE, ulimit -f)");
  }

  // A unique name in the target's directory, so the final rename cannot cross file systems.
  static std::atomic<uint64_t> counter{0};
  for (int attempt = 0; attempt < 100 && fd_ < 0; ++attempt) {
    const std::string candidate =
        (directory / (".lmoe." + std::to_string(::getpid()) + "." + std::to_string(counter.fetch_add(1)) + ".tmp"))
            .string();
    const int fd = ::open(candidate.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd >= 0) {
      fd_ = fd;
      temp_path_ = candidate;
    } else if (const int error = errno; error != EEXIST) {
      detail::throw_error(path, ": cannot create a file in directory ", directory_, ": ", errno_text(error));
    }
  }
  LATENTMOE_CHECK(fd_ >= 0, path, ": cannot find a free temporary file name in ", directory_);
  buffer_.reserve(kBufferBytes);
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_ && !temp_path_.empty()) ::unlink(temp_path_.c_str());
}

void AtomicFile::write(const void* data, size_t size) {
  const auto* bytes = static_cast<const char*>(data);
  if (buffer_.size() + size > kBufferBytes) flush();
  if (size >= kBufferBytes) {
    write_through(bytes, size);
  } else {
    buffer_.insert(buffer_.end(), bytes, bytes + size);
  }
}

void AtomicFile::flush() {
  write_through(buffer_.data(), buffer_.size());
  buffer_.clear();
}

void AtomicFile::write_through(const char* bytes, size_t size) {
  while (size > 0) {
    const ssize_t written = ::write(fd_, bytes, size);
    if (written < 0 && errno == EINTR) continue;
    if (written < 0 && errno == EFBIG) {
      detail::throw_error(path_, ": write failed: the file size limit (RLIMIT_FSIZE, ulimit -f) was reached");
    }
    if (written <= 0) detail::throw_error(path_, ": write failed: ", errno_text(written < 0 ? errno : EIO));
    bytes += written;
    size -= static_cast<size_t>(written);
  }
}

void AtomicFile::commit() {
  LATENTMOE_CHECK(fd_ >= 0 && !committed_, path_, ": the file was already committed");
  flush();
  if (::fsync(fd_) != 0) detail::throw_error(path_, ": fsync failed: ", errno_text(errno));
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) detail::throw_error(path_, ": close failed: ", errno_text(errno));
  if (::rename(temp_path_.c_str(), path_.c_str()) != 0) {
    detail::throw_error(path_, ": cannot rename ", temp_path_, " into place: ", errno_text(errno));
  }
  committed_ = true;
  // Make the rename itself durable; the file is complete either way, so failures here are ignored.
  const int directory_fd = ::open(directory_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (directory_fd >= 0) {
    (void)::fsync(directory_fd);
    ::close(directory_fd);
  }
}

}  // namespace latentmoe

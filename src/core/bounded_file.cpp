#include "core/bounded_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "latentmoe/error.h"

namespace latentmoe::detail {
namespace {

// Closes a file descriptor on every path out of a scope.
struct FdCloser {
  int fd = -1;
  ~FdCloser() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

std::string read_bounded_file(const std::string& path, size_t max_bytes, std::string_view what) {
  const auto fail = [&](const char* reason) { detail::throw_error(path, ": cannot read ", what, ": ", reason); };
  const auto over_limit = [&] {
    detail::throw_error(path, ": ", what, " is over the limit of ", max_bytes, " bytes (", max_bytes >> 20, " MiB)");
  };
  const auto check = [&](const struct stat& info) {
    if (S_ISDIR(info.st_mode)) fail("is a directory, not a regular file");
    if (!S_ISREG(info.st_mode)) fail("not a regular file");
    if (static_cast<uint64_t>(info.st_size) > max_bytes) over_limit();
  };
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0) fail(std::strerror(errno));
  check(info);
  FdCloser file{::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC)};
  if (file.fd < 0) fail(std::strerror(errno));
  if (::fstat(file.fd, &info) != 0) fail(std::strerror(errno));
  check(info);

  std::string text;
  constexpr size_t kChunk = size_t{64} << 10;
  while (text.size() <= max_bytes) {
    const size_t offset = text.size();
    text.resize(offset + std::min(kChunk, max_bytes + 1 - offset));
    const ssize_t got = ::read(file.fd, text.data() + offset, text.size() - offset);
    if (got < 0) {
      text.resize(offset);
      if (errno == EINTR) continue;
      fail(std::strerror(errno));
    }
    text.resize(offset + static_cast<size_t>(got));
    if (got == 0) return text;
  }
  detail::throw_error(path, ": ", what, " is over the limit of ", max_bytes, " bytes (", max_bytes >> 20, " MiB)");
}

}  // namespace latentmoe::detail

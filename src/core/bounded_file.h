// Reading a small text file (a config, a checkpoint index, a tune table) as hostile input.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace latentmoe::detail {

// The whole file at `path`, which must be a regular file: stat() before open() so that a FIFO
// (whose open would block until a writer appears) or a device is never opened, then
// open(O_NONBLOCK) and fstat() of what was opened (the path may have changed in between). At most
// max_bytes + 1 bytes are ever read, whatever the file claims or grows to. Errors, each naming the
// path and `what` ("config file", "index", "tune table"):
//   "<path>: cannot read <what>: No such file or directory" (any open/read error, by strerror),
//   "<path>: cannot read <what>: is a directory, not a regular file",
//   "<path>: cannot read <what>: not a regular file",
//   "<path>: <what> is over the limit of <max_bytes> bytes (<N> MiB)".
std::string read_bounded_file(const std::string& path, size_t max_bytes, std::string_view what);

}  // namespace latentmoe::detail

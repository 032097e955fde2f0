// The one error type of latentmoe. Every failure the library detects (bad input, impossible
// configuration, a CUDA or NCCL error, a collective that timed out) is thrown as latentmoe::Error
// with a message that names the problem. Nothing in the library calls exit().
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace latentmoe {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

namespace detail {
template <class... Parts>
[[noreturn]] void throw_error(Parts&&... parts) {
  std::ostringstream message;
  (message << ... << std::forward<Parts>(parts));
  throw Error(message.str());
}
}  // namespace detail

}  // namespace latentmoe

// LATENTMOE_CHECK(condition, parts...) throws latentmoe::Error built from the streamed parts when the
// condition is false. Use it for input validation, never for conditions that cannot be false.
#define LATENTMOE_CHECK(condition, ...)                              \
  do {                                                               \
    if (!(condition)) ::latentmoe::detail::throw_error(__VA_ARGS__); \
  } while (false)

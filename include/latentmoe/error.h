// The one error type of latentmoe. Every failure the library detects (bad input, impossible
// configuration, a CUDA or NCCL error, a collective that timed out) is thrown as latentmoe::Error
// with a message that names the problem. Nothing in the library calls exit().
//
// Every message is one safe line: Error's constructor replaces control characters (C0, DEL, C1,
// bytes that are not UTF-8, bidi overrides, line/paragraph separators) by a visible escape such as
// \n or \x1b, and caps the message at kMaxMessageBytes. throw_error() also caps each streamed part at
// kMaxPartBytes, so that one huge echoed name (a tensor name, an environment value) cannot push the
// rest of the message out. Both are idempotent: sanitising a sanitised message changes nothing.
#pragma once

#include <cstddef>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

namespace latentmoe {

// The most bytes a whole message may hold (an over-long one ends with "... (N bytes omitted)").
inline constexpr size_t kMaxMessageBytes = 4096;
// The most bytes one part streamed into throw_error / LATENTMOE_CHECK may contribute.
inline constexpr size_t kMaxPartBytes = 1024;

// `text` with every unsafe byte escaped, at most `max_bytes` long (longer: cut at a character
// boundary and ended with "... (N bytes omitted)", N counting bytes of `text`).
std::string sanitize_error_text(std::string_view text, size_t max_bytes = kMaxMessageBytes);

class Error : public std::runtime_error {
 public:
  explicit Error(std::string_view message) : std::runtime_error(sanitize_error_text(message)) {}
  explicit Error(const std::string& message) : Error(std::string_view(message)) {}
  explicit Error(const char* message) : Error(std::string_view(message == nullptr ? "" : message)) {}
};

namespace detail {
template <class Part>
void append_error_part(std::string& out, const Part& part) {
  if constexpr (std::is_convertible_v<const Part&, std::string_view>) {
    if constexpr (std::is_pointer_v<Part>) {
      if (part == nullptr) {
        out += "(null)";
        return;
      }
    }
    out += sanitize_error_text(std::string_view(part), kMaxPartBytes);
  } else {
    std::ostringstream text;
    text << part;
    out += sanitize_error_text(text.str(), kMaxPartBytes);
  }
}

template <class... Parts>
[[noreturn]] void throw_error(Parts&&... parts) {
  std::string message;
  (append_error_part(message, parts), ...);
  throw Error(message);
}
}  // namespace detail

}  // namespace latentmoe

// LATENTMOE_CHECK(condition, parts...) throws latentmoe::Error built from the streamed parts when the
// condition is false. Use it for input validation, never for conditions that cannot be false.
#define LATENTMOE_CHECK(condition, ...)                              \
  do {                                                               \
    if (!(condition)) ::latentmoe::detail::throw_error(__VA_ARGS__); \
  } while (false)

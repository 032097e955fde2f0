// The one error type of latentmoe. Every failure the library detects (bad input, impossible
// configuration, a CUDA or NCCL error, a collective that timed out) is thrown as latentmoe::Error
// with a message that names the problem. Nothing in the library calls exit().
//
// Every message is one safe line: Error's constructor replaces control characters (C0, DEL, C1,
// bytes that are not UTF-8, bidi overrides, line/paragraph separators) by a visible escape such as
// \n or \x1b, and caps the message at kMaxMessageBytes. throw_error() also caps each streamed part
// (an echoed name, value or path) at kMaxPartBytes, so that one huge echoed name (a 10 MB tensor
// name, an environment value) leaves a line under 300 characters that still says what was wrong.
// A cut text ends with "...(+N more)", N the characters left out. Both are idempotent: sanitising a
// sanitised message changes nothing.
#pragma once

#include <cstddef>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

namespace latentmoe {

// The most bytes a whole message may hold.
inline constexpr size_t kMaxMessageBytes = 4096;
// The most bytes one part streamed into throw_error / LATENTMOE_CHECK may contribute, its
// "...(+N more)" included (so at most 200 characters). A latentmoe::Error streamed as a part (an error
// wrapped in another) is appended whole: its own parts are capped already.
inline constexpr size_t kMaxPartBytes = 200;

// `text` with every unsafe byte escaped, at most `max_bytes` long. A longer rendering keeps its first
// whole characters and escapes (never part of one) and ends with "...(+N more)", N the characters of
// `text` not shown (a character: one well-formed UTF-8 sequence, or one byte that is not part of
// one), with thousands separators: "...(+9,999,821 more)".
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
  if constexpr (std::is_base_of_v<Error, Part>) {
    out += part.what();  // sanitised and capped when it was made
  } else if constexpr (std::is_convertible_v<const Part&, std::string_view>) {
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

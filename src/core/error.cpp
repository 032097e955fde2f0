// The one-line, bounded rendering of error text (include/latentmoe/error.h).
#include "latentmoe/error.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>

namespace latentmoe {
namespace {

constexpr char kHex[] = "0123456789abcdef";

void append_byte_escape(std::string& out, unsigned char byte) {
  switch (byte) {
    case '\n':
      out += "\\n";
      return;
    case '\r':
      out += "\\r";
      return;
    case '\t':
      out += "\\t";
      return;
    default:
      out += "\\x";
      out += kHex[byte >> 4];
      out += kHex[byte & 0xf];
  }
}

void append_code_point_escape(std::string& out, uint32_t code_point) {
  out += "\\u";
  for (int shift = 12; shift >= 0; shift -= 4) out += kHex[(code_point >> shift) & 0xf];
}

// The length of the well-formed UTF-8 sequence at text[i] (0 when it is not one) and its code point.
size_t utf8_sequence(std::string_view text, size_t i, uint32_t& code_point) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(text[i + k]); };
  const unsigned char lead = byte(0);
  size_t length = 0;
  unsigned char low = 0x80, high = 0xbf;  // the range of the second byte
  if (lead >= 0xc2 && lead <= 0xdf) {
    length = 2;
    code_point = lead & 0x1f;
  } else if (lead >= 0xe0 && lead <= 0xef) {
    length = 3;
    code_point = lead & 0x0f;
    if (lead == 0xe0) low = 0xa0;   // no overlong forms
    if (lead == 0xed) high = 0x9f;  // no surrogates
  } else if (lead >= 0xf0 && lead <= 0xf4) {
    length = 4;
    code_point = lead & 0x07;
    if (lead == 0xf0) low = 0x90;
    if (lead == 0xf4) high = 0x8f;  // nothing above U+10FFFF
  } else {
    return 0;
  }
  if (i + length > text.size()) return 0;
  if (byte(1) < low || byte(1) > high) return 0;
  for (size_t k = 1; k < length; ++k) {
    if ((byte(k) & 0xc0) != 0x80) return 0;
    code_point = (code_point << 6) | (byte(k) & 0x3f);
  }
  return length;
}

// Code points that are valid UTF-8 but move the cursor, split lines or reorder text on a terminal.
bool unsafe_code_point(uint32_t code_point) {
  return (code_point >= 0x80 && code_point <= 0x9f) ||      // C1 controls (0x9b is CSI)
         code_point == 0x200e || code_point == 0x200f ||    // LRM, RLM
         code_point == 0x2028 || code_point == 0x2029 ||    // line and paragraph separators
         (code_point >= 0x202a && code_point <= 0x202e) ||  // bidi embeddings and overrides
         (code_point >= 0x2066 && code_point <= 0x2069);    // bidi isolates
}

// Appends the rendering of the character at text[i]; returns how many input bytes it took.
size_t append_character(std::string& out, std::string_view text, size_t i) {
  const auto byte = static_cast<unsigned char>(text[i]);
  if (byte < 0x80) {
    if (byte < 0x20 || byte == 0x7f) {
      append_byte_escape(out, byte);
    } else {
      out += static_cast<char>(byte);
    }
    return 1;
  }
  uint32_t code_point = 0;
  const size_t length = utf8_sequence(text, i, code_point);
  if (length == 0) {
    append_byte_escape(out, byte);  // not UTF-8: a lone byte such as 0x9b could act as CSI
    return 1;
  }
  if (unsafe_code_point(code_point)) {
    append_code_point_escape(out, code_point);
  } else {
    out.append(text.substr(i, length));
  }
  return length;
}

// How many characters text[i..] holds: each well-formed UTF-8 sequence is one, every other byte one.
size_t count_characters(std::string_view text, size_t i) {
  size_t count = 0;
  uint32_t code_point = 0;
  while (i < text.size()) {
    const size_t length = static_cast<unsigned char>(text[i]) < 0x80 ? 1 : utf8_sequence(text, i, code_point);
    i += length == 0 ? 1 : length;
    ++count;
  }
  return count;
}

// "...(+9,999,821 more)".
std::string omission_marker(size_t omitted) {
  const std::string digits = std::to_string(omitted);
  std::string marker = "...(+";
  for (size_t k = 0; k < digits.size(); ++k) {
    if (k > 0 && (digits.size() - k) % 3 == 0) marker += ',';
    marker += digits[k];
  }
  return marker + " more)";
}

bool needs_rendering(std::string_view text) {
  for (char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte < 0x20 || byte >= 0x7f) return true;
  }
  return false;
}

}  // namespace

std::string sanitize_error_text(std::string_view text, size_t max_bytes) {
  if (text.size() <= max_bytes && !needs_rendering(text)) return std::string(text);

  std::string out;
  out.reserve(std::min(max_bytes, text.size() * 4) + 1);
  size_t i = 0;
  size_t characters = 0;  // rendered so far
  while (i < text.size() && out.size() <= max_bytes) {
    i += append_character(out, text, i);
    ++characters;
  }
  if (out.size() <= max_bytes) return out;  // the whole text fitted

  // Too long: keep the whole characters (an escape is one) that leave room for the marker. The marker
  // is sized for every character omitted, the widest it can be, so the kept text fits whatever it says.
  const size_t total = characters + count_characters(text, i);
  const size_t widest = omission_marker(total).size();
  const size_t keep = max_bytes > widest ? max_bytes - widest : 0;
  std::string kept;
  size_t shown = 0;
  for (size_t k = 0; k < text.size();) {
    const size_t before = kept.size();
    const size_t length = append_character(kept, text, k);
    if (kept.size() > keep) {
      kept.resize(before);
      break;
    }
    k += length;
    ++shown;
  }
  kept += omission_marker(total - shown);
  if (kept.size() > max_bytes) kept.resize(max_bytes);  // only for a max_bytes narrower than the marker
  return kept;
}

}  // namespace latentmoe

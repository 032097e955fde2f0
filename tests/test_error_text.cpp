// Error text is one safe, bounded line: control characters escaped, each echoed part (at most 200
// bytes with its "...(+N more)") and the whole message capped (include/latentmoe/error.h).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <string_view>

#include "latentmoe/error.h"
#include "latentmoe/tier.h"

namespace latentmoe {
namespace {

using ::testing::AllOf;
using ::testing::EndsWith;
using ::testing::HasSubstr;
using ::testing::Not;

// No byte below 0x20, no DEL, no ESC: the message cannot split a line or drive a terminal.
bool is_one_safe_line(std::string_view text) {
  for (char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte < 0x20 || byte == 0x7f) return false;
  }
  return true;
}

std::string check_message(const std::string& name) {
  try {
    LATENTMOE_CHECK(false, "tensor '", name, "' is missing from ", std::string_view("w.safetensors"));
  } catch (const Error& error) {
    return error.what();
  }
  return "";
}

TEST(ErrorText, control_characters_are_escaped) {
  std::string message = check_message("layer.0\nFAKE: injected\r\t\x1b[31mred\x7f\x01");
  EXPECT_TRUE(is_one_safe_line(message)) << message;
  EXPECT_EQ(message, "tensor 'layer.0\\nFAKE: injected\\r\\t\\x1b[31mred\\x7f\\x01' is missing from w.safetensors");
}

// An echoed part is at most kMaxPartBytes (200) with its "...(+N more)": a 10 MB name leaves a line
// under 300 characters that ends as the message does and says how much of the name it left out.
TEST(ErrorText, a_ten_megabyte_name_gives_a_line_under_300_characters_with_the_count_left_out) {
  ASSERT_EQ(kMaxPartBytes, 200u);
  const std::string name(10'000'000, 'n');
  std::string message = check_message(name);
  // The widest marker, "...(+10,000,000 more)", is 21 bytes: 179 characters shown, 9,999,821 left out.
  EXPECT_EQ(message, "tensor '" + std::string(179, 'n') + "...(+9,999,821 more)' is missing from w.safetensors");
  EXPECT_LT(message.size(), 300u);

  std::string hostile = name;
  hostile[5] = '\n';
  hostile[7'000'000] = '\x1b';
  message = check_message(hostile);
  EXPECT_TRUE(is_one_safe_line(message));
  EXPECT_LT(message.size(), 300u);
  // "\n" renders as two characters but counts as one of the name's: 178 characters shown.
  EXPECT_THAT(message, AllOf(HasSubstr("tensor 'nnnnn\\nn"), HasSubstr("...(+9,999,822 more)' is missing from")));
}

TEST(ErrorText, a_cut_never_splits_an_escape_and_counts_characters) {
  // 182 + 1 + 1000 characters: the marker "...(+1,183 more)" leaves 184 bytes, and the escape \x1b (4
  // bytes after 182) does not fit: it is left out whole, and counted as one character.
  const std::string text = std::string(182, 'a') + "\x1b" + std::string(1000, 'b');
  EXPECT_EQ(sanitize_error_text(text, kMaxPartBytes), std::string(182, 'a') + "...(+1,001 more)");
  // With room for it, the escape is kept whole.
  const std::string earlier = std::string(178, 'a') + "\x1b" + std::string(1000, 'b');
  EXPECT_EQ(sanitize_error_text(earlier, kMaxPartBytes), std::string(178, 'a') + "\\x1bbb...(+998 more)");
  EXPECT_EQ(sanitize_error_text(std::string(205, 'z'), kMaxPartBytes), std::string(186, 'z') + "...(+19 more)");
  EXPECT_EQ(sanitize_error_text(std::string(200, 'z'), kMaxPartBytes), std::string(200, 'z'));  // fits: no marker
}

TEST(ErrorText, a_wrapped_error_is_appended_whole) {
  const std::string inner = check_message(std::string(10'000'000, 'n'));
  ASSERT_GT(inner.size(), kMaxPartBytes);
  try {
    detail::throw_error("shard \"s1\": ", Error(inner));
    FAIL() << "expected Error";
  } catch (const Error& error) {
    EXPECT_EQ(std::string(error.what()), "shard \"s1\": " + inner);
  }
}

TEST(ErrorText, whole_message_is_capped) {
  std::string many_parts;
  for (int i = 0; i < 100; ++i) many_parts += std::string(1000, 'b') + "\n";
  Error direct(many_parts);
  EXPECT_LE(std::string_view(direct.what()).size(), kMaxMessageBytes);
  EXPECT_TRUE(is_one_safe_line(direct.what()));
  EXPECT_THAT(direct.what(), EndsWith(" more)"));

  // Parts are capped one by one; wrapped errors are appended whole, so two of 4000 bytes need the cap.
  const Error wrapped(std::string(4000, 'c'));
  ASSERT_EQ(std::string_view(wrapped.what()).size(), 4000u);
  try {
    detail::throw_error(wrapped, "; and ", wrapped);
    FAIL() << "expected Error";
  } catch (const Error& error) {
    EXPECT_LE(std::string_view(error.what()).size(), kMaxMessageBytes);
    EXPECT_THAT(error.what(), EndsWith(" more)"));
  }
}

TEST(ErrorText, utf8_passes_and_unsafe_bytes_are_escaped) {
  EXPECT_EQ(sanitize_error_text("expert \xc3\xa9t\xc3\xa9 \xe6\xbc\xa2 \xf0\x9f\x98\x80"),
            "expert \xc3\xa9t\xc3\xa9 \xe6\xbc\xa2 \xf0\x9f\x98\x80");
  EXPECT_EQ(sanitize_error_text("a\x9b"
                                "31mb"),
            "a\\x9b31mb");                                                 // a lone C1 byte (CSI)
  EXPECT_EQ(sanitize_error_text("a\xc2\x9b"), "a\\u009b");                 // C1 CSI as UTF-8
  EXPECT_EQ(sanitize_error_text("a\xe2\x80\xae"), "a\\u202e");             // right-to-left override
  EXPECT_EQ(sanitize_error_text("a\xe2\x80\xa8"), "a\\u2028");             // line separator
  EXPECT_EQ(sanitize_error_text("\xc3"), "\\xc3");                         // a cut sequence
  EXPECT_EQ(sanitize_error_text("\xc0\xaf"), "\\xc0\\xaf");                // overlong
  EXPECT_EQ(sanitize_error_text(std::string_view("a\0b", 3)), "a\\x00b");  // NUL
}

TEST(ErrorText, sanitizing_is_idempotent) {
  std::string hostile = std::string(5000, 'x') + "\n\x1b\xc2\x9b\xff" + std::string(3000, '\xc3');
  std::string once = sanitize_error_text(hostile);
  EXPECT_LE(once.size(), kMaxMessageBytes);
  EXPECT_EQ(sanitize_error_text(once), once);
  std::string part = sanitize_error_text(hostile, kMaxPartBytes);
  EXPECT_LE(part.size(), kMaxPartBytes);
  EXPECT_EQ(sanitize_error_text(part, kMaxPartBytes), part);
  EXPECT_EQ(Error(std::string(Error(hostile).what())).what(), std::string(Error(hostile).what()));
}

TEST(ErrorText, a_cut_never_splits_a_utf8_character) {
  std::string text;
  for (int i = 0; i < 2000; ++i) text += "\xe6\xbc\xa2";
  // "...(+2,000 more)" leaves 84 bytes: 28 whole characters of 3 bytes, 1,972 left out.
  std::string expected;
  for (int i = 0; i < 28; ++i) expected += "\xe6\xbc\xa2";
  EXPECT_EQ(sanitize_error_text(text, 100), expected + "...(+1,972 more)");
  // One byte less: 27 characters (a 28th would be cut in two).
  expected.resize(27 * 3);
  EXPECT_EQ(sanitize_error_text(text, 99), expected + "...(+1,973 more)");
}

TEST(ErrorText, environment_values_are_echoed_safely) {
  const std::string hostile = "1\n\x1b]0;owned\x07" + std::string(1 << 20, '9');
  for (std::string_view variable : {"LATENTMOE_TAIL_FUSION_MAX_TOKENS", "LATENTMOE_DISABLE_TAIL_FUSION"}) {
    try {
      TierPolicy::from_lookup([&](std::string_view name) -> std::optional<std::string> {
        if (name == variable) return hostile;
        return std::nullopt;
      });
      FAIL() << "expected Error for " << variable;
    } catch (const Error& error) {
      std::string message = error.what();
      EXPECT_TRUE(is_one_safe_line(message)) << message.substr(0, 200);
      EXPECT_LE(message.size(), kMaxMessageBytes);
      EXPECT_THAT(message, AllOf(HasSubstr(variable), HasSubstr("1\\n\\x1b]0;owned\\x07")));
    }
  }
}

}  // namespace
}  // namespace latentmoe

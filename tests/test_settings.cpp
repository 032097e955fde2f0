// The settings registry (src/core/settings.h): every environment variable the library reads is declared
// once, parsed by one function per type with one style of error, listed in docs/CONFIG.md from the
// declaration, and read nowhere else (no getenv, setenv or putenv in src/ or include/ outside
// src/core/settings.cpp).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "core/settings.h"
#include "error_test_util.h"
#include "latentmoe/error.h"
#include "latentmoe/gpu_group.h"
#include "latentmoe/tier.h"

namespace latentmoe::detail {
namespace {

using ::testing::HasSubstr;
using testing::message_of;

namespace fs = std::filesystem;

const fs::path kSourceDir = LATENTMOE_SOURCE_DIR;

std::string read_text(const fs::path& path) {
  std::ifstream file(path, std::ios::binary);
  std::ostringstream text;
  text << file.rdbuf();
  return text.str();
}

// Sets a variable for its lifetime and puts back what was there (also when a check fails).
class ScopedVariable {
 public:
  ScopedVariable(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) saved_ = old;
    if (value != nullptr) {
      ::setenv(name, value, 1);
    } else {
      ::unsetenv(name);
    }
  }
  ~ScopedVariable() {
    if (saved_) {
      ::setenv(name_, saved_->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }
  ScopedVariable(const ScopedVariable&) = delete;
  ScopedVariable& operator=(const ScopedVariable&) = delete;

 private:
  const char* name_;
  std::optional<std::string> saved_;
};

SettingLookup lookup_of(std::map<std::string, std::string> values) {
  return [values = std::move(values)](std::string_view name) -> std::optional<std::string> {
    auto it = values.find(std::string(name));
    if (it == values.end()) return std::nullopt;
    return it->second;
  };
}

TEST(SettingsRegistry, every_variable_is_declared_once_with_its_values_default_meaning_and_moment) {
  std::set<std::string_view> names;
  for (const SettingSpec& spec : kSettings) {
    SCOPED_TRACE(std::string(spec.name));
    EXPECT_TRUE(names.insert(spec.name).second) << "declared twice";
    EXPECT_EQ(&setting_spec(spec.id), &spec);
    EXPECT_FALSE(spec.meaning.empty());
    EXPECT_FALSE(spec.read_when.empty());
    EXPECT_TRUE(spec.fallback.has_value() || !spec.unset.empty()) << "says nothing of unset";
    EXPECT_EQ(spec.name.find('|'), std::string_view::npos);  // a Markdown cell each
    EXPECT_EQ(spec.meaning.find('|'), std::string_view::npos);
    EXPECT_EQ(spec.read_when.find('|'), std::string_view::npos);
    EXPECT_EQ(spec.unset.find('|'), std::string_view::npos);
    if (spec.type == SettingType::integer) {
      EXPECT_LE(spec.min, spec.max);
      for (int64_t value : spec.values) EXPECT_TRUE(value >= spec.min && value <= spec.max) << value;
      if (spec.fallback) EXPECT_TRUE(*spec.fallback >= spec.min && *spec.fallback <= spec.max);
    }
    if (spec.type == SettingType::boolean) {
      ASSERT_TRUE(spec.fallback.has_value());
      EXPECT_TRUE(*spec.fallback == 0 || *spec.fallback == 1);
    }
  }
  EXPECT_EQ(names.size(), 13u);
}

// The defaults the registry declares are the ones the library applies.
TEST(SettingsRegistry, declared_defaults_are_the_librarys) {
  EXPECT_EQ(setting_spec(Setting::tail_fusion_max_tokens).fallback, TierPolicy{}.tail_fusion_max_tokens);
  EXPECT_EQ(setting_spec(Setting::shared_stream_token_threshold).fallback, TierPolicy{}.shared_stream_token_threshold);
  EXPECT_EQ(setting_spec(Setting::disable_shared_stream).fallback, int64_t{TierPolicy{}.disable_shared_stream});
  EXPECT_EQ(setting_spec(Setting::disable_tail_fusion).fallback, int64_t{TierPolicy{}.disable_tail_fusion});
  EXPECT_EQ(setting_spec(Setting::collective_timeout_ms).fallback, GpuGroupOptions{}.timeout.count());
  const std::string one_shot(setting_spec(Setting::one_shot_max_tokens).unset);
  EXPECT_THAT(one_shot,
              HasSubstr(std::to_string(kDefaultOneShotTokensTwoRanks) + " (`kDefaultOneShotTokensTwoRanks`)"));
  EXPECT_THAT(one_shot, HasSubstr(std::to_string(kDefaultOneShotTokens) + " (`kDefaultOneShotTokens`)"));

  const ScopedVariable timeout("LATENTMOE_COLLECTIVE_TIMEOUT_MS", nullptr);
  const ScopedVariable one_shot_tokens("LATENTMOE_ONE_SHOT_MAX_TOKENS", nullptr);
  EXPECT_EQ(default_collective_timeout().count(), 30000);
  EXPECT_EQ(default_one_shot_tokens(2), 512);
  EXPECT_EQ(default_one_shot_tokens(4), 64);
}

TEST(SettingsRegistry, integers_are_digits_within_the_declared_range_or_values) {
  const SettingSpec& tokens = setting_spec(Setting::one_shot_max_tokens);
  EXPECT_EQ(parse_integer(tokens, "1"), 1);
  EXPECT_EQ(parse_integer(tokens, "0064"), 64);
  EXPECT_EQ(parse_integer(tokens, "1048576"), 1048576);
  for (const char* bad : {"", "x", "-3", "+3", " 3", "3 ", "3.0", "0x10", "1e3"}) {
    EXPECT_EQ(message_of([&] { parse_integer(tokens, bad); }),
              std::string("LATENTMOE_ONE_SHOT_MAX_TOKENS='") + bad +
                  "' is not an integer; expected an integer in 1..1048576 (tokens)");
  }
  for (const char* bad : {"0", "1048577", "99999999999999999999999"}) {
    EXPECT_EQ(message_of([&] { parse_integer(tokens, bad); }),
              std::string("LATENTMOE_ONE_SHOT_MAX_TOKENS='") + bad +
                  "' is out of range; expected an integer in 1..1048576 (tokens)");
  }
  const SettingSpec& split = setting_spec(Setting::mxfp4_gate_up_split);
  for (int64_t good : {1, 2, 8}) EXPECT_EQ(parse_integer(split, std::to_string(good)), good);
  for (const char* bad : {"0", "3", "4", "9"}) {
    EXPECT_EQ(message_of([&] { parse_integer(split, bad); }),
              std::string("LATENTMOE_MXFP4_GATE_UP_SPLIT='") + bad +
                  "' is out of range; expected 1, 2 or 8 (warps per tile)");
  }
  const SettingSpec& threshold = setting_spec(Setting::shared_stream_token_threshold);
  EXPECT_EQ(parse_integer(threshold, "9223372036854775807"), std::numeric_limits<int64_t>::max());
  EXPECT_EQ(message_of([&] { parse_integer(threshold, "9223372036854775808"); }),
            "LATENTMOE_SHARED_STREAM_TOKEN_THRESHOLD='9223372036854775808' is out of range; expected an integer >= 0 "
            "(tokens)");
}

TEST(SettingsRegistry, booleans_take_four_spellings_of_each_in_any_case) {
  const SettingSpec& flag = setting_spec(Setting::disable_tail_fusion);
  for (const char* on : {"1", "true", "TRUE", "Yes", "on"}) EXPECT_TRUE(parse_boolean(flag, on)) << on;
  for (const char* off : {"0", "false", "No", "OFF"}) EXPECT_FALSE(parse_boolean(flag, off)) << off;
  EXPECT_EQ(message_of([&] { parse_boolean(flag, "enable"); }),
            "LATENTMOE_DISABLE_TAIL_FUSION='enable' is not a boolean; expected 0/1, true/false, yes/no or on/off");
}

TEST(SettingsRegistry, a_read_asks_the_declared_name_and_takes_empty_as_unset) {
  std::vector<std::string> asked;
  const SettingLookup recording = [&](std::string_view name) -> std::optional<std::string> {
    asked.emplace_back(name);
    return std::nullopt;
  };
  EXPECT_EQ(read_integer(Setting::collective_timeout_ms, recording), std::nullopt);
  EXPECT_EQ(read_boolean(Setting::disable_shared_stream, recording), std::nullopt);
  EXPECT_EQ(asked, (std::vector<std::string>{"LATENTMOE_COLLECTIVE_TIMEOUT_MS", "LATENTMOE_DISABLE_SHARED_STREAM"}));
  EXPECT_EQ(read_integer(Setting::collective_timeout_ms, lookup_of({{"LATENTMOE_COLLECTIVE_TIMEOUT_MS", ""}})),
            std::nullopt);
  EXPECT_EQ(read_integer(Setting::collective_timeout_ms, lookup_of({{"LATENTMOE_COLLECTIVE_TIMEOUT_MS", "1500"}})),
            1500);
  EXPECT_EQ(read_boolean(Setting::disable_shared_stream, lookup_of({{"LATENTMOE_DISABLE_SHARED_STREAM", "yes"}})),
            true);
  // A reader of the wrong type is a bug of the library, said as such.
  EXPECT_THAT(message_of([] { read_boolean(Setting::collective_timeout_ms); }),
              HasSubstr("internal error: LATENTMOE_COLLECTIVE_TIMEOUT_MS is not a boolean setting"));
}

TEST(SettingsRegistry, the_environment_is_read_when_asked_and_only_for_declared_names) {
  {
    const ScopedVariable set("LATENTMOE_COLLECTIVE_TIMEOUT_MS", "2500");
    EXPECT_EQ(environment_value("LATENTMOE_COLLECTIVE_TIMEOUT_MS"), "2500");
    EXPECT_EQ(integer_setting(Setting::collective_timeout_ms), 2500);
    EXPECT_EQ(default_collective_timeout().count(), 2500);
  }
  {
    const ScopedVariable empty("LATENTMOE_COLLECTIVE_TIMEOUT_MS", "");
    EXPECT_EQ(integer_setting(Setting::collective_timeout_ms), 30000);
  }
  {
    const ScopedVariable bad("LATENTMOE_COLLECTIVE_TIMEOUT_MS", "0");
    EXPECT_EQ(message_of([] { default_collective_timeout(); }),
              "LATENTMOE_COLLECTIVE_TIMEOUT_MS='0' is out of range; expected an integer in 1..3600000 (milliseconds)");
  }
  {
    const ScopedVariable path("LATENTMOE_TUNE_FILE", "/tmp/t.json");
    EXPECT_EQ(read_path(Setting::tune_file), "/tmp/t.json");
  }
  {
    const ScopedVariable none("LATENTMOE_TUNE_FILE", nullptr);
    EXPECT_EQ(read_path(Setting::tune_file), std::nullopt);
  }
  const ScopedVariable home("HOME", "/somewhere");
  EXPECT_EQ(message_of([] { environment_value("HOME"); }),
            "internal error: environment variable HOME is read but not declared in the settings registry "
            "(src/core/settings.h)");
}

// docs/CONFIG.md's table between the markers is settings_markdown() to the byte. On a difference the test
// prints the table; LATENTMOE_REGENERATE_DOCS=1 writes it into the file (then review and commit).
TEST(SettingsDocs, config_md_lists_the_registrys_variables_as_declared) {
  const fs::path path = kSourceDir / "docs" / "CONFIG.md";
  std::string text = read_text(path);
  const std::string begin = "<!-- settings table: generated from src/core/settings.h -->\n";
  const std::string end = "<!-- end of settings table -->";
  const size_t from = text.find(begin);
  ASSERT_NE(from, std::string::npos) << path << " lacks the line " << begin;
  const size_t body = from + begin.size();
  const size_t to = text.find(end, body);
  ASSERT_NE(to, std::string::npos) << path << " lacks the line " << end;
  const std::string expected = settings_markdown();
  if (const char* regenerate = std::getenv("LATENTMOE_REGENERATE_DOCS"); regenerate && std::string(regenerate) == "1") {
    text.replace(body, to - body, expected);
    std::ofstream(path, std::ios::binary) << text;
    return;
  }
  EXPECT_EQ(text.substr(body, to - body), expected)
      << "docs/CONFIG.md's settings table differs from the registry; rerun this test with "
         "LATENTMOE_REGENERATE_DOCS=1 to write it, or paste:\n"
      << expected;
  // Every declared name in it, and no other variable row.
  std::set<std::string> rows;
  std::istringstream lines(text.substr(body, to - body));
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("| `", 0) != 0) continue;
    const size_t close = line.find('`', 3);
    ASSERT_NE(close, std::string::npos) << line;
    rows.insert(line.substr(3, close - 3));
  }
  std::set<std::string> declared;
  for (const SettingSpec& spec : kSettings) declared.emplace(spec.name);
  EXPECT_EQ(rows, declared);
}

bool identifier_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }

// `source` with its comments and the contents of its string and character literals blanked, so that prose
// and messages may name the functions (a simple lexer: enough for this code base's sources).
std::string code_only(const std::string& source) {
  std::string out = source;
  size_t i = 0;
  auto blank = [&](size_t from, size_t to) {
    for (size_t k = from; k < to && k < out.size(); ++k)
      if (out[k] != '\n') out[k] = ' ';
  };
  while (i < source.size()) {
    if (source.compare(i, 2, "//") == 0) {
      const size_t end = source.find('\n', i);
      blank(i, end == std::string::npos ? source.size() : end);
      i = end == std::string::npos ? source.size() : end;
    } else if (source.compare(i, 2, "/*") == 0) {
      const size_t end = source.find("*/", i + 2);
      const size_t stop = end == std::string::npos ? source.size() : end + 2;
      blank(i, stop);
      i = stop;
    } else if (source[i] == 'R' && i + 1 < source.size() && source[i + 1] == '"' &&
               (i == 0 || !identifier_char(source[i - 1]))) {
      const size_t open = source.find('(', i + 2);
      if (open == std::string::npos) break;
      const std::string close = ")" + source.substr(i + 2, open - i - 2) + "\"";
      const size_t end = source.find(close, open);
      const size_t stop = end == std::string::npos ? source.size() : end + close.size();
      blank(i, stop);
      i = stop;
    } else if (source[i] == '"' ||
               (source[i] == '\'' && (i == 0 || !std::isxdigit(static_cast<unsigned char>(source[i - 1]))))) {
      const char quote = source[i];
      size_t k = i + 1;
      while (k < source.size() && source[k] != quote && source[k] != '\n') k += source[k] == '\\' ? 2 : 1;
      blank(i, k + 1);
      i = k + 1;
    } else {
      ++i;
    }
  }
  return out;
}

// The first call of a function that reads or writes the process environment in `code`, or "".
std::string environment_access(const std::string& code) {
  for (const std::string name : {"secure_getenv", "getenv", "setenv", "unsetenv", "putenv", "clearenv", "environ"}) {
    for (size_t at = code.find(name); at != std::string::npos; at = code.find(name, at + 1)) {
      if (at > 0 && identifier_char(code[at - 1])) continue;
      size_t after = at + name.size();
      if (after < code.size() && identifier_char(code[after])) continue;
      if (name == "environ") return name;  // the variable itself
      while (after < code.size() && std::isspace(static_cast<unsigned char>(code[after]))) ++after;
      if (after < code.size() && code[after] == '(') return name + "(";
    }
  }
  return "";
}

TEST(SettingsSources, only_the_registry_touches_the_environment) {
  EXPECT_EQ(environment_access(code_only("// getenv(\"X\")\nconst char* m = \"setenv(\";\n")), "");
  EXPECT_EQ(environment_access(code_only("int x = 0; const char* v = std::getenv (\"X\");")), "getenv(");
  EXPECT_EQ(environment_access(code_only("extern char** environ;")), "environ");
  EXPECT_EQ(environment_access(code_only("my_getenv(1); getenv_name = 2;")), "");
  std::vector<std::string> offenders;
  int scanned = 0;
  for (const char* folder : {"src", "include"}) {
    for (const auto& entry : fs::recursive_directory_iterator(kSourceDir / folder)) {
      if (!entry.is_regular_file()) continue;
      const std::string ext = entry.path().extension().string();
      if (ext != ".h" && ext != ".cpp" && ext != ".cu" && ext != ".cuh" && ext != ".hpp" && ext != ".inc") continue;
      const std::string relative = fs::relative(entry.path(), kSourceDir).generic_string();
      ++scanned;
      const std::string access = environment_access(code_only(read_text(entry.path())));
      if (relative == "src/core/settings.cpp") {
        EXPECT_EQ(access, "getenv(") << "the registry reads the environment";
      } else if (!access.empty()) {
        offenders.push_back(relative + ": " + access);
      }
    }
  }
  EXPECT_GT(scanned, 50);  // the folders were found
  EXPECT_TRUE(offenders.empty()) << "the environment is read or written outside src/core/settings.cpp: "
                                 << ::testing::PrintToString(offenders);
}

}  // namespace
}  // namespace latentmoe::detail

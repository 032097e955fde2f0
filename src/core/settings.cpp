// The settings registry (core/settings.h): the library's only read of the process environment.
#include "core/settings.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdlib>

#include "latentmoe/error.h"

namespace latentmoe::detail {
namespace {

// kSettings is indexed by Setting: a row out of place would make one variable read as another.
constexpr bool table_in_order() {
  for (size_t i = 0; i < kSettings.size(); ++i) {
    if (static_cast<size_t>(kSettings[i].id) != i) return false;
  }
  return true;
}
static_assert(table_in_order(), "kSettings must list the settings in the order of enum Setting");

// "an integer in 1..1048576 (tokens)", "an integer >= 0 (tokens)", "1, 2 or 8 (warps per tile)".
std::string expected_integer(const SettingSpec& spec) {
  std::string text;
  if (!spec.values.empty()) {
    for (size_t i = 0; i < spec.values.size(); ++i) {
      if (i > 0) text += i + 1 == spec.values.size() ? " or " : ", ";
      text += std::to_string(spec.values[i]);
    }
  } else if (spec.max == std::numeric_limits<int64_t>::max()) {
    text = "an integer >= " + std::to_string(spec.min);
  } else {
    text = "an integer in " + std::to_string(spec.min) + ".." + std::to_string(spec.max);
  }
  if (!spec.unit.empty()) text += " (" + std::string(spec.unit) + ")";
  return text;
}

constexpr std::string_view kBooleanValues = "0/1, true/false, yes/no or on/off";

// Indexed by SettingType.
constexpr std::string_view kTypeNames[] = {"integer", "boolean", "path"};
std::string_view type_name(SettingType type) { return kTypeNames[static_cast<size_t>(type)]; }

}  // namespace

const SettingSpec& setting_spec(Setting id) { return kSettings[static_cast<size_t>(id)]; }

std::optional<std::string> environment_value(std::string_view name) {
  const bool declared =
      std::any_of(kSettings.begin(), kSettings.end(), [&](const SettingSpec& spec) { return spec.name == name; });
  LATENTMOE_CHECK(declared, "internal error: environment variable ", name,
                  " is read but not declared in the settings registry (src/core/settings.h)");
  // The one getenv of the library (tests/test_settings.cpp holds every other source to that).
  const char* value = std::getenv(std::string(name).c_str());
  if (value == nullptr) return std::nullopt;
  return std::string(value);
}

int64_t parse_integer(const SettingSpec& spec, std::string_view text) {
  const bool digits_only = !text.empty() && std::all_of(text.begin(), text.end(), [](char c) {
    return std::isdigit(static_cast<unsigned char>(c));
  });
  if (!digits_only)
    detail::throw_error(spec.name, "='", text, "' is not an integer; expected ", expected_integer(spec));
  int64_t value = 0;
  const char* last = text.data() + text.size();
  const auto [end, ec] = std::from_chars(text.data(), last, value);
  const bool listed =
      spec.values.empty() || std::find(spec.values.begin(), spec.values.end(), value) != spec.values.end();
  if (ec != std::errc() || end != last || value < spec.min || value > spec.max || !listed) {
    detail::throw_error(spec.name, "='", text, "' is out of range; expected ", expected_integer(spec));
  }
  return value;
}

bool parse_boolean(const SettingSpec& spec, std::string_view text) {
  std::string lower;
  for (char c : text) lower.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  if (lower == "1" || lower == "true" || lower == "yes" || lower == "on") return true;
  if (lower == "0" || lower == "false" || lower == "no" || lower == "off") return false;
  detail::throw_error(spec.name, "='", text, "' is not a boolean; expected ", kBooleanValues);
}

namespace {

// The text of `id` from `lookup`, nullopt when unset or empty; `type` is what the caller parses it as.
std::optional<std::string> text_of(Setting id, SettingType type, const SettingLookup& lookup) {
  const SettingSpec& spec = setting_spec(id);
  LATENTMOE_CHECK(spec.type == type, "internal error: ", spec.name, " is not a",
                  type == SettingType::integer ? "n" : "", " ", type_name(type), " setting");
  std::optional<std::string> text = lookup(spec.name);
  if (text.has_value() && text->empty()) return std::nullopt;
  return text;
}

}  // namespace

std::optional<int64_t> read_integer(Setting id) { return read_integer(id, environment_value); }

std::optional<int64_t> read_integer(Setting id, const SettingLookup& lookup) {
  const std::optional<std::string> text = text_of(id, SettingType::integer, lookup);
  return text ? std::optional<int64_t>(parse_integer(setting_spec(id), *text)) : std::nullopt;
}

std::optional<bool> read_boolean(Setting id) { return read_boolean(id, environment_value); }

std::optional<bool> read_boolean(Setting id, const SettingLookup& lookup) {
  const std::optional<std::string> text = text_of(id, SettingType::boolean, lookup);
  return text ? std::optional<bool>(parse_boolean(setting_spec(id), *text)) : std::nullopt;
}

std::optional<std::string> read_path(Setting id) { return text_of(id, SettingType::path, environment_value); }

int64_t integer_setting(Setting id) {
  const SettingSpec& spec = setting_spec(id);
  LATENTMOE_CHECK(spec.fallback.has_value(), "internal error: ", spec.name, " has no single default");
  return read_integer(id).value_or(*spec.fallback);
}

std::string settings_markdown() {
  std::string text =
      "| variable | values | unset | meaning | read |\n"
      "|---|---|---|---|---|\n";
  for (const SettingSpec& spec : kSettings) {
    text.append("| `").append(spec.name).append("` | ");
    switch (spec.type) {
      case SettingType::integer:
        text += expected_integer(spec);
        break;
      case SettingType::boolean:
        text.append("boolean: ").append(kBooleanValues);
        break;
      case SettingType::path:
        text += type_name(spec.type);
        break;
    }
    text += " | ";
    if (spec.fallback.has_value()) {
      const bool boolean = spec.type == SettingType::boolean;
      text.append("`").append(boolean ? (*spec.fallback != 0 ? "true" : "false") : std::to_string(*spec.fallback));
      text.append(spec.unset.empty() ? "`" : "` ");
    }
    text.append(spec.unset).append(" | ").append(spec.meaning).append(" | ").append(spec.read_when).append(" |\n");
  }
  return text;
}

}  // namespace latentmoe::detail

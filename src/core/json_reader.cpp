// The JSON reader of json_reader.h: bounded nesting, duplicate keys refused, typed values, short
// renderings of values for error messages.
#include "core/json_reader.h"

#include <algorithm>
#include <limits>
#include <nlohmann/json.hpp>
#include <unordered_set>
#include <vector>

namespace latentmoe::detail {
namespace {

using nlohmann::json;

// Appends a rendering of `value` to `out`, stopping soon after `out` reaches `budget` bytes: never
// dumps a whole (possibly huge) value. Recursion is bounded by parse_json's max_depth.
void render(const json& value, std::string& out, size_t budget) {
  if (out.size() >= budget) return;
  switch (value.type()) {
    case json::value_t::object: {
      out += '{';
      bool first = true;
      for (const auto& [key, member] : value.items()) {
        if (out.size() >= budget) return;
        if (!first) out += ',';
        first = false;
        render(json(key), out, budget);
        out += ':';
        render(member, out, budget);
      }
      out += '}';
      return;
    }
    case json::value_t::array: {
      out += '[';
      bool first = true;
      for (const json& element : value) {
        if (out.size() >= budget) return;
        if (!first) out += ',';
        first = false;
        render(element, out, budget);
      }
      out += ']';
      return;
    }
    case json::value_t::string: {
      const auto& text = value.get_ref<const std::string&>();
      // A prefix only; a cut UTF-8 sequence is replaced rather than thrown on.
      json prefix = text.substr(0, std::min<size_t>(text.size(), budget - out.size() + 1));
      out += prefix.dump(-1, ' ', false, json::error_handler_t::replace);
      return;
    }
    default:
      out += value.dump();  // a number, boolean or null: short
  }
}

// Drops nlohmann's "[json.exception.parse_error.101] " tag, keeping the position and the reason.
std::string parse_error_text(const json::exception& error) {
  std::string text = error.what();
  if (!text.empty() && text.front() == '[') {
    size_t end = text.find("] ");
    if (end != std::string::npos) text = text.substr(end + 2);
  }
  return text;
}

// Refuses JSON nested deeper than max_depth before nlohmann sees it (its parser, destructor
// and dump recurse, so 100000 levels of [[[... would overflow the stack): a linear scan counting
// [ and { outside strings.
void check_nesting(std::string_view text, std::string_view source, int max_depth) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;  // the escaped character, a quote included
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) {
        size_t line = 1, line_start = 0;
        for (size_t k = 0; k < i; ++k) {
          if (text[k] == '\n') {
            ++line;
            line_start = k + 1;
          }
        }
        throw_error(source, ": invalid JSON: nested deeper than ", max_depth, " levels at line ", line, ", column ",
                    i - line_start + 1);
      }
    } else if (c == ']' || c == '}') {
      if (depth > 0) --depth;
    }
  }
}

// A SAX pass that rejects a key given twice in one object (nlohmann would keep the last silently),
// naming the key and the keys of the objects around it. It runs before the ordinary DOM parse:
// nlohmann's callback parser rescans the parent after every nested value ends, which makes a
// config of n small objects cost O(n^2) (seconds for a 1 MB file).
class DuplicateKeyCheck : public nlohmann::json_sax<json> {
 public:
  explicit DuplicateKeyCheck(std::string_view source) : source_(source) {}

  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override {
    frames_.push_back({true, {}, {}});
    return true;
  }
  bool start_array(std::size_t) override {
    frames_.push_back({false, {}, {}});
    return true;
  }
  bool end_object() override { return pop(); }
  bool end_array() override { return pop(); }
  bool key(string_t& key) override {
    if (frames_.empty()) return true;
    Frame& frame = frames_.back();
    if (!frame.keys.insert(key).second) report(key);
    frame.last_key = key;
    return true;
  }
  // Syntax errors are left to the DOM parse that follows, which reports them with their position.
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override { return false; }

 private:
  struct Frame {
    bool is_object;
    std::unordered_set<std::string> keys;
    std::string last_key;
  };

  bool pop() {
    if (!frames_.empty()) frames_.pop_back();
    return true;
  }

  [[noreturn]] void report(const std::string& key) const {
    std::string where;
    for (size_t i = 0; i + 1 < frames_.size(); ++i) {
      if (frames_[i].is_object) {
        if (!where.empty()) where += '.';
        where += frames_[i].last_key;
      } else {
        where += "[]";
      }
    }
    if (where.empty()) throw_error(source_, ": duplicate key '", key, "'");
    throw_error(source_, ": duplicate key '", key, "' in '", where, "'");
  }

  std::string_view source_;
  std::vector<Frame> frames_;
};

}  // namespace

const json* json_member(const json& object, std::string_view key) {
  auto it = object.find(key);
  if (it == object.end() || it->is_null()) return nullptr;
  return &*it;
}

std::string describe_json(const json& value) {
  constexpr size_t kMaxChars = 48;
  std::string text;
  render(value, text, kMaxChars + 1);
  if (text.size() > kMaxChars) {
    size_t cut = kMaxChars - 3;
    while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xc0) == 0x80) --cut;  // a character boundary
    text = text.substr(0, cut) + "...";
  }
  return text;
}

std::string_view json_type_name(const json& value) {
  switch (value.type()) {
    case json::value_t::object:
      return "an object";
    case json::value_t::array:
      return "an array";
    case json::value_t::string:
      return "a string";
    case json::value_t::boolean:
      return "a boolean";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned:
      return "an integer";
    case json::value_t::number_float:
      return "a number";
    default:
      return "null";
  }
}

json parse_json(std::string_view text, std::string_view source, int max_depth) {
  check_nesting(text, source, max_depth);
  json root;
  try {
    DuplicateKeyCheck duplicates(source);
    json::sax_parse(text.begin(), text.end(), &duplicates);
    root = json::parse(text.begin(), text.end());
  } catch (const json::exception& error) {  // parse_error, or out_of_range for a number like 1e400
    throw_error(source, ": invalid JSON: ", parse_error_text(error));
  }
  return root;
}

JsonReader::Found JsonReader::find(std::string_view key, std::string_view alias) const {
  const json* primary = json_member(object_, key);
  const json* secondary = alias.empty() ? nullptr : json_member(object_, alias);
  if (primary != nullptr && secondary != nullptr && *primary != *secondary) {
    fail("'", key, "' (", describe_json(*primary), ") and its alias '", alias, "' (", describe_json(*secondary),
         ") disagree; give one of them");
  }
  if (primary != nullptr) return {primary, key};
  if (secondary != nullptr) return {secondary, alias};
  return {};
}

int64_t JsonReader::required_int(std::string_view key, std::string_view alias) const {
  return as_int(require(key, alias));
}

int64_t JsonReader::optional_int(std::string_view key, std::string_view alias, int64_t fallback) const {
  Found found = find(key, alias);
  return found.value == nullptr ? fallback : as_int(found);
}

double JsonReader::optional_double(std::string_view key, double fallback) const {
  Found found = find(key);
  return found.value == nullptr ? fallback : as_double(found);
}

bool JsonReader::optional_bool(std::string_view key, std::string_view alias, bool fallback) const {
  Found found = find(key, alias);
  return found.value == nullptr ? fallback : as_bool(found);
}

std::optional<std::string> JsonReader::optional_string(std::string_view key) const {
  Found found = find(key);
  if (found.value == nullptr) return std::nullopt;
  return as_string(found);
}

std::string JsonReader::required_string(std::string_view key) const { return as_string(require(key, {})); }

JsonReader::Found JsonReader::require(std::string_view key, std::string_view alias) const {
  Found found = find(key, alias);
  if (found.value == nullptr) {
    if (alias.empty()) fail("missing required key '", key, "'");
    fail("missing required key '", key, "' (or its alias '", alias, "')");
  }
  return found;
}

// Integers must be JSON integers: 8.0, "8" and true are rejected rather than guessed at.
int64_t JsonReader::as_int(const Found& found) const {
  const json& value = *found.value;
  if (value.is_number_unsigned()) {
    auto number = value.get<uint64_t>();
    if (number > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      fail("'", found.key, "' is out of range: ", describe_json(value));
    }
    return static_cast<int64_t>(number);
  }
  if (value.is_number_integer()) return value.get<int64_t>();
  fail("'", found.key, "' must be an integer, got ", json_type_name(value), " (", describe_json(value), ")");
}

double JsonReader::as_double(const Found& found) const {
  const json& value = *found.value;
  if (!value.is_number()) {
    fail("'", found.key, "' must be a number, got ", json_type_name(value), " (", describe_json(value), ")");
  }
  return value.get<double>();
}

// Booleans must be JSON true/false: 0 and 1 are rejected (HF configs always write true/false).
bool JsonReader::as_bool(const Found& found) const {
  const json& value = *found.value;
  if (!value.is_boolean()) {
    fail("'", found.key, "' must be true or false, got ", json_type_name(value), " (", describe_json(value), ")");
  }
  return value.get<bool>();
}

std::string JsonReader::as_string(const Found& found) const {
  const json& value = *found.value;
  if (!value.is_string()) {
    fail("'", found.key, "' must be a string, got ", json_type_name(value), " (", describe_json(value), ")");
  }
  return value.get<std::string>();
}

}  // namespace latentmoe::detail

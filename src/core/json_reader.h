// Reading a small JSON document (a layer config) as hostile input, with errors that name the source
// and the key: parse_json refuses deep nesting before nlohmann's recursive parser sees it and a key
// given twice in one object (nlohmann would keep the last silently); JsonReader reads typed values
// from an object without guessing (8.0, "8" and true are not integers; 0 and 1 are not booleans);
// describe_json renders a value for an error message in at most 48 characters, however large the
// value. The caller bounds the text's size first (bounded_file.h reads at most that many bytes).
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "latentmoe/error.h"

namespace latentmoe::detail {

// The document in `text`. Errors (an Error, each starting with "<source>: "):
//   "invalid JSON: nested deeper than <max_depth> levels at line L, column C" (arrays and objects),
//   "duplicate key 'k'" or "duplicate key 'k' in 'a.b[]'" (the keys of the objects around it),
//   "invalid JSON: <nlohmann's position and reason>" (syntax, or a number like 1e400).
nlohmann::json parse_json(std::string_view text, std::string_view source, int max_depth);

// The value under `key` in `object`; null where there is none or it is JSON null (null counts as
// absent everywhere a config is read).
const nlohmann::json* json_member(const nlohmann::json& object, std::string_view key);

// A short rendering of `value` for error messages (at most 48 characters, "..." where cut).
std::string describe_json(const nlohmann::json& value);

// "an object", "an array", "a string", "a boolean", "an integer", "a number" or "null".
std::string_view json_type_name(const nlohmann::json& value);

// Reads typed values from one object (which outlives the reader); every error names `source` and
// the key. A null value counts as absent.
class JsonReader {
 public:
  JsonReader(const nlohmann::json& object, std::string_view source) : object_(object), source_(source) {}

  struct Found {
    const nlohmann::json* value = nullptr;
    std::string_view key;  // the name under which it was found
  };

  // The value under `key` or `alias` (null counts as absent); both present and different: Error.
  Found find(std::string_view key, std::string_view alias = {}) const;
  bool has(std::string_view key, std::string_view alias = {}) const { return find(key, alias).value != nullptr; }

  int64_t required_int(std::string_view key, std::string_view alias = {}) const;
  int64_t optional_int(std::string_view key, std::string_view alias, int64_t fallback) const;
  double optional_double(std::string_view key, double fallback) const;
  bool optional_bool(std::string_view key, std::string_view alias, bool fallback) const;
  std::optional<std::string> optional_string(std::string_view key) const;
  std::string required_string(std::string_view key) const;

  // Throws "<source>: <parts...>".
  template <class... Parts>
  [[noreturn]] void fail(Parts&&... parts) const {
    throw_error(source_, ": ", std::forward<Parts>(parts)...);
  }

 private:
  Found require(std::string_view key, std::string_view alias) const;
  int64_t as_int(const Found& found) const;
  double as_double(const Found& found) const;
  bool as_bool(const Found& found) const;
  std::string as_string(const Found& found) const;

  const nlohmann::json& object_;
  std::string_view source_;
};

}  // namespace latentmoe::detail

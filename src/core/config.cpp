// LayerConfig parsing and validation. The accepted keys, aliases, types and rules are documented in
// docs/CONFIG.md; keep the two in step.
#include "latentmoe/config.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <string>
#include <unordered_set>
#include <vector>

#include "core/bounded_file.h"
#include "latentmoe/error.h"
#include "latentmoe/mxfp4.h"

namespace latentmoe {
namespace {

using nlohmann::json;

// Every size must fit in an int32 so that kernels may index a single dimension with int.
constexpr int64_t kMaxDimension = std::numeric_limits<int32_t>::max();

// Appends a rendering of `value` to `out`, stopping soon after `out` reaches `budget` bytes: never
// dumps a whole (possibly huge) value. Recursion is bounded by kMaxConfigDepth (checked before parsing).
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

// A short rendering of a JSON value for error messages.
std::string describe(const json& value) {
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

std::string_view type_name(const json& value) {
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

// Reads typed values from the top-level object; every error names `source` and the key.
class Reader {
 public:
  Reader(const json& root, std::string_view source) : root_(root), source_(source) {}

  struct Found {
    const json* value = nullptr;
    std::string_view key;  // the name under which it was found
  };

  // The value under `key` or `alias` (null counts as absent); both present and different: Error.
  Found find(std::string_view key, std::string_view alias = {}) const {
    const json* primary = lookup(key);
    const json* secondary = alias.empty() ? nullptr : lookup(alias);
    if (primary != nullptr && secondary != nullptr && *primary != *secondary) {
      fail("'", key, "' (", describe(*primary), ") and its alias '", alias, "' (", describe(*secondary),
           ") disagree; give one of them");
    }
    if (primary != nullptr) return {primary, key};
    if (secondary != nullptr) return {secondary, alias};
    return {};
  }

  bool has(std::string_view key, std::string_view alias = {}) const { return find(key, alias).value != nullptr; }

  int64_t required_int(std::string_view key, std::string_view alias = {}) const { return as_int(require(key, alias)); }
  int64_t optional_int(std::string_view key, std::string_view alias, int64_t fallback) const {
    Found found = find(key, alias);
    return found.value == nullptr ? fallback : as_int(found);
  }
  double optional_double(std::string_view key, double fallback) const {
    Found found = find(key);
    return found.value == nullptr ? fallback : as_double(found);
  }
  bool optional_bool(std::string_view key, std::string_view alias, bool fallback) const {
    Found found = find(key, alias);
    return found.value == nullptr ? fallback : as_bool(found);
  }
  std::optional<std::string> optional_string(std::string_view key) const {
    Found found = find(key);
    if (found.value == nullptr) return std::nullopt;
    return as_string(found);
  }
  std::string required_string(std::string_view key) const { return as_string(require(key, {})); }

  template <class... Parts>
  [[noreturn]] void fail(Parts&&... parts) const {
    detail::throw_error(source_, ": ", std::forward<Parts>(parts)...);
  }

 private:
  const json* lookup(std::string_view key) const {
    auto it = root_.find(key);
    if (it == root_.end() || it->is_null()) return nullptr;
    return &*it;
  }

  Found require(std::string_view key, std::string_view alias) const {
    Found found = find(key, alias);
    if (found.value == nullptr) {
      if (alias.empty()) fail("missing required key '", key, "'");
      fail("missing required key '", key, "' (or its alias '", alias, "')");
    }
    return found;
  }

  // Integers must be JSON integers: 8.0, "8" and true are rejected rather than guessed at.
  int64_t as_int(const Found& found) const {
    const json& value = *found.value;
    if (value.is_number_unsigned()) {
      auto number = value.get<uint64_t>();
      if (number > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        fail("'", found.key, "' is out of range: ", describe(value));
      }
      return static_cast<int64_t>(number);
    }
    if (value.is_number_integer()) return value.get<int64_t>();
    fail("'", found.key, "' must be an integer, got ", type_name(value), " (", describe(value), ")");
  }

  double as_double(const Found& found) const {
    const json& value = *found.value;
    if (!value.is_number()) {
      fail("'", found.key, "' must be a number, got ", type_name(value), " (", describe(value), ")");
    }
    return value.get<double>();
  }

  // Booleans must be JSON true/false: 0 and 1 are rejected (HF configs always write true/false).
  bool as_bool(const Found& found) const {
    const json& value = *found.value;
    if (!value.is_boolean()) {
      fail("'", found.key, "' must be true or false, got ", type_name(value), " (", describe(value), ")");
    }
    return value.get<bool>();
  }

  std::string as_string(const Found& found) const {
    const json& value = *found.value;
    if (!value.is_string()) {
      fail("'", found.key, "' must be a string, got ", type_name(value), " (", describe(value), ")");
    }
    return value.get<std::string>();
  }

  const json& root_;
  std::string_view source_;
};

void check_size(std::string_view key, int64_t value, bool allow_zero) {
  if (allow_zero) {
    LATENTMOE_CHECK(value >= 0, key, " must be >= 0, got ", value);
  } else {
    LATENTMOE_CHECK(value > 0, key, " must be positive, got ", value);
  }
  LATENTMOE_CHECK(value <= kMaxDimension, key, " ", value, " exceeds the limit ", kMaxDimension);
}

void check_positive_finite(std::string_view key, double value) {
  LATENTMOE_CHECK(std::isfinite(value) && value > 0, key, " must be finite and > 0, got ", value);
}

// a * b * ... without overflow; nullopt when the product does not fit in int64.
std::optional<int64_t> checked_product(std::initializer_list<int64_t> factors) {
  int64_t product = 1;
  for (int64_t factor : factors) {
    if (factor != 0 && product > std::numeric_limits<int64_t>::max() / factor) return std::nullopt;
    product *= factor;
  }
  return product;
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

// Refuses JSON nested deeper than kMaxConfigDepth before nlohmann sees it (its parser, destructor
// and dump recurse, so 100000 levels of [[[... would overflow the stack): a linear scan counting
// [ and { outside strings.
void check_nesting(std::string_view text, std::string_view source) {
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
      if (++depth > kMaxConfigDepth) {
        size_t line = 1, line_start = 0;
        for (size_t k = 0; k < i; ++k) {
          if (text[k] == '\n') {
            ++line;
            line_start = k + 1;
          }
        }
        detail::throw_error(source, ": invalid JSON: nested deeper than ", kMaxConfigDepth, " levels at line ", line,
                            ", column ", i - line_start + 1);
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
    if (where.empty()) detail::throw_error(source_, ": duplicate key '", key, "'");
    detail::throw_error(source_, ": duplicate key '", key, "' in '", where, "'");
  }

  std::string_view source_;
  std::vector<Frame> frames_;
};

// --- quantization_config (compressed-tensors) ---------------------------------------------------

// Module names of one routed expert's projection as checkpoints spell them: the quantization's
// targets and ignore list are matched against these (the config does not know the layer's prefix).
// **decision** (docs/CONFIG.md): a projection is covered when any of these names is matched by a
// config group's targets and not by the ignore list. Layer 1, because layer 0 is a dense layer in
// DeepSeek-style models and is sometimes ignored by name.
constexpr std::string_view kExpertModulePrefixes[] = {
    "model.layers.1.block_sparse_moe.experts.0.",
    "model.layers.1.mlp.experts.0.",
    "language_model.model.layers.1.block_sparse_moe.experts.0.",
    "language_model.model.layers.1.mlp.experts.0.",
};
constexpr std::string_view kMxfp4Format = "mxfp4-pack-quantized";
constexpr size_t kMaxPatternBytes = 1024;

// Reads the quantization_config object; every error names the key by its path under it.
class QuantizationReader {
 public:
  QuantizationReader(const json& config, std::string_view source) : config_(config), source_(source) {}

  ExpertWeightFormat experts_format(bool gated) const {
    if (!config_.is_object()) fail("'quantization_config' must be an object, got ", type_name(config_));
    const std::string method = string_at(config_, "quantization_config.quant_method", "quant_method", true);
    if (method != "compressed-tensors") {
      // Other methods (fp8 blocks, GPTQ, ...) describe their coverage in their own ways; whatever they
      // cover, latentmoe cannot read it, and loading bf16 names would fail later with a vaguer message.
      fail("quantization_config.quant_method '", method,
           "' is not supported; latentmoe reads compressed-tensors (mxfp4-pack-quantized routed experts)");
    }
    const std::vector<Pattern> ignore = patterns(config_, "quantization_config.ignore", "ignore");
    const json* groups = member(config_, "config_groups");
    if (groups != nullptr && !groups->is_object()) {
      fail("'quantization_config.config_groups' must be an object, got ", type_name(*groups));
    }

    // Each group's targets, compiled once.
    std::vector<std::pair<std::string, std::vector<Pattern>>> group_targets;
    if (groups != nullptr) {
      for (const auto& [group_name, group] : groups->items()) {
        const std::string path = "quantization_config.config_groups." + group_name;
        if (!group.is_object()) fail("'", path, "' must be an object, got ", type_name(group));
        group_targets.emplace_back(group_name, patterns(group, path + ".targets", "targets"));
      }
    }

    // Which group covers each projection (w1 gate, w3 up, w2 down); "" when none.
    std::vector<std::string_view> projections = {"w3", "w2"};
    if (gated) projections.insert(projections.begin(), "w1");
    std::vector<std::string> covering(projections.size());
    for (size_t p = 0; p < projections.size(); ++p) {
      for (std::string_view module_prefix : kExpertModulePrefixes) {
        const std::string name = std::string(module_prefix) + std::string(projections[p]);
        if (matches_any(ignore, name)) continue;
        for (const auto& [group_name, targets] : group_targets) {
          if (!matches_any(targets, name, /*linear_class=*/true)) continue;
          if (!covering[p].empty() && covering[p] != group_name) {
            fail("quantization_config.config_groups '", covering[p], "' and '", group_name,
                 "' both cover the routed experts' ", projections[p], "; give them one scheme");
          }
          covering[p] = group_name;
        }
      }
    }
    size_t covered = 0;
    for (const std::string& group : covering) covered += group.empty() ? 0 : 1;
    if (covered == 0) return ExpertWeightFormat::dense;
    for (size_t p = 0; p < projections.size(); ++p) {
      if (covering[p].empty()) {
        fail("quantization_config covers some routed expert projections but not experts.{e}.", projections[p],
             "; latentmoe needs all of them in one format");
      }
    }
    for (const std::string& group_name : covering) check_scheme(group_name);
    return ExpertWeightFormat::mxfp4;
  }

 private:
  struct Pattern {
    std::string text;              // as written
    std::optional<std::regex> re;  // for "re:" entries
  };

  template <class... Parts>
  [[noreturn]] void fail(Parts&&... parts) const {
    detail::throw_error(source_, ": ", std::forward<Parts>(parts)...);
  }

  static const json* member(const json& object, std::string_view key) {
    auto it = object.find(key);
    if (it == object.end() || it->is_null()) return nullptr;
    return &*it;
  }

  std::string string_at(const json& object, const std::string& path, std::string_view key, bool required) const {
    const json* value = member(object, key);
    if (value == nullptr) {
      if (required) fail("missing key '", path, "'");
      return {};
    }
    if (!value->is_string())
      fail("'", path, "' must be a string, got ", type_name(*value), " (", describe(*value), ")");
    return value->get<std::string>();
  }

  // A list of names / "re:" patterns (targets, ignore); a single string is accepted as a list of one.
  std::vector<Pattern> patterns(const json& object, const std::string& path, std::string_view key) const {
    std::vector<Pattern> result;
    const json* value = member(object, key);
    if (value == nullptr) return result;
    if (!value->is_array() && !value->is_string()) {
      fail("'", path, "' must be a list of strings, got ", type_name(*value));
    }
    const json list = value->is_string() ? json::array({*value}) : *value;
    for (size_t i = 0; i < list.size(); ++i) {
      const json& entry = list[i];
      if (!entry.is_string()) {
        fail("'", path, "[", i, "]' must be a string, got ", type_name(entry), " (", describe(entry), ")");
      }
      Pattern pattern{entry.get<std::string>(), std::nullopt};
      if (pattern.text.rfind("re:", 0) == 0) {
        const std::string expression = pattern.text.substr(3);
        if (expression.size() > kMaxPatternBytes) {
          fail("'", path, "[", i, "]' is a pattern of ", expression.size(), " bytes; at most ", kMaxPatternBytes,
               " are read");
        }
        try {
          pattern.re.emplace(expression, std::regex::ECMAScript);
        } catch (const std::regex_error& error) {
          fail("'", path, "[", i, "]' (", describe(entry),
               ") is not a regular expression latentmoe can read: ", error.what());
        }
      }
      result.push_back(std::move(pattern));
    }
    return result;
  }

  // compressed-tensors semantics: "re:X" matches when X matches at the start of the module name
  // (Python's re.match); any other entry is the full module name or, for targets, a module class
  // (an expert projection is a "Linear").
  static bool matches_any(const std::vector<Pattern>& list, const std::string& name, bool linear_class = false) {
    for (const Pattern& pattern : list) {
      if (pattern.re.has_value()) {
        if (std::regex_search(name, *pattern.re, std::regex_constants::match_continuous)) return true;
      } else if (pattern.text == name || (linear_class && pattern.text == "Linear")) {
        return true;
      }
    }
    return false;
  }

  // The scheme of a group that covers the routed experts must be MXFP4 weights only.
  void check_scheme(const std::string& group_name) const {
    const std::string path = "quantization_config.config_groups." + group_name;
    const json& group = config_.at("config_groups").at(group_name);
    std::string format = string_at(group, path + ".format", "format", false);
    std::string format_path = path + ".format";
    if (format.empty()) {
      format = string_at(config_, "quantization_config.format", "format", false);
      format_path = "quantization_config.format";
    }
    if (format.empty()) fail("missing key 'quantization_config.format' (the routed experts' format)");
    if (format != kMxfp4Format) {
      fail("'", format_path, "' is '", format, "'; latentmoe reads routed experts in ", kMxfp4Format, " only");
    }
    const json* weights = member(group, "weights");
    if (weights == nullptr) fail("missing key '", path, ".weights'");
    if (!weights->is_object()) fail("'", path, ".weights' must be an object, got ", type_name(*weights));
    check_int(*weights, path + ".weights.num_bits", "num_bits", 4, true);
    const std::string type = string_at(*weights, path + ".weights.type", "type", true);
    if (type != "float") fail("'", path, ".weights.type' is '", type, "'; MXFP4 needs 'float' (E2M1)");
    check_int(*weights, path + ".weights.group_size", "group_size", kMxfp4GroupSize, true);
    const std::string strategy = string_at(*weights, path + ".weights.strategy", "strategy", false);
    if (!strategy.empty() && strategy != "group") {
      fail("'", path, ".weights.strategy' is '", strategy, "'; MXFP4 needs 'group'");
    }
    for (const char* key : {"input_activations", "output_activations"}) {
      if (member(group, key) != nullptr) {
        fail("'", path, ".", key, "' is set: quantized activations are not supported (the routed experts run with ",
             "activations in the compute dtype)");
      }
    }
  }

  void check_int(const json& object, const std::string& path, std::string_view key, int64_t expected,
                 bool required) const {
    const json* value = member(object, key);
    if (value == nullptr) {
      if (required) fail("missing key '", path, "'");
      return;
    }
    if (!value->is_number_integer()) {
      fail("'", path, "' must be an integer, got ", type_name(*value), " (", describe(*value), ")");
    }
    if (value->get<int64_t>() != expected) {
      fail("'", path, "' is ", describe(*value), "; MXFP4 routed experts need ", expected);
    }
  }

  const json& config_;
  std::string_view source_;
};

// The quantization_config latentmoe writes for MXFP4 experts (to_json): one group over every routed
// expert projection, the shared expert ignored.
json mxfp4_quantization_config() {
  json weights = {{"num_bits", 4},     {"type", "float"}, {"strategy", "group"}, {"group_size", kMxfp4GroupSize},
                  {"symmetric", true}, {"dynamic", false}};
  json group = {{"targets", json::array({"re:.*experts\\.\\d+\\.w[123]$"})},
                {"weights", weights},
                {"input_activations", nullptr},
                {"format", kMxfp4Format}};
  return {{"quant_method", "compressed-tensors"},
          {"format", kMxfp4Format},
          {"config_groups", {{"group_0", group}}},
          {"ignore", json::array({"lm_head", "re:.*shared_experts.*"})}};
}

}  // namespace

std::string_view to_string(ExpertWeightFormat format) {
  switch (format) {
    case ExpertWeightFormat::dense:
      return "dense";
    case ExpertWeightFormat::mxfp4:
      return "mxfp4";
  }
  return "unknown";
}

std::string_view to_string(Activation activation) {
  switch (activation) {
    case Activation::silu:
      return "silu";
    case Activation::situ:
      return "situ";
    case Activation::relu2:
      return "relu2";
  }
  return "unknown";
}

std::string_view to_string(ScoringFunc scoring) {
  switch (scoring) {
    case ScoringFunc::sigmoid:
      return "sigmoid";
    case ScoringFunc::softmax:
      return "softmax";
  }
  return "unknown";
}

void LayerConfig::validate() const {
  check_size("hidden_size", hidden_size, false);
  check_size("moe_latent_size", latent_size, false);
  check_size("n_routed_experts", num_experts, false);
  check_size("num_experts_per_tok", top_k, false);
  check_size("moe_intermediate_size", intermediate_size, false);
  check_size("n_shared_experts", num_shared_experts, true);
  check_size("shared_expert_intermediate_size", shared_intermediate_size, true);
  check_size("zero_expert_num", zero_expert_num, true);
  check_size("n_router_outputs (n_routed_experts + zero_expert_num)", num_router_outputs(), false);

  const int64_t num_outputs = num_router_outputs();
  LATENTMOE_CHECK(top_k <= num_outputs, "num_experts_per_tok ", top_k,
                  " exceeds n_routed_experts + zero_expert_num = ", num_outputs);
  LATENTMOE_CHECK(n_group >= 1, "n_group must be positive, got ", n_group);
  LATENTMOE_CHECK(num_outputs % n_group == 0, "n_group ", n_group,
                  " does not divide n_routed_experts + zero_expert_num = ", num_outputs);
  const int64_t group_size = num_outputs / n_group;
  // A group's score is the sum of its best two biased scores (DeepSeek-V3), so a group needs two.
  LATENTMOE_CHECK(n_group == 1 || group_size >= 2, "n_group ", n_group, " leaves ", group_size,
                  " expert per group (n_routed_experts + zero_expert_num = ", num_outputs,
                  "); group-limited routing needs at least 2");
  LATENTMOE_CHECK(topk_group >= 1 && topk_group <= n_group, "topk_group ", topk_group,
                  " is outside [1, n_group = ", n_group, "]");
  LATENTMOE_CHECK(
      top_k <= topk_group * group_size, "num_experts_per_tok ", top_k,
      " exceeds the experts in the kept groups: topk_group * (n_routed_experts + zero_expert_num) / n_group = ",
      topk_group, " * ", num_outputs, " / ", n_group, " = ", topk_group * group_size);

  check_positive_finite("situ_beta", situ_beta);
  check_positive_finite("situ_linear_beta", situ_linear_beta);
  check_positive_finite("routed_scaling_factor", routed_scaling_factor);
  check_positive_finite("rms_norm_eps", rms_norm_eps);

  if (has_mxfp4_experts()) {
    // Packed rows hold whole scale groups: 32 input columns of gate/up (l) and of down (I).
    LATENTMOE_CHECK(latent_size % kMxfp4GroupSize == 0, "MXFP4 experts (quantization_config) need moe_latent_size ",
                    "to be a multiple of the group size ", kMxfp4GroupSize, ", got ", latent_size);
    LATENTMOE_CHECK(intermediate_size % kMxfp4GroupSize == 0,
                    "MXFP4 experts (quantization_config) need moe_intermediate_size to be a multiple of the group ",
                    "size ", kMxfp4GroupSize, ", got ", intermediate_size);
  }

  // The largest weight tensor (all routed experts' projections) must have a countable size.
  LATENTMOE_CHECK(checked_product({num_experts, 3, intermediate_size, latent_size}).has_value(),
                  "n_routed_experts * moe_intermediate_size * moe_latent_size overflows (", num_experts, " * ",
                  intermediate_size, " * ", latent_size, ")");
}

std::string LayerConfig::to_json() const {
  json out = json::object();
  out["hidden_size"] = hidden_size;
  out["moe_latent_size"] = latent_size;
  out["n_routed_experts"] = num_experts;
  out["num_experts_per_tok"] = top_k;
  out["moe_intermediate_size"] = intermediate_size;
  out["n_shared_experts"] = num_shared_experts;
  out["shared_expert_intermediate_size"] = shared_intermediate_size;
  out["hidden_act"] = std::string(to_string(activation));
  out["situ_beta"] = situ_beta;
  out["situ_linear_beta"] = situ_linear_beta;
  out["scoring_func"] = std::string(to_string(scoring));
  out["n_group"] = n_group;
  out["topk_group"] = topk_group;
  out["norm_topk_prob"] = norm_topk_prob;
  out["routed_scaling_factor"] = routed_scaling_factor;
  out["latent_moe_use_norm"] = use_latent_norm;
  out["rms_norm_eps"] = rms_norm_eps;
  out["zero_expert_num"] = zero_expert_num;
  if (has_mxfp4_experts()) out["quantization_config"] = mxfp4_quantization_config();
  return out.dump(2);
}

LayerConfig LayerConfig::from_json(std::string_view json_text, std::string_view source) {
  if (json_text.size() > kMaxConfigBytes) {
    detail::throw_error(source, ": config is larger than ", kMaxConfigBytes >> 20, " MiB (", json_text.size(),
                        " bytes)");
  }
  check_nesting(json_text, source);
  json root;
  try {
    DuplicateKeyCheck duplicates(source);
    json::sax_parse(json_text.begin(), json_text.end(), &duplicates);
    root = json::parse(json_text.begin(), json_text.end());
  } catch (const json::exception& error) {  // parse_error, or out_of_range for a number like 1e400
    detail::throw_error(source, ": invalid JSON: ", parse_error_text(error));
  }
  if (!root.is_object()) Reader(root, source).fail("the top level must be a JSON object, got ", type_name(root));
  // A published multimodal config keeps the language model's keys under text_config: read the layer
  // from there when the top level has no hidden_size.
  const json* layer_root = &root;
  std::string layer_source(source);
  if (const auto text_config = root.find("text_config");
      (!root.contains("hidden_size") || root["hidden_size"].is_null()) && text_config != root.end() &&
      text_config->is_object()) {
    layer_root = &*text_config;
    layer_source += ": text_config";
  }
  Reader reader(*layer_root, layer_source);

  LayerConfig config;
  config.hidden_size = reader.required_int("hidden_size");
  config.latent_size = reader.required_int("moe_latent_size", "routed_expert_hidden_size");
  config.num_experts = reader.required_int("n_routed_experts", "num_experts");
  config.top_k = reader.required_int("num_experts_per_tok", "num_experts_per_token");
  config.intermediate_size = reader.required_int("moe_intermediate_size");

  const bool shared_count_given = reader.has("n_shared_experts", "num_shared_experts");
  config.num_shared_experts = reader.optional_int("n_shared_experts", "num_shared_experts", 0);
  if (reader.has("shared_expert_intermediate_size", "moe_shared_expert_intermediate_size")) {
    // An explicit width wins over n_shared_experts * I (Qwen2-MoE style configs give only the width).
    config.shared_intermediate_size =
        reader.optional_int("shared_expert_intermediate_size", "moe_shared_expert_intermediate_size", 0);
    if (shared_count_given && config.num_shared_experts == 0 && config.shared_intermediate_size > 0) {
      reader.fail("n_shared_experts is 0 but shared_expert_intermediate_size is ", config.shared_intermediate_size,
                  "; set n_shared_experts > 0 or the width to 0");
    }
    if (!shared_count_given) config.num_shared_experts = config.shared_intermediate_size > 0 ? 1 : 0;
  } else {
    auto product = checked_product({config.num_shared_experts, config.intermediate_size});
    if (!product.has_value() || config.num_shared_experts < 0 || config.intermediate_size < 0) {
      // Out-of-range inputs: leave the product alone and let validate() name the bad key.
      config.shared_intermediate_size = 0;
    } else {
      config.shared_intermediate_size = *product;
    }
  }

  const std::string act = reader.required_string("hidden_act");
  if (act == "silu") {
    config.activation = Activation::silu;
  } else if (act == "situ") {
    config.activation = Activation::situ;
  } else if (act == "relu2") {
    config.activation = Activation::relu2;
  } else {
    reader.fail("unknown hidden_act '", act, "'; accepted: silu, situ, relu2");
  }
  config.situ_beta = reader.optional_double("situ_beta", config.situ_beta);
  config.situ_linear_beta = reader.optional_double("situ_linear_beta", config.situ_linear_beta);

  if (auto scoring = reader.optional_string("scoring_func")) {
    if (*scoring == "sigmoid") {
      config.scoring = ScoringFunc::sigmoid;
    } else if (*scoring == "softmax") {
      config.scoring = ScoringFunc::softmax;
    } else {
      reader.fail("unknown scoring_func '", *scoring, "'; accepted: sigmoid, softmax");
    }
  }
  config.n_group = reader.optional_int("n_group", {}, config.n_group);
  config.topk_group = reader.optional_int("topk_group", {}, config.topk_group);
  config.norm_topk_prob = reader.optional_bool("norm_topk_prob", "moe_renormalize", config.norm_topk_prob);
  config.routed_scaling_factor = reader.optional_double("routed_scaling_factor", config.routed_scaling_factor);
  config.use_latent_norm = reader.optional_bool("latent_moe_use_norm", {}, config.use_latent_norm);
  config.rms_norm_eps = reader.optional_double("rms_norm_eps", config.rms_norm_eps);
  config.zero_expert_num = reader.optional_int("zero_expert_num", {}, config.zero_expert_num);

  // quantization_config: at the top level, else beside the layer keys (text_config).
  const json* quantization = nullptr;
  std::string_view quantization_source = source;
  for (const json* object : {static_cast<const json*>(&root), layer_root}) {
    const auto it = object->find("quantization_config");
    if (quantization != nullptr || it == object->end() || it->is_null()) continue;
    quantization = &*it;
    if (object == layer_root) quantization_source = layer_source;
  }
  if (quantization != nullptr) {
    config.experts_format = QuantizationReader(*quantization, quantization_source).experts_format(config.is_gated());
  }

  try {
    config.validate();
  } catch (const Error& error) {
    reader.fail(error);
  }
  return config;
}

LayerConfig LayerConfig::from_file(const std::string& path) {
  return from_json(detail::read_bounded_file(path, kMaxConfigBytes, "config file"), path);
}

void validate_parallel(const LayerConfig& config, const ParallelConfig& parallel) {
  LATENTMOE_CHECK(parallel.tp_size >= 1, "tp must be >= 1, got ", parallel.tp_size);
  LATENTMOE_CHECK(parallel.rank >= 0 && parallel.rank < parallel.tp_size, "rank ", parallel.rank,
                  " is outside [0, tp = ", parallel.tp_size, ")");
  const int64_t tp = parallel.tp_size;
  auto check_divides = [tp](std::string_view key, int64_t size) {
    LATENTMOE_CHECK(size % tp == 0, "tp ", tp, " does not divide ", key, " ", size);
  };
  check_divides("hidden_size", config.hidden_size);
  check_divides("moe_latent_size", config.latent_size);
  check_divides("moe_intermediate_size", config.intermediate_size);
  if (config.has_shared_expert()) check_divides("shared_expert_intermediate_size", config.shared_intermediate_size);
  if (config.has_mxfp4_experts()) {
    const int64_t rank_i = config.intermediate_size / tp;
    LATENTMOE_CHECK(rank_i % kMxfp4GroupSize == 0, "tp ", tp, ": MXFP4 experts need moe_intermediate_size / tp ",
                    "to be a multiple of the group size ", kMxfp4GroupSize,
                    " (a rank's slice of a packed row must not split a scale group); moe_intermediate_size ",
                    config.intermediate_size, " / tp ", tp, " = ", rank_i);
  }
}

}  // namespace latentmoe

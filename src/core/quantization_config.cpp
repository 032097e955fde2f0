// The quantization_config of a Hugging Face config, as compressed-tensors writes it: which format
// the routed experts' weights are in (dense, or MXFP4 when a config group covers every routed expert
// projection with mxfp4-pack-quantized weights and no quantized activations), and the
// quantization_config latentmoe writes for MXFP4 experts. docs/CONFIG.md section 1 documents the
// rules; keep the two in step.
#include "core/quantization_config.h"

#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <string>
#include <utility>
#include <vector>

#include "core/json_reader.h"
#include "latentmoe/error.h"
#include "latentmoe/mxfp4.h"

namespace latentmoe::detail {
namespace {

using nlohmann::json;

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
    if (!config_.is_object()) fail("'quantization_config' must be an object, got ", json_type_name(config_));
    const std::string method = string_at(config_, "quantization_config.quant_method", "quant_method", true);
    if (method != "compressed-tensors") {
      // Other methods (fp8 blocks, GPTQ, ...) describe their coverage in their own ways; whatever they
      // cover, latentmoe cannot read it, and loading bf16 names would fail later with a vaguer message.
      fail("quantization_config.quant_method '", method,
           "' is not supported; latentmoe reads compressed-tensors (mxfp4-pack-quantized routed experts)");
    }
    const std::vector<Pattern> ignore = patterns(config_, "quantization_config.ignore", "ignore");
    const json* groups = json_member(config_, "config_groups");
    if (groups != nullptr && !groups->is_object()) {
      fail("'quantization_config.config_groups' must be an object, got ", json_type_name(*groups));
    }

    // Each group's targets, compiled once.
    std::vector<std::pair<std::string, std::vector<Pattern>>> group_targets;
    if (groups != nullptr) {
      for (const auto& [group_name, group] : groups->items()) {
        const std::string path = "quantization_config.config_groups." + group_name;
        if (!group.is_object()) fail("'", path, "' must be an object, got ", json_type_name(group));
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
    throw_error(source_, ": ", std::forward<Parts>(parts)...);
  }

  std::string string_at(const json& object, const std::string& path, std::string_view key, bool required) const {
    const json* value = json_member(object, key);
    if (value == nullptr) {
      if (required) fail("missing key '", path, "'");
      return {};
    }
    if (!value->is_string())
      fail("'", path, "' must be a string, got ", json_type_name(*value), " (", describe_json(*value), ")");
    return value->get<std::string>();
  }

  // A list of names / "re:" patterns (targets, ignore); a single string is accepted as a list of one.
  std::vector<Pattern> patterns(const json& object, const std::string& path, std::string_view key) const {
    std::vector<Pattern> result;
    const json* value = json_member(object, key);
    if (value == nullptr) return result;
    if (!value->is_array() && !value->is_string()) {
      fail("'", path, "' must be a list of strings, got ", json_type_name(*value));
    }
    const json list = value->is_string() ? json::array({*value}) : *value;
    for (size_t i = 0; i < list.size(); ++i) {
      const json& entry = list[i];
      if (!entry.is_string()) {
        fail("'", path, "[", i, "]' must be a string, got ", json_type_name(entry), " (", describe_json(entry), ")");
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
          fail("'", path, "[", i, "]' (", describe_json(entry),
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
    const json* weights = json_member(group, "weights");
    if (weights == nullptr) fail("missing key '", path, ".weights'");
    if (!weights->is_object()) fail("'", path, ".weights' must be an object, got ", json_type_name(*weights));
    check_int(*weights, path + ".weights.num_bits", "num_bits", 4, true);
    const std::string type = string_at(*weights, path + ".weights.type", "type", true);
    if (type != "float") fail("'", path, ".weights.type' is '", type, "'; MXFP4 needs 'float' (E2M1)");
    check_int(*weights, path + ".weights.group_size", "group_size", kMxfp4GroupSize, true);
    const std::string strategy = string_at(*weights, path + ".weights.strategy", "strategy", false);
    if (!strategy.empty() && strategy != "group") {
      fail("'", path, ".weights.strategy' is '", strategy, "'; MXFP4 needs 'group'");
    }
    for (const char* key : {"input_activations", "output_activations"}) {
      if (json_member(group, key) != nullptr) {
        fail("'", path, ".", key, "' is set: quantized activations are not supported (the routed experts run with ",
             "activations in the compute dtype)");
      }
    }
  }

  void check_int(const json& object, const std::string& path, std::string_view key, int64_t expected,
                 bool required) const {
    const json* value = json_member(object, key);
    if (value == nullptr) {
      if (required) fail("missing key '", path, "'");
      return;
    }
    if (!value->is_number_integer()) {
      fail("'", path, "' must be an integer, got ", json_type_name(*value), " (", describe_json(*value), ")");
    }
    if (value->get<int64_t>() != expected) {
      fail("'", path, "' is ", describe_json(*value), "; MXFP4 routed experts need ", expected);
    }
  }

  const json& config_;
  std::string_view source_;
};

}  // namespace

ExpertWeightFormat experts_format(const json& quantization_config, std::string_view source, bool gated) {
  return QuantizationReader(quantization_config, source).experts_format(gated);
}

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

}  // namespace latentmoe::detail

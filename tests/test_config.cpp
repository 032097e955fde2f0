#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "latentmoe/config.h"
#include "latentmoe/error.h"
#include "scratch_dir.h"

namespace latentmoe {
namespace {

using nlohmann::json;
using ::testing::AllOf;
using ::testing::HasSubstr;

// A small valid config with only the required keys.
json minimal() {
  return json{{"hidden_size", 64},        {"moe_latent_size", 32},       {"n_routed_experts", 8},
              {"num_experts_per_tok", 2}, {"moe_intermediate_size", 16}, {"hidden_act", "silu"}};
}

LayerConfig parse(const json& config) { return LayerConfig::from_json(config.dump(), "test.json"); }

// The message of the Error that parsing `config` throws ("" when it does not throw).
std::string parse_error(const json& config) {
  try {
    parse(config);
  } catch (const Error& error) {
    return error.what();
  }
  return "";
}

std::string parse_error_text(std::string_view text) {
  try {
    LayerConfig::from_json(text, "text.json");
  } catch (const Error& error) {
    return error.what();
  }
  return "";
}

json with(json config, const std::string& key, json value) {
  config[key] = std::move(value);
  return config;
}

json without(json config, const std::string& key) {
  config.erase(key);
  return config;
}

TEST(Config, minimal_config_takes_documented_defaults) {
  LayerConfig config = parse(minimal());
  EXPECT_EQ(config.hidden_size, 64);
  EXPECT_EQ(config.latent_size, 32);
  EXPECT_EQ(config.num_experts, 8);
  EXPECT_EQ(config.top_k, 2);
  EXPECT_EQ(config.intermediate_size, 16);
  EXPECT_EQ(config.activation, Activation::silu);
  EXPECT_EQ(config.num_shared_experts, 0);
  EXPECT_EQ(config.shared_intermediate_size, 0);
  EXPECT_FALSE(config.has_shared_expert());
  EXPECT_EQ(config.situ_beta, 4.0);
  EXPECT_EQ(config.situ_linear_beta, 25.0);
  EXPECT_EQ(config.scoring, ScoringFunc::sigmoid);
  EXPECT_EQ(config.n_group, 1);
  EXPECT_EQ(config.topk_group, 1);
  EXPECT_TRUE(config.norm_topk_prob);
  EXPECT_EQ(config.routed_scaling_factor, 1.0);
  EXPECT_FALSE(config.use_latent_norm);
  EXPECT_EQ(config.rms_norm_eps, 1e-5);
  EXPECT_EQ(config.zero_expert_num, 0);
  EXPECT_EQ(config.num_router_outputs(), 8);
  EXPECT_TRUE(config.is_gated());
}

TEST(Config, every_optional_key_is_read) {
  json text = minimal();
  text["hidden_act"] = "situ";
  text["situ_beta"] = 3.5;
  text["situ_linear_beta"] = 20;  // an integer is a valid number
  text["scoring_func"] = "softmax";
  text["n_group"] = 2;
  text["topk_group"] = 2;
  text["norm_topk_prob"] = false;
  text["routed_scaling_factor"] = 2.5;
  text["latent_moe_use_norm"] = true;
  text["rms_norm_eps"] = 1e-6;
  text["zero_expert_num"] = 4;
  text["n_shared_experts"] = 2;
  LayerConfig config = parse(text);
  EXPECT_EQ(config.activation, Activation::situ);
  EXPECT_EQ(config.situ_beta, 3.5);
  EXPECT_EQ(config.situ_linear_beta, 20.0);
  EXPECT_EQ(config.scoring, ScoringFunc::softmax);
  EXPECT_EQ(config.n_group, 2);
  EXPECT_EQ(config.topk_group, 2);
  EXPECT_FALSE(config.norm_topk_prob);
  EXPECT_EQ(config.routed_scaling_factor, 2.5);
  EXPECT_TRUE(config.use_latent_norm);
  EXPECT_EQ(config.rms_norm_eps, 1e-6);
  EXPECT_EQ(config.zero_expert_num, 4);
  EXPECT_EQ(config.num_router_outputs(), 12);
  EXPECT_EQ(config.num_shared_experts, 2);
  EXPECT_EQ(config.shared_intermediate_size, 32);  // 2 * moe_intermediate_size
}

TEST(Config, activations_and_scoring_names) {
  EXPECT_EQ(parse(with(minimal(), "hidden_act", "silu")).activation, Activation::silu);
  EXPECT_EQ(parse(with(minimal(), "hidden_act", "situ")).activation, Activation::situ);
  LayerConfig relu2 = parse(with(minimal(), "hidden_act", "relu2"));
  EXPECT_EQ(relu2.activation, Activation::relu2);
  EXPECT_FALSE(relu2.is_gated());
  EXPECT_EQ(parse(with(minimal(), "scoring_func", "sigmoid")).scoring, ScoringFunc::sigmoid);
  EXPECT_EQ(to_string(Activation::silu), "silu");
  EXPECT_EQ(to_string(Activation::situ), "situ");
  EXPECT_EQ(to_string(Activation::relu2), "relu2");
  EXPECT_EQ(to_string(ScoringFunc::sigmoid), "sigmoid");
  EXPECT_EQ(to_string(ScoringFunc::softmax), "softmax");
}

struct AliasCase {
  const char* key;
  const char* alias;
  json key_value;    // a valid value for the key
  json other_value;  // a different valid value
};

std::vector<AliasCase> alias_cases() {
  return {
      {"moe_latent_size", "routed_expert_hidden_size", 32, 16},
      {"n_routed_experts", "num_experts", 8, 16},
      {"num_experts_per_tok", "num_experts_per_token", 2, 4},
      {"n_shared_experts", "num_shared_experts", 1, 2},
      {"shared_expert_intermediate_size", "moe_shared_expert_intermediate_size", 48, 24},
      {"norm_topk_prob", "moe_renormalize", false, true},
  };
}

TEST(Config, each_alias_is_accepted_alone) {
  for (const AliasCase& c : alias_cases()) {
    SCOPED_TRACE(c.alias);
    json text = without(minimal(), c.key);
    text[c.alias] = c.key_value;
    LayerConfig via_alias = parse(text);
    LayerConfig via_key = parse(with(minimal(), c.key, c.key_value));
    EXPECT_EQ(via_alias, via_key);
    // And the alias really changed something relative to the default / minimal config.
    EXPECT_NE(parse(with(without(minimal(), c.key), c.alias, c.other_value)), via_alias);
  }
}

TEST(Config, alias_and_key_agreeing_is_fine) {
  for (const AliasCase& c : alias_cases()) {
    SCOPED_TRACE(c.alias);
    json text = with(minimal(), c.key, c.key_value);
    text[c.alias] = c.key_value;
    EXPECT_EQ(parse(text), parse(with(minimal(), c.key, c.key_value)));
  }
}

TEST(Config, conflicting_alias_pair_names_both) {
  for (const AliasCase& c : alias_cases()) {
    SCOPED_TRACE(c.alias);
    json text = with(minimal(), c.key, c.key_value);
    text[c.alias] = c.other_value;
    std::string message = parse_error(text);
    EXPECT_THAT(message, AllOf(HasSubstr("test.json"), HasSubstr(std::string("'") + c.key + "'"),
                               HasSubstr(std::string("'") + c.alias + "'"), HasSubstr("disagree")));
  }
}

TEST(Config, null_counts_as_absent) {
  // An optional key given null takes its default.
  json text = minimal();
  text["n_group"] = nullptr;
  text["scoring_func"] = nullptr;
  text["rms_norm_eps"] = nullptr;
  text["n_shared_experts"] = nullptr;
  LayerConfig config = parse(text);
  EXPECT_EQ(config.n_group, 1);
  EXPECT_EQ(config.scoring, ScoringFunc::sigmoid);
  EXPECT_EQ(config.rms_norm_eps, 1e-5);
  EXPECT_FALSE(config.has_shared_expert());
  // A null key beside a set alias: the alias is used and there is no conflict.
  json aliased = without(minimal(), "n_routed_experts");
  aliased["n_routed_experts"] = nullptr;
  aliased["num_experts"] = 16;
  EXPECT_EQ(parse(aliased).num_experts, 16);
  // A required key given null is missing.
  EXPECT_THAT(parse_error(with(minimal(), "hidden_size", nullptr)), HasSubstr("missing required key 'hidden_size'"));
}

TEST(Config, each_missing_required_key_is_named) {
  const std::vector<std::pair<std::string, std::string>> required = {
      {"hidden_size", "missing required key 'hidden_size'"},
      {"moe_latent_size", "missing required key 'moe_latent_size' (or its alias 'routed_expert_hidden_size')"},
      {"n_routed_experts", "missing required key 'n_routed_experts' (or its alias 'num_experts')"},
      {"num_experts_per_tok", "missing required key 'num_experts_per_tok' (or its alias 'num_experts_per_token')"},
      {"moe_intermediate_size", "missing required key 'moe_intermediate_size'"},
      {"hidden_act", "missing required key 'hidden_act'"},
  };
  for (const auto& [key, expected] : required) {
    SCOPED_TRACE(key);
    std::string message = parse_error(without(minimal(), key));
    EXPECT_THAT(message, HasSubstr("test.json: " + expected));
  }
}

TEST(Config, wrong_json_types_are_named) {
  struct Case {
    const char* key;
    json value;
    const char* expected;
  };
  const std::vector<Case> cases = {
      {"hidden_size", 3.5, "'hidden_size' must be an integer, got a number (3.5)"},
      {"hidden_size", 64.0, "'hidden_size' must be an integer"},
      {"hidden_size", "64", "'hidden_size' must be an integer, got a string (\"64\")"},
      {"hidden_size", true, "'hidden_size' must be an integer, got a boolean (true)"},
      {"hidden_size", json::array({64}), "'hidden_size' must be an integer, got an array"},
      {"n_group", json::object(), "'n_group' must be an integer, got an object"},
      {"num_experts", "8", "'num_experts' must be an integer"},
      {"norm_topk_prob", 1, "'norm_topk_prob' must be true or false, got an integer (1)"},
      {"latent_moe_use_norm", "true", "'latent_moe_use_norm' must be true or false"},
      {"moe_renormalize", 0, "'moe_renormalize' must be true or false"},
      {"rms_norm_eps", "1e-5", "'rms_norm_eps' must be a number, got a string"},
      {"routed_scaling_factor", false, "'routed_scaling_factor' must be a number"},
      {"hidden_act", 2, "'hidden_act' must be a string, got an integer"},
      {"scoring_func", json::array(), "'scoring_func' must be a string"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.key);
    json text = minimal();
    if (std::string(c.key) == "num_experts") text.erase("n_routed_experts");
    text[c.key] = c.value;
    EXPECT_THAT(parse_error(text), HasSubstr(std::string("test.json: ") + c.expected));
  }
}

TEST(Config, out_of_range_integers_are_named) {
  // 2^63 does not fit in int64; nlohmann keeps it as an unsigned integer.
  EXPECT_THAT(parse_error_text(R"({"hidden_size": 9223372036854775808, "moe_latent_size": 32, "n_routed_experts": 8,
      "num_experts_per_tok": 2, "moe_intermediate_size": 16, "hidden_act": "silu"})"),
              HasSubstr("'hidden_size' is out of range"));
  // Beyond uint64 the parser gives a float, which is not an integer.
  EXPECT_THAT(parse_error_text(R"({"hidden_size": 99999999999999999999999, "moe_latent_size": 32,
      "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "hidden_act": "silu"})"),
              HasSubstr("'hidden_size' must be an integer"));
  // Fits in int64 but not in int32: above the per-dimension limit.
  EXPECT_THAT(parse_error(with(minimal(), "moe_intermediate_size", int64_t{1} << 40)),
              HasSubstr("moe_intermediate_size 1099511627776 exceeds the limit 2147483647"));
  // Each dimension fits, the expert weights' element count does not.
  json huge = minimal();
  huge["n_routed_experts"] = 2000000000;
  huge["moe_intermediate_size"] = 2000000000;
  huge["moe_latent_size"] = 2000000000;
  EXPECT_THAT(parse_error(huge), HasSubstr("overflows"));
  // A float too large for a double is rejected by the JSON parser itself.
  EXPECT_THAT(parse_error_text(R"({"rms_norm_eps": 1e400})"),
              AllOf(HasSubstr("text.json: invalid JSON"), HasSubstr("1e400")));
}

TEST(Config, unknown_enum_values_list_the_accepted_ones) {
  EXPECT_THAT(parse_error(with(minimal(), "hidden_act", "gelu")),
              HasSubstr("test.json: unknown hidden_act 'gelu'; accepted: silu, situ, relu2"));
  EXPECT_THAT(parse_error(with(minimal(), "hidden_act", "SiLU")), HasSubstr("unknown hidden_act 'SiLU'"));
  EXPECT_THAT(parse_error(with(minimal(), "scoring_func", "tanh")),
              HasSubstr("test.json: unknown scoring_func 'tanh'; accepted: sigmoid, softmax"));
}

TEST(Config, inconsistent_values_name_the_key) {
  struct Case {
    json text;
    const char* expected;
  };
  json grouped = minimal();  // 8 experts in 4 groups of 2
  grouped["n_group"] = 4;
  grouped["topk_group"] = 2;
  ASSERT_EQ(parse(grouped).n_group, 4);
  const std::vector<Case> cases = {
      {with(minimal(), "hidden_size", 0), "hidden_size must be positive, got 0"},
      {with(minimal(), "hidden_size", -4096), "hidden_size must be positive, got -4096"},
      {with(minimal(), "moe_latent_size", 0), "moe_latent_size must be positive"},
      {with(without(minimal(), "moe_latent_size"), "routed_expert_hidden_size", -1),
       "moe_latent_size must be positive"},
      {with(minimal(), "n_routed_experts", 0), "n_routed_experts must be positive"},
      {with(minimal(), "num_experts_per_tok", 0), "num_experts_per_tok must be positive"},
      {with(minimal(), "moe_intermediate_size", -16), "moe_intermediate_size must be positive"},
      {with(minimal(), "n_shared_experts", -1), "n_shared_experts must be >= 0, got -1"},
      {with(minimal(), "shared_expert_intermediate_size", -8), "shared_expert_intermediate_size must be >= 0"},
      {with(minimal(), "zero_expert_num", -1), "zero_expert_num must be >= 0, got -1"},
      {with(minimal(), "num_experts_per_tok", 9),
       "num_experts_per_tok 9 exceeds n_routed_experts + zero_expert_num = 8"},
      {with(minimal(), "n_group", 0), "n_group must be positive, got 0"},
      {with(minimal(), "n_group", 3), "n_group 3 does not divide n_routed_experts + zero_expert_num = 8"},
      {with(minimal(), "n_group", 8), "n_group 8 leaves 1 expert per group"},
      {with(grouped, "topk_group", 0), "topk_group 0 is outside [1, n_group = 4]"},
      {with(grouped, "topk_group", 5), "topk_group 5 is outside [1, n_group = 4]"},
      {with(with(grouped, "topk_group", 1), "num_experts_per_tok", 3),
       "num_experts_per_tok 3 exceeds the experts in the kept groups: topk_group * (n_routed_experts + "
       "zero_expert_num) / n_group = 1 * 8 / 4 = 2"},
      {with(minimal(), "situ_beta", 0), "situ_beta must be finite and > 0, got 0"},
      {with(minimal(), "situ_beta", -1.5), "situ_beta must be finite and > 0, got -1.5"},
      {with(minimal(), "situ_linear_beta", 0.0), "situ_linear_beta must be finite and > 0"},
      {with(minimal(), "rms_norm_eps", 0.0), "rms_norm_eps must be finite and > 0, got 0"},
      {with(minimal(), "rms_norm_eps", -1e-6), "rms_norm_eps must be finite and > 0"},
      {with(minimal(), "routed_scaling_factor", 0), "routed_scaling_factor must be finite and > 0, got 0"},
      {with(minimal(), "routed_scaling_factor", -2.0), "routed_scaling_factor must be finite and > 0"},
      {with(with(minimal(), "n_shared_experts", 0), "shared_expert_intermediate_size", 32),
       "n_shared_experts is 0 but shared_expert_intermediate_size is 32"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.text.dump());
    EXPECT_THAT(parse_error(c.text), HasSubstr(std::string("test.json: ") + c.expected));
  }
}

TEST(Config, validate_rejects_non_finite_values_set_in_code) {
  // JSON cannot spell NaN or infinity, but a config built in code can.
  LayerConfig config = parse(minimal());
  config.validate();
  LayerConfig bad = config;
  bad.rms_norm_eps = std::numeric_limits<double>::quiet_NaN();
  EXPECT_THROW(bad.validate(), Error);
  bad = config;
  bad.routed_scaling_factor = std::numeric_limits<double>::infinity();
  try {
    bad.validate();
    FAIL() << "expected Error";
  } catch (const Error& error) {
    EXPECT_THAT(error.what(), HasSubstr("routed_scaling_factor must be finite and > 0, got inf"));
  }
  bad = config;
  bad.situ_linear_beta = std::numeric_limits<double>::infinity();
  EXPECT_THROW(bad.validate(), Error);
  EXPECT_THROW(LayerConfig{}.validate(), Error);  // all sizes zero
}

TEST(Config, top_k_may_use_zero_experts) {
  json text = with(minimal(), "zero_expert_num", 2);
  text["num_experts_per_tok"] = 10;  // == E + Z
  EXPECT_EQ(parse(text).top_k, 10);
  text["num_experts_per_tok"] = 11;
  EXPECT_THAT(parse_error(text), HasSubstr("num_experts_per_tok 11 exceeds n_routed_experts + zero_expert_num = 10"));
  // n_group must divide E + Z, not E.
  text["num_experts_per_tok"] = 2;
  text["n_group"] = 5;
  EXPECT_EQ(parse(text).n_group, 5);
}

TEST(Config, group_limited_boundaries) {
  json text = minimal();  // 8 experts
  text["n_group"] = 4;    // groups of 2
  text["topk_group"] = 4;
  text["num_experts_per_tok"] = 8;  // == topk_group * 8 / n_group
  EXPECT_EQ(parse(text).top_k, 8);
  text["topk_group"] = 3;
  text["num_experts_per_tok"] = 6;
  EXPECT_EQ(parse(text).topk_group, 3);
  text["num_experts_per_tok"] = 7;
  EXPECT_THAT(parse_error(text), HasSubstr("num_experts_per_tok 7 exceeds the experts in the kept groups"));
}

TEST(Config, shared_expert_width_rules) {
  // Default: n_shared_experts * moe_intermediate_size.
  LayerConfig two = parse(with(minimal(), "n_shared_experts", 2));
  EXPECT_EQ(two.shared_intermediate_size, 32);
  EXPECT_TRUE(two.has_shared_expert());
  // An explicit width wins over the product.
  json explicit_width = with(minimal(), "n_shared_experts", 2);
  explicit_width["shared_expert_intermediate_size"] = 24;
  EXPECT_EQ(parse(explicit_width).shared_intermediate_size, 24);
  EXPECT_EQ(parse(explicit_width).num_shared_experts, 2);
  // An explicit 0 means no shared expert, whatever n_shared_experts says.
  explicit_width["shared_expert_intermediate_size"] = 0;
  EXPECT_FALSE(parse(explicit_width).has_shared_expert());
  // Only the width (Qwen2-MoE style): one shared expert of that width.
  LayerConfig width_only = parse(with(minimal(), "moe_shared_expert_intermediate_size", 40));
  EXPECT_EQ(width_only.shared_intermediate_size, 40);
  EXPECT_EQ(width_only.num_shared_experts, 1);
  EXPECT_EQ(parse(with(minimal(), "shared_expert_intermediate_size", 0)).num_shared_experts, 0);
}

TEST(Config, unknown_keys_are_ignored) {
  json text = minimal();
  text["vocab_size"] = 163840;
  text["rope_scaling"] = json{{"type", "yarn"}, {"factor", 32.0}};
  text["architectures"] = json::array({"SomeForCausalLM"});
  text["hidden_size_typo"] = "whatever";
  EXPECT_EQ(parse(text), parse(minimal()));
}

TEST(Config, kimi_k3_shape) {
  const char* text = R"({
    "architectures": ["KimiK3ForCausalLM"],
    "model_type": "kimi_k3",
    "vocab_size": 163840,
    "num_hidden_layers": 61,
    "num_attention_heads": 64,
    "rope_scaling": {"type": "yarn", "factor": 64.0, "beta_fast": 1, "beta_slow": 1},
    "quantization_config": null,
    "torch_dtype": "bfloat16",
    "hidden_size": 7168,
    "moe_latent_size": 3584,
    "n_routed_experts": 896,
    "num_experts_per_tok": 16,
    "moe_intermediate_size": 3072,
    "n_shared_experts": 2,
    "hidden_act": "situ",
    "situ_beta": 4.0,
    "situ_linear_beta": 25.0,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": true,
    "routed_scaling_factor": 1.0,
    "latent_moe_use_norm": true,
    "rms_norm_eps": 1e-05
  })";
  LayerConfig config = LayerConfig::from_json(text, "kimi-k3.json");
  EXPECT_EQ(config.hidden_size, 7168);
  EXPECT_EQ(config.latent_size, 3584);
  EXPECT_EQ(config.num_experts, 896);
  EXPECT_EQ(config.top_k, 16);
  EXPECT_EQ(config.intermediate_size, 3072);
  EXPECT_EQ(config.shared_intermediate_size, 6144);
  EXPECT_EQ(config.activation, Activation::situ);
  EXPECT_TRUE(config.use_latent_norm);
  EXPECT_EQ(config.routed_scaling_factor, 1.0);
  EXPECT_EQ(config.scoring, ScoringFunc::sigmoid);
  EXPECT_TRUE(config.norm_topk_prob);
  EXPECT_EQ(config.rms_norm_eps, 1e-5);
  EXPECT_EQ(config.zero_expert_num, 0);
}

TEST(Config, nemotron3_super_shape_with_aliases) {
  const char* text = R"({
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "hybrid_override_pattern": "MEMEM*EMEMEM*",
    "mamba_num_heads": 128,
    "layer_norm_epsilon": 1e-05,
    "mlp_hidden_act": "relu2",
    "hidden_size": 4096,
    "moe_latent_size": 1024,
    "num_experts": null,
    "n_routed_experts": 512,
    "num_experts_per_tok": 22,
    "moe_intermediate_size": 2688,
    "n_shared_experts": 1,
    "moe_shared_expert_intermediate_size": 5376,
    "hidden_act": "relu2",
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": true,
    "routed_scaling_factor": 5.0
  })";
  LayerConfig config = LayerConfig::from_json(text, "nemotron.json");
  EXPECT_EQ(config.hidden_size, 4096);
  EXPECT_EQ(config.latent_size, 1024);
  EXPECT_EQ(config.num_experts, 512);
  EXPECT_EQ(config.top_k, 22);
  EXPECT_EQ(config.intermediate_size, 2688);
  EXPECT_EQ(config.num_shared_experts, 1);
  EXPECT_EQ(config.shared_intermediate_size, 5376);
  EXPECT_EQ(config.activation, Activation::relu2);
  EXPECT_FALSE(config.use_latent_norm);
  EXPECT_EQ(config.routed_scaling_factor, 5.0);
  EXPECT_TRUE(config.norm_topk_prob);
  EXPECT_EQ(config.n_group, 1);
}

TEST(Config, to_json_round_trips) {
  json text = minimal();
  text["hidden_act"] = "situ";
  text["situ_beta"] = 0.1;  // not exactly representable: the dump must still round-trip
  text["scoring_func"] = "softmax";
  text["n_shared_experts"] = 1;
  text["shared_expert_intermediate_size"] = 48;
  text["latent_moe_use_norm"] = true;
  text["rms_norm_eps"] = 1e-6;
  text["routed_scaling_factor"] = 2.827;
  text["zero_expert_num"] = 2;
  text["norm_topk_prob"] = false;
  LayerConfig config = parse(text);
  EXPECT_EQ(LayerConfig::from_json(config.to_json()), config);
  LayerConfig defaults = parse(minimal());
  EXPECT_EQ(LayerConfig::from_json(defaults.to_json()), defaults);
}

TEST(Config, malformed_json_reports_position) {
  EXPECT_THAT(parse_error_text("{\"hidden_size\": 64,\n \"x\": }"),
              AllOf(HasSubstr("text.json: invalid JSON"), HasSubstr("line 2, column")));
  EXPECT_THAT(parse_error_text(""), HasSubstr("text.json: invalid JSON"));
  EXPECT_THAT(parse_error_text("{\"a\": NaN}"), HasSubstr("invalid JSON"));
}

TEST(Config, top_level_must_be_an_object) {
  EXPECT_THAT(parse_error_text("[1, 2]"), HasSubstr("text.json: the top level must be a JSON object, got an array"));
  EXPECT_THAT(parse_error_text("42"), HasSubstr("the top level must be a JSON object"));
  EXPECT_THAT(parse_error_text("null"), HasSubstr("the top level must be a JSON object"));
}

class ConfigFile : public ::testing::Test {
 protected:
  std::string write(const std::string& name, const std::string& text) {
    std::ofstream(scratch_.file(name), std::ios::binary) << text;
    return scratch_.file(name);
  }
  testing::ScratchDir scratch_{"config"};
  const std::filesystem::path& dir_ = scratch_.path();
};

TEST_F(ConfigFile, reads_a_file) {
  std::string path = write("good.json", minimal().dump(2));
  EXPECT_EQ(LayerConfig::from_file(path), parse(minimal()));
}

TEST_F(ConfigFile, errors_name_the_path) {
  std::string missing = (dir_ / "does_not_exist.json").string();
  try {
    LayerConfig::from_file(missing);
    FAIL() << "expected Error";
  } catch (const Error& error) {
    EXPECT_THAT(error.what(), AllOf(HasSubstr(missing), HasSubstr("cannot read config file")));
  }
  std::string malformed = write("malformed.json", "{\"hidden_size\": 64,,}");
  try {
    LayerConfig::from_file(malformed);
    FAIL() << "expected Error";
  } catch (const Error& error) {
    EXPECT_THAT(error.what(), AllOf(HasSubstr(malformed + ": invalid JSON"), HasSubstr("column")));
  }
  std::string incomplete = write("incomplete.json", without(minimal(), "moe_intermediate_size").dump());
  try {
    LayerConfig::from_file(incomplete);
    FAIL() << "expected Error";
  } catch (const Error& error) {
    EXPECT_THAT(error.what(), HasSubstr(incomplete + ": missing required key 'moe_intermediate_size'"));
  }
  try {
    LayerConfig::from_file(dir_.string());
    FAIL() << "expected Error";
  } catch (const Error& error) {
    EXPECT_THAT(error.what(), HasSubstr("is a directory"));
  }
}

// No byte below 0x20 and no DEL: an error message is one line.
bool is_one_line(std::string_view text) {
  for (char c : text) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) return false;
  }
  return true;
}

TEST(ConfigHostile, deep_nesting_is_refused_before_parsing) {
  // 100000 levels under a known key: the nlohmann parser, destructor and dump all recurse.
  for (std::string_view open_close : {"[]", "{}"}) {
    std::string deep;
    for (int i = 0; i < 100000; ++i) deep += open_close[0] == '[' ? "[" : "{\"a\":";
    deep += open_close[0] == '[' ? "1" : "1";
    for (int i = 0; i < 100000; ++i) deep += open_close[1];
    std::string text = minimal().dump();
    text.insert(1, "\"hidden_size\": " + deep + ", ");
    std::string message = parse_error_text(text);
    EXPECT_THAT(message,
                AllOf(HasSubstr("text.json: invalid JSON: nested deeper than 64 levels"), HasSubstr("column")));
    EXPECT_LT(message.size(), 200u);
  }
  // Unclosed too.
  EXPECT_THAT(parse_error_text(std::string(1000000, '[')),
              HasSubstr("nested deeper than 64 levels at line 1, column 65"));
}

TEST(ConfigHostile, nesting_limit_counts_arrays_and_objects_outside_strings) {
  auto nested = [](int depth) {
    std::string value = "1";
    for (int i = 1; i < depth; ++i) value = (i % 2 ? "[" : "{\"k\":") + value + (i % 2 ? "]" : "}");
    return value;
  };
  // The top-level object is level 1: a value nested 63 deep under it is fine, 64 is not.
  std::string fine = minimal().dump();
  fine.insert(1, "\"extra\": " + nested(64) + ", ");
  EXPECT_EQ(parse_error_text(fine), "");
  std::string too_deep = minimal().dump();
  too_deep.insert(1, "\"extra\": " + nested(65) + ", ");
  EXPECT_THAT(parse_error_text(too_deep), HasSubstr("nested deeper than 64 levels"));
  // Brackets inside strings (escaped quotes included) do not count.
  std::string in_string = minimal().dump();
  in_string.insert(1, "\"extra\": \"\\\"" + std::string(1000, '[') + "\\\\\", ");
  EXPECT_EQ(parse_error_text(in_string), "");
}

TEST(ConfigHostile, echoed_values_are_short) {
  // A huge value under a known key of the wrong type: the message shows a short prefix only.
  json big_array = json::array();
  for (int i = 0; i < 100000; ++i) big_array.push_back(i);
  std::string message = parse_error(with(minimal(), "hidden_size", big_array));
  EXPECT_THAT(message, HasSubstr("'hidden_size' must be an integer, got an array ([0,1,2,"));
  EXPECT_LT(message.size(), 200u);
  message = parse_error(with(minimal(), "hidden_size", std::string(10 << 20, 'x') + "\n"));
  EXPECT_THAT(message, HasSubstr("got a string (\"xxxx"));
  EXPECT_LT(message.size(), 200u);
  // A long hidden_act is echoed capped and on one line.
  message = parse_error(with(minimal(), "hidden_act", "si\nlu\x1b[31m" + std::string(1 << 20, 'u')));
  EXPECT_THAT(message, AllOf(HasSubstr("unknown hidden_act 'si\\nlu\\x1b[31m"), HasSubstr(" more)'"),
                             HasSubstr("accepted: silu, situ, relu2")));
  EXPECT_TRUE(is_one_line(message));
  EXPECT_LT(message.size(), 300u);
  // A 10 MB value: 179 characters of it and how many were left out (include/latentmoe/error.h).
  message = parse_error(with(minimal(), "hidden_act", std::string(10'000'000, 'u')));
  EXPECT_THAT(message, HasSubstr("unknown hidden_act '" + std::string(179, 'u') +
                                 "...(+9,999,821 more)'; accepted: silu, situ, relu2"));
  EXPECT_LT(message.size(), 300u);
  // Disagreeing aliases holding big objects.
  json big_object = json::object();
  for (int i = 0; i < 1000; ++i) big_object[std::to_string(i)] = std::string(100, 'v');
  message = parse_error(with(with(minimal(), "moe_latent_size", big_object), "routed_expert_hidden_size", 3));
  EXPECT_THAT(message, HasSubstr("disagree"));
  EXPECT_LT(message.size(), 300u);
}

TEST(ConfigHostile, duplicate_keys_are_named) {
  std::string text = minimal().dump();
  text.insert(1, "\"hidden_size\": 32, ");
  EXPECT_THAT(parse_error_text(text), HasSubstr("text.json: duplicate key 'hidden_size'"));
  // Even when both copies agree, and for keys the config ignores.
  text = minimal().dump();
  text.insert(1, "\"hidden_size\": 64, ");
  EXPECT_THAT(parse_error_text(text), HasSubstr("duplicate key 'hidden_size'"));
  text = minimal().dump();
  text.insert(1, "\"foo\": 1, \"foo\": 1, ");
  EXPECT_THAT(parse_error_text(text), HasSubstr("duplicate key 'foo'"));
  // Nested: the enclosing keys are named.
  text = minimal().dump();
  text.insert(1, "\"quantization_config\": {\"list\": [{\"bits\": 4, \"bits\": 8}]}, ");
  EXPECT_THAT(parse_error_text(text), HasSubstr("duplicate key 'bits' in 'quantization_config.list[]'"));
  // The same key in sibling objects is fine.
  text = minimal().dump();
  text.insert(1, "\"a\": {\"x\": 1}, \"b\": {\"x\": 2}, \"c\": [{\"x\": 1}, {\"x\": 2}], ");
  EXPECT_EQ(parse_error_text(text), "");
}

TEST(ConfigHostile, many_small_objects_parse_in_linear_time) {
  // nlohmann's callback parser rescans the parent after every nested value: 10^6 small objects took
  // hours. Duplicate keys are found in a separate SAX pass instead.
  std::string text = minimal().dump();
  std::string wide = "\"wide\": [{}";
  for (int i = 1; i < 1000000; ++i) wide += ",{}";
  wide += "], \"deep\": {";
  for (int i = 0; i < 200000; ++i) wide += (i ? ",\"k" : "\"k") + std::to_string(i) + "\": {}";
  wide += "}, ";
  text.insert(1, wide);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(parse_error_text(text), "");
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
}

TEST(ConfigHostile, text_larger_than_the_cap_is_refused) {
  std::string text = minimal().dump();
  text.append(kMaxConfigBytes + 1 - text.size(), ' ');
  EXPECT_THAT(parse_error_text(text), HasSubstr("text.json: config is larger than 16 MiB"));
  text.pop_back();
  EXPECT_EQ(parse_error_text(text), "");
}

std::string file_error(const std::string& path) {
  try {
    LayerConfig::from_file(path);
  } catch (const Error& error) {
    return error.what();
  }
  return "";
}

TEST_F(ConfigFile, a_file_larger_than_the_cap_is_refused) {
  std::string text = minimal().dump();
  text.append(kMaxConfigBytes - text.size(), '\n');
  std::string at_cap = write("at_cap.json", text);
  EXPECT_EQ(file_error(at_cap), "");
  std::string over = write("over.json", text + " ");
  EXPECT_EQ(file_error(over), over + ": config file is over the limit of 16777216 bytes (16 MiB)");
  // A sparse file claiming terabytes is refused from its size, without reading it.
  std::string sparse = write("sparse.json", "");
  std::filesystem::resize_file(sparse, uintmax_t{1} << 40);
  EXPECT_EQ(file_error(sparse), sparse + ": config file is over the limit of 16777216 bytes (16 MiB)");
}

TEST_F(ConfigFile, only_regular_files_are_read) {
  // A FIFO with no writer would block open(); it must be refused at once.
  std::string fifo = (dir_ / "config.fifo").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_THAT(file_error(fifo), AllOf(HasSubstr(fifo), HasSubstr("not a regular file")));
  // An endless device.
  EXPECT_EQ(file_error("/dev/zero"), "/dev/zero: cannot read config file: not a regular file");
  EXPECT_THAT(file_error(dir_.string()), HasSubstr("is a directory, not a regular file"));
  // A symlink to a regular file is followed.
  std::string target = write("target.json", minimal().dump());
  std::filesystem::create_symlink(target, dir_ / "link.json");
  EXPECT_EQ(file_error((dir_ / "link.json").string()), "");
  // A path with control characters is echoed on one line.
  std::string odd = (dir_ / "bad\nname\x1b[2J.json").string();
  std::string message = file_error(odd);
  EXPECT_THAT(message, AllOf(HasSubstr("bad\\nname\\x1b[2J.json"), HasSubstr("cannot read config file")));
  EXPECT_TRUE(is_one_line(message));
}

LayerConfig kimi_k3() {
  json text = minimal();
  text.update(json{{"hidden_size", 7168},
                   {"moe_latent_size", 3584},
                   {"n_routed_experts", 896},
                   {"num_experts_per_tok", 16},
                   {"moe_intermediate_size", 3072},
                   {"n_shared_experts", 2}});
  return parse(text);
}

LayerConfig nemotron3_super() {
  json text = minimal();
  text.update(json{{"hidden_size", 4096},
                   {"moe_latent_size", 1024},
                   {"n_routed_experts", 512},
                   {"num_experts_per_tok", 22},
                   {"moe_intermediate_size", 2688},
                   {"shared_expert_intermediate_size", 5376},
                   {"hidden_act", "relu2"}});
  return parse(text);
}

std::string parallel_error(const LayerConfig& config, int tp_size, int rank = 0) {
  try {
    validate_parallel(config, ParallelConfig{tp_size, rank, false});
  } catch (const Error& error) {
    return error.what();
  }
  return "";
}

TEST(ValidateParallel, reference_shapes) {
  for (int tp : {1, 2, 4, 8}) {
    SCOPED_TRACE(tp);
    EXPECT_EQ(parallel_error(kimi_k3(), tp, tp - 1), "");
    EXPECT_EQ(parallel_error(nemotron3_super(), tp, tp - 1), "");
  }
  EXPECT_EQ(parallel_error(nemotron3_super(), 16, 5), "");  // 2688 / 16 = 168
  EXPECT_EQ(parallel_error(kimi_k3(), 3), "tp 3 does not divide hidden_size 7168");
  EXPECT_EQ(parallel_error(nemotron3_super(), 3), "tp 3 does not divide hidden_size 4096");
  EXPECT_EQ(parallel_error(kimi_k3(), 7), "tp 7 does not divide moe_intermediate_size 3072");  // 7168, 3584 are 7k
  EXPECT_EQ(parallel_error(nemotron3_super(), 32, 31), "");                                    // 2688 = 2^7 * 21
  EXPECT_EQ(parallel_error(nemotron3_super(), 256), "tp 256 does not divide moe_intermediate_size 2688");
}

TEST(ValidateParallel, names_each_size_tp_does_not_divide) {
  // d = 96, l = 48, I = 24, Is = 24: divisible by 1, 2, 3, 4 and 8.
  json base = minimal();
  base.update(
      json{{"hidden_size", 96}, {"moe_latent_size", 48}, {"moe_intermediate_size", 24}, {"n_shared_experts", 1}});
  for (int tp : {1, 2, 3, 4, 8}) {
    SCOPED_TRACE(tp);
    EXPECT_EQ(parallel_error(parse(base), tp, tp - 1), "");
  }
  EXPECT_EQ(parallel_error(parse(with(base, "hidden_size", 64)), 3), "tp 3 does not divide hidden_size 64");
  EXPECT_EQ(parallel_error(parse(with(base, "moe_latent_size", 32)), 3), "tp 3 does not divide moe_latent_size 32");
  EXPECT_EQ(parallel_error(parse(with(base, "moe_intermediate_size", 16)), 3),
            "tp 3 does not divide moe_intermediate_size 16");
  EXPECT_EQ(parallel_error(parse(with(base, "shared_expert_intermediate_size", 20)), 8),
            "tp 8 does not divide shared_expert_intermediate_size 20");
  EXPECT_EQ(parallel_error(parse(with(base, "moe_intermediate_size", 12)), 8),
            "tp 8 does not divide moe_intermediate_size 12");
  // No shared expert: its width is not checked (and is 0 anyway).
  LayerConfig no_shared = parse(with(base, "shared_expert_intermediate_size", 0));
  EXPECT_EQ(parallel_error(no_shared, 8, 7), "");
  // Sequence parallelism does not change the divisibility rules.
  EXPECT_NO_THROW(validate_parallel(no_shared, ParallelConfig{4, 1, true}));
}

TEST(ValidateParallel, rank_and_tp_range) {
  LayerConfig config = kimi_k3();
  EXPECT_EQ(parallel_error(config, 0), "tp must be >= 1, got 0");
  EXPECT_EQ(parallel_error(config, -2), "tp must be >= 1, got -2");
  EXPECT_EQ(parallel_error(config, 4, 4), "rank 4 is outside [0, tp = 4)");
  EXPECT_EQ(parallel_error(config, 4, -1), "rank -1 is outside [0, tp = 4)");
  EXPECT_EQ(parallel_error(config, 1, 0), "");
}

}  // namespace
}  // namespace latentmoe

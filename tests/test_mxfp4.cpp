// MXFP4 routed experts (issue 16, DESIGN section 3): exact decoding of every E2M1 code and E8M0
// scale, the quantization_config that declares them, loading / sharding / saving the Kimi K3 names,
// the errors for bad inputs, and the whole layer on the CPU reference at tp 1/2/4/8 against a dense
// run on the exactly dequantised weights (bit for bit: the two paths sum the same doubles in the same
// order).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "error_test_util.h"
#include "latentmoe/compare.h"
#include "latentmoe/config.h"
#include "latentmoe/error.h"
#include "latentmoe/local_group.h"
#include "latentmoe/mxfp4.h"
#include "latentmoe/presets.h"
#include "latentmoe/safetensors.h"
#include "latentmoe/weights.h"
#include "layer_test_util.h"
#include "scratch_dir.h"

namespace latentmoe {
namespace {

using nlohmann::json;

using testing::expect_error;

// Kimi-K3-like (situ, latent norm, shared expert) with MXFP4 experts: l and I / 8 multiples of 32.
LayerConfig kimi_mxfp4_config() {
  LayerConfig config = resized(kimi_k3_config(), {40, 64, 6, 3, 256, 40});
  config.experts_format = ExpertWeightFormat::mxfp4;
  config.validate();
  return config;
}

// Nemotron-3-like (relu2: no w1, zero experts, softmax) with MXFP4 experts.
LayerConfig nemotron_mxfp4_config() {
  LayerConfig config = nemotron3_super_config();
  config.zero_expert_num = 2;
  config.scoring = ScoringFunc::softmax;
  config = resized(config, {48, 32, 5, 3, 256, 72});
  config.experts_format = ExpertWeightFormat::mxfp4;
  config.validate();
  return config;
}

// --- decoding ---------------------------------------------------------------------------------

TEST(Mxfp4, every_e2m1_code_decodes_to_its_value) {
  const double expected[16] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0};
  for (int code = 0; code < 16; ++code) {
    EXPECT_EQ(e2m1_value(static_cast<uint8_t>(code)), expected[code]) << code;
    EXPECT_EQ(std::signbit(e2m1_value(static_cast<uint8_t>(code))), code >= 8) << code;
    // Only the low nibble counts.
    EXPECT_EQ(e2m1_value(static_cast<uint8_t>(code | 0xA0)), expected[code]) << code;
  }
}

TEST(Mxfp4, e8m0_scales_are_powers_of_two_and_zero_is_not_zero) {
  EXPECT_EQ(e8m0_value(0), 0x1p-127);
  EXPECT_EQ(e8m0_value(1), 0x1p-126);
  EXPECT_EQ(e8m0_value(126), 0.5);
  EXPECT_EQ(e8m0_value(127), 1.0);
  EXPECT_EQ(e8m0_value(128), 2.0);
  EXPECT_EQ(e8m0_value(254), 0x1p127);
  EXPECT_TRUE(std::isnan(e8m0_value(0xFF)));
  EXPECT_EQ(e8m0_exponent(0), -127);
  EXPECT_EQ(e8m0_exponent(254), 127);
}

// A hand-made [6, 64] MXFP4 matrix: row r has scale bytes {kScales[r], 127}; in group 0 columns
// 0..15 hold codes 0..15 and columns 16..31 codes 15..0; group 1 holds code 0x3 (1.5) everywhere.
constexpr uint8_t kScales[6] = {0, 1, 126, 127, 128, 254};

struct HandMade {
  std::vector<uint8_t> packed = std::vector<uint8_t>(6 * 32);
  std::vector<uint8_t> scales = std::vector<uint8_t>(6 * 2);
  HandMade() {
    for (int r = 0; r < 6; ++r) {
      uint8_t codes[64];
      for (int c = 0; c < 16; ++c) codes[c] = static_cast<uint8_t>(c);
      for (int c = 16; c < 32; ++c) codes[c] = static_cast<uint8_t>(31 - c);
      for (int c = 32; c < 64; ++c) codes[c] = 0x3;
      for (int b = 0; b < 32; ++b) packed[r * 32 + b] = static_cast<uint8_t>(codes[2 * b] | (codes[2 * b + 1] << 4));
      scales[r * 2] = kScales[r];
      scales[r * 2 + 1] = 127;
    }
  }
  std::vector<double> row(int r, int64_t begin = 0, int64_t count = 64) const {
    std::vector<double> out(static_cast<size_t>(count));
    mxfp4_decode_row(packed.data() + r * 32, scales.data() + r * 2, begin, count, out.data());
    return out;
  }
};

TEST(Mxfp4, hand_made_matrix_decodes_exactly) {
  const HandMade m;
  // Values written out by hand (not through the decoder's tables).
  const std::vector<double> row0 = m.row(0);  // scale 2^-127
  EXPECT_EQ(row0[0], 0.0);
  EXPECT_EQ(row0[1], 0x1p-128);  // 0.5 * 2^-127: scale byte 0 is not zero
  EXPECT_EQ(row0[3], 0x1.8p-127);
  EXPECT_EQ(row0[7], 0x1.8p-125);  // 6 * 2^-127
  EXPECT_EQ(row0[8], 0.0);
  EXPECT_TRUE(std::signbit(row0[8]));  // code 0x8 is -0
  EXPECT_EQ(row0[15], -0x1.8p-125);
  const std::vector<double> row1 = m.row(1);  // 2^-126
  EXPECT_EQ(row1[10], -0x1p-126);
  EXPECT_EQ(row1[17], -0x1p-124);             // column 17 holds code 14 (-4)
  const std::vector<double> row2 = m.row(2);  // 0.5
  EXPECT_EQ(row2[3], 0.75);
  EXPECT_EQ(row2[13], -1.5);
  const std::vector<double> row3 = m.row(3);  // 1
  const double plain[16] = {0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6};
  for (int c = 0; c < 16; ++c) {
    EXPECT_EQ(row3[c], plain[c]) << c;
    EXPECT_EQ(row3[31 - c], plain[c]) << c;
  }
  const std::vector<double> row4 = m.row(4);  // 2
  EXPECT_EQ(row4[15], -12.0);
  EXPECT_EQ(row4[16], -12.0);
  EXPECT_EQ(row4[9], -1.0);
  const std::vector<double> row5 = m.row(5);  // 2^127: 6 * 2^127 overflows float, not double
  EXPECT_EQ(row5[7], 0x1.8p129);
  EXPECT_EQ(row5[24], 0x1.8p129);  // column 24 holds code 7
  EXPECT_EQ(row5[12], -0x1p128);
  EXPECT_EQ(row5[1], 0x1p126);
  for (int r = 0; r < 6; ++r) {
    const std::vector<double> row = m.row(r);
    for (int c = 32; c < 64; ++c) EXPECT_EQ(row[c], 1.5) << r << " " << c;  // group 1: scale 127
  }
}

TEST(Mxfp4, a_segment_decodes_like_the_whole_row) {
  const HandMade m;
  for (int r = 0; r < 6; ++r) {
    const std::vector<double> whole = m.row(r);
    for (int64_t begin : {0, 1, 7, 31, 32, 33}) {
      const std::vector<double> part = m.row(r, begin, 64 - begin);
      for (int64_t c = begin; c < 64; ++c) {
        ASSERT_EQ(std::memcmp(&part[c - begin], &whole[c], sizeof(double)), 0) << r << " " << begin << " " << c;
      }
    }
  }
}

TEST(Mxfp4, nan_scales_are_found_with_their_position) {
  std::vector<uint8_t> scales(4 * 3, 127);
  EXPECT_NO_THROW(check_e8m0_scales(scales.data(), 4, 3, 3, "t"));
  scales[2 * 3 + 1] = 0xFF;
  expect_error([&] { check_e8m0_scales(scales.data(), 4, 3, 3, "f.safetensors: tensor x"); },
               {"f.safetensors: tensor x", "0xFF", "row 2, group 1", "columns [32, 64)"});
  // Offsets give the position in the tensor a slice was taken from.
  expect_error([&] { check_e8m0_scales(scales.data(), 4, 3, 3, "y", 10, 4); }, {"row 12, group 5"});
  // A row stride wider than the groups skips the bytes between rows.
  std::vector<uint8_t> strided = {127, 127, 0xFF, 127, 127, 0xFF};
  EXPECT_NO_THROW(check_e8m0_scales(strided.data(), 2, 2, 3, "z"));
}

// --- config -------------------------------------------------------------------------------------

json layer_keys() {
  return json{{"hidden_size", 64},        {"moe_latent_size", 32},       {"n_routed_experts", 8},
              {"num_experts_per_tok", 2}, {"moe_intermediate_size", 64}, {"hidden_act", "silu"}};
}

// As Kimi K3 publishes it: every Linear quantized except the shared experts, attention and lm_head.
json k3_quantization() {
  return json::parse(R"({
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
      "group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
                    "symmetric": true, "dynamic": false, "observer": "minmax"},
        "input_activations": null,
        "output_activations": null,
        "format": "mxfp4-pack-quantized"
      }
    },
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*block_sparse_moe\\.gate$"],
    "kv_cache_scheme": null
  })");
}

LayerConfig parse(const json& config) { return LayerConfig::from_json(config.dump(), "q.json"); }

json with_quantization(const json& quantization) {
  json config = layer_keys();
  config["quantization_config"] = quantization;
  return config;
}

TEST(Mxfp4Config, compressed_tensors_mxfp4_covering_the_experts_is_mxfp4) {
  EXPECT_EQ(parse(layer_keys()).experts_format, ExpertWeightFormat::dense);
  EXPECT_EQ(parse(with_quantization(k3_quantization())).experts_format, ExpertWeightFormat::mxfp4);
  // Targets by regex, the format only at the top level, no ignore list.
  json by_regex = k3_quantization();
  by_regex["config_groups"]["group_0"]["targets"] = json::array({"re:.*experts\\.\\d+\\.w[123]$"});
  by_regex["config_groups"]["group_0"].erase("format");
  by_regex.erase("ignore");
  EXPECT_EQ(parse(with_quantization(by_regex)).experts_format, ExpertWeightFormat::mxfp4);
  // relu2: no w1, so a group covering only w2 and w3 is complete.
  json up_down = by_regex;
  up_down["config_groups"]["group_0"]["targets"] = json::array({"re:.*experts\\.\\d+\\.w[23]$"});
  json relu2 = with_quantization(up_down);
  relu2["hidden_act"] = "relu2";
  EXPECT_EQ(parse(relu2).experts_format, ExpertWeightFormat::mxfp4);
  // ...but silu needs w1 too.
  expect_error([&] { parse(with_quantization(up_down)); }, {"q.json", "experts.{e}.w1", "one format"});
}

TEST(Mxfp4Config, quantization_that_does_not_touch_the_experts_still_loads_dense) {
  // Experts ignored: whatever the scheme (here an unsupported one), the experts stay dense.
  json ignored = k3_quantization();
  ignored["ignore"].push_back("re:.*experts.*");
  ignored["config_groups"]["group_0"]["weights"]["num_bits"] = 8;
  ignored["format"] = "float-quantized";
  ignored["config_groups"]["group_0"]["format"] = "float-quantized";
  EXPECT_EQ(parse(with_quantization(ignored)).experts_format, ExpertWeightFormat::dense);
  // Only attention targeted.
  json attention = k3_quantization();
  attention["config_groups"]["group_0"]["targets"] = json::array({"re:.*self_attn.*"});
  attention["config_groups"]["group_0"]["weights"]["group_size"] = 128;
  EXPECT_EQ(parse(with_quantization(attention)).experts_format, ExpertWeightFormat::dense);
  // Exact module names that are not experts; no config groups at all.
  json names = k3_quantization();
  names["config_groups"]["group_0"]["targets"] = json::array({"model.layers.0.mlp.down_proj"});
  EXPECT_EQ(parse(with_quantization(names)).experts_format, ExpertWeightFormat::dense);
  json no_groups = k3_quantization();
  no_groups.erase("config_groups");
  EXPECT_EQ(parse(with_quantization(no_groups)).experts_format, ExpertWeightFormat::dense);
}

TEST(Mxfp4Config, unsupported_schemes_covering_the_experts_are_errors_naming_the_key) {
  const std::string weights = "quantization_config.config_groups.group_0.weights.";
  auto error_for = [](const std::function<void(json&)>& change, const std::vector<std::string>& parts) {
    json quantization = k3_quantization();
    change(quantization);
    expect_error([&] { parse(with_quantization(quantization)); }, parts);
  };
  error_for([](json& q) { q["config_groups"]["group_0"]["weights"]["group_size"] = 16; },
            {"q.json", weights + "group_size", "16", "32"});
  error_for([](json& q) { q["config_groups"]["group_0"]["weights"]["num_bits"] = 8; }, {weights + "num_bits", "8"});
  error_for([](json& q) { q["config_groups"]["group_0"]["weights"]["type"] = "int"; }, {weights + "type", "'int'"});
  error_for([](json& q) { q["config_groups"]["group_0"]["weights"]["strategy"] = "channel"; },
            {weights + "strategy", "channel"});
  error_for([](json& q) { q["config_groups"]["group_0"]["weights"]["group_size"] = "32"; },
            {weights + "group_size", "must be an integer"});
  error_for([](json& q) { q["config_groups"]["group_0"]["weights"].erase("num_bits"); },
            {"missing key", weights + "num_bits"});
  error_for([](json& q) { q["config_groups"]["group_0"]["format"] = "nvfp4-pack-quantized"; },
            {"quantization_config.config_groups.group_0.format", "nvfp4-pack-quantized"});
  error_for(
      [](json& q) {
        q["config_groups"]["group_0"].erase("format");
        q["format"] = "pack-quantized";
      },
      {"'quantization_config.format'", "pack-quantized"});
  error_for([](json& q) { q["quant_method"] = "fp8"; }, {"quantization_config.quant_method", "'fp8'"});
  error_for(
      [](json& q) {
        q["config_groups"]["group_0"]["input_activations"] = json{{"num_bits", 8}};
      },
      {"input_activations", "not supported"});
  error_for([](json& q) { q["ignore"] = json::array({"re:(unclosed"}); }, {"quantization_config.ignore[0]"});
  error_for([](json& q) { q["config_groups"]["group_1"] = q["config_groups"]["group_0"]; },
            {"'group_0' and 'group_1' both cover"});
  error_for([](json& q) { q = json::array(); }, {"'quantization_config' must be an object"});
}

TEST(Mxfp4Config, sizes_must_hold_whole_groups) {
  json config = with_quantization(k3_quantization());
  config["moe_latent_size"] = 48;
  expect_error([&] { parse(config); }, {"moe_latent_size", "multiple of the group size 32", "48"});
  config["moe_latent_size"] = 32;
  config["moe_intermediate_size"] = 80;
  expect_error([&] { parse(config); }, {"moe_intermediate_size", "80"});

  // A rank's slice of I must be whole groups too: I = 96 at tp 2 gives 48.
  config["moe_intermediate_size"] = 96;
  const LayerConfig parsed = parse(config);
  EXPECT_NO_THROW(validate_parallel(parsed, {1, 0}));
  expect_error([&] { validate_parallel(parsed, {2, 1}); }, {"tp 2", "moe_intermediate_size 96 / tp 2 = 48", "32"});
  LayerConfig dense = parsed;
  dense.experts_format = ExpertWeightFormat::dense;
  EXPECT_NO_THROW(validate_parallel(dense, {2, 1}));
}

TEST(Mxfp4Config, to_json_round_trips_the_format) {
  const LayerConfig config = kimi_mxfp4_config();
  const std::string text = config.to_json();
  EXPECT_NE(text.find("mxfp4-pack-quantized"), std::string::npos);
  EXPECT_EQ(LayerConfig::from_json(text), config);
  const LayerConfig dense = testing::kimi_like_config();
  EXPECT_EQ(dense.to_json().find("quantization_config"), std::string::npos);
  EXPECT_EQ(LayerConfig::from_json(dense.to_json()), dense);
}

TEST(Mxfp4Config, a_published_config_with_text_config_is_read_as_is) {
  json published = {{"architectures", json::array({"KimiK3ForConditionalGeneration"})},
                    {"model_type", "kimi_k3"},
                    {"vision_config", {{"hidden_size", 1152}}},
                    {"text_config", layer_keys()},
                    {"quantization_config", k3_quantization()}};
  const LayerConfig config = parse(published);
  EXPECT_EQ(config.hidden_size, 64);
  EXPECT_EQ(config.intermediate_size, 64);
  EXPECT_EQ(config.experts_format, ExpertWeightFormat::mxfp4);
  // quantization_config beside the layer keys.
  json nested = published;
  nested.erase("quantization_config");
  nested["text_config"]["quantization_config"] = k3_quantization();
  EXPECT_EQ(parse(nested), config);
  // Without any: dense.
  nested["text_config"].erase("quantization_config");
  EXPECT_EQ(parse(nested).experts_format, ExpertWeightFormat::dense);
  // Errors name text_config.
  nested["text_config"].erase("moe_latent_size");
  expect_error([&] { parse(nested); }, {"q.json: text_config", "moe_latent_size"});
  // The top level wins when it has the layer keys.
  json both = layer_keys();
  both["text_config"] = layer_keys();
  both["text_config"]["hidden_size"] = 128;
  EXPECT_EQ(parse(both).hidden_size, 64);
}

// --- weights --------------------------------------------------------------------------------------

class Mxfp4Weights : public ::testing::Test {
 protected:
  std::string path(const std::string& name) const { return scratch_.file(name); }

  // Copies `src` to `dst`, letting `edit` drop (return false), rename or replace each tensor.
  void rewrite(const std::string& src, const std::string& dst,
               const std::function<bool(std::string& name, HostTensor& tensor)>& edit) const {
    SafetensorsFile file = SafetensorsFile::open(src);
    std::vector<std::pair<std::string, HostTensor>> kept;
    for (const SafetensorsEntry& entry : file.entries()) {
      std::string name = entry.name;
      HostTensor tensor = file.read(entry.name);
      if (edit(name, tensor)) kept.emplace_back(std::move(name), std::move(tensor));
    }
    std::vector<std::pair<std::string, TensorView>> views;
    for (const auto& [name, tensor] : kept) views.emplace_back(name, tensor.view());
    write_safetensors(dst, views);
  }

  testing::ScratchDir scratch_{"mxfp4"};
};

using testing::expect_identical;

TEST(Mxfp4RandomWeights, are_u8_of_the_right_shapes_with_sensible_scales) {
  const LayerConfig config = kimi_mxfp4_config();
  const LayerWeights weights = make_random_layer_weights(config, DType::bf16, 7);
  EXPECT_EQ(weights.experts_format, ExpertWeightFormat::mxfp4);
  EXPECT_NO_THROW(validate_layer_weights(weights, config, 1));
  EXPECT_EQ(weights.expert_gate.dtype(), DType::u8);
  EXPECT_EQ(weights.expert_gate.shape(), (std::vector<int64_t>{6, 256, 32}));
  EXPECT_EQ(weights.expert_down.shape(), (std::vector<int64_t>{6, 64, 128}));
  EXPECT_EQ(weights.expert_up_scale.shape(), (std::vector<int64_t>{6, 256, 2}));
  EXPECT_EQ(weights.expert_down_scale.shape(), (std::vector<int64_t>{6, 64, 8}));
  // gate/up: fan-in 64, base 124 - 3; down: fan-in 256, base 124 - 4; each +-1.
  auto range = [](const HostTensor& scales) {
    int low = 255, high = 0;
    for (int64_t i = 0; i < scales.numel(); ++i) {
      low = std::min<int>(low, scales.data_as<uint8_t>()[i]);
      high = std::max<int>(high, scales.data_as<uint8_t>()[i]);
    }
    return std::pair<int, int>(low, high);
  };
  EXPECT_EQ(range(weights.expert_up_scale), std::make_pair(120, 122));
  EXPECT_EQ(range(weights.expert_down_scale), std::make_pair(119, 121));
  // Every code occurs.
  std::vector<int> seen(16, 0);
  for (int64_t i = 0; i < weights.expert_up.numel(); ++i) {
    ++seen[weights.expert_up.data_as<uint8_t>()[i] & 0xF];
    ++seen[weights.expert_up.data_as<uint8_t>()[i] >> 4];
  }
  for (int code = 0; code < 16; ++code) EXPECT_GT(seen[code], 0) << code;
  // Seeded.
  expect_identical(make_random_layer_weights(config, DType::bf16, 7), weights, "same seed");
  EXPECT_NE(std::memcmp(make_random_layer_weights(config, DType::bf16, 8).expert_up.data(), weights.expert_up.data(),
                        weights.expert_up.nbytes()),
            0);
}

TEST(Mxfp4RandomWeights, dequantise_exactly_or_not_at_all) {
  const LayerConfig config = kimi_mxfp4_config();
  for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
    const LayerWeights weights = make_random_layer_weights(config, dtype, 3);
    const LayerWeights dense = dequantize_layer_weights(weights);
    EXPECT_EQ(dense.experts_format, ExpertWeightFormat::dense);
    EXPECT_NO_THROW(validate_layer_weights(
        dense,
        [&] {
          LayerConfig c = config;
          c.experts_format = ExpertWeightFormat::dense;
          return c;
        }(),
        1));
    // Element (e=2, row 5, column c) of expert_down against a decode by hand.
    const int64_t rows = config.latent_size, cols = config.intermediate_size;
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t index = (2 * rows + 5) * cols + c;
      const uint8_t byte = weights.expert_down.data_as<uint8_t>()[index / 2];
      const uint8_t code = c % 2 == 0 ? byte & 0xF : byte >> 4;
      const uint8_t scale = weights.expert_down_scale.data_as<uint8_t>()[(2 * rows + 5) * (cols / 32) + c / 32];
      const double value = e2m1_value(code) * std::ldexp(1.0, scale - 127);
      EXPECT_EQ(testing::value_at(dense.expert_down, index), value) << dtype_name(dtype) << " " << c;
    }
  }
  // A value beyond the dtype's range is refused, named.
  LayerWeights big = make_random_layer_weights(config, DType::bf16, 3);
  big.expert_up.data_as<uint8_t>()[0] = 0x07;  // codes 7 (6.0) and 0 in columns 0 and 1 of expert 0, row 0
  big.expert_up_scale.data_as<uint8_t>()[0] = 254;
  expect_error([&] { dequantize_layer_weights(big); }, {"expert_up", "expert 0 at [0, 0]", "BF16"});
  LayerWeights tiny = make_random_layer_weights(config, DType::f16, 3);
  tiny.expert_gate.data_as<uint8_t>()[0] = 0x01;  // 0.5 * 2^-127: below F16's smallest subnormal
  tiny.expert_gate_scale.data_as<uint8_t>()[0] = 0;
  expect_error([&] { dequantize_layer_weights(tiny); }, {"expert_gate", "F16"});
}

TEST_F(Mxfp4Weights, saved_with_k3_names_and_loaded_as_the_in_memory_shards_at_every_tp) {
  const std::string prefix = "language_model.model.layers.3.block_sparse_moe.";
  for (const LayerConfig& config : {kimi_mxfp4_config(), nemotron_mxfp4_config()}) {
    const LayerWeights full = make_random_layer_weights(config, DType::bf16, 11);
    const std::string file_path = path("k3.safetensors");
    save_layer_weights(file_path, full, config, prefix);
    const SafetensorsFile file = SafetensorsFile::open(file_path);
    const int64_t l = config.latent_size, inter = config.intermediate_size;
    // The Kimi K3 names, U8, per expert; no dense expert names.
    const SafetensorsEntry* w3 = file.find(prefix + "experts.4.w3.weight_packed");
    ASSERT_NE(w3, nullptr);
    EXPECT_EQ(w3->dtype, DType::u8);
    EXPECT_EQ(w3->shape, (std::vector<int64_t>{inter, l / 2}));
    ASSERT_NE(file.find(prefix + "experts.0.w2.weight_scale"), nullptr);
    EXPECT_EQ(file.at(prefix + "experts.0.w2.weight_scale").shape, (std::vector<int64_t>{l, inter / 32}));
    EXPECT_EQ(file.find(prefix + "experts.0.w1.weight_packed") != nullptr, config.is_gated());
    EXPECT_EQ(file.find(prefix + "experts.0.up_proj.weight"), nullptr);
    EXPECT_NE(file.find(prefix + "routed_expert_down_proj.weight"), nullptr);  // dense names unchanged

    const LayerWeights dense_full = dequantize_layer_weights(full);
    for (int tp : {1, 2, 4, 8}) {
      for (int rank = 0; rank < tp; ++rank) {
        const ParallelConfig parallel{tp, rank};
        const LayerWeights loaded = load_layer_weights(file, config, prefix, parallel, DType::bf16);
        const LayerWeights sharded = shard_layer_weights(full, config, parallel);
        const std::string context = "tp " + std::to_string(tp) + " rank " + std::to_string(rank);
        expect_identical(loaded, sharded, context);
        EXPECT_NO_THROW(validate_layer_weights(loaded, config, tp));
        // The shard is the slice of the full tensors: its decoded values are the dense slice's.
        const LayerWeights dense_shard = dequantize_layer_weights(sharded);
        LayerConfig dense_config = config;
        dense_config.experts_format = ExpertWeightFormat::dense;
        expect_identical(dense_shard, shard_layer_weights(dense_full, dense_config, parallel), context + " decoded");
        // And byte for byte: rank r's down codes are columns [r I_r / 2, (r + 1) I_r / 2) of the full.
        const int64_t packed_width = inter / tp / 2;
        for (int64_t row = 0; row < l; row += 7) {
          const uint8_t* got = sharded.expert_down.data_as<uint8_t>() + (4 * l + row) * packed_width;
          const uint8_t* want = full.expert_down.data_as<uint8_t>() + (4 * l + row) * (inter / 2) + rank * packed_width;
          EXPECT_EQ(std::memcmp(got, want, packed_width), 0) << context << " row " << row;
        }
      }
    }
  }
}

TEST_F(Mxfp4Weights, bad_files_are_errors_naming_the_tensor) {
  const LayerConfig config = kimi_mxfp4_config();
  const std::string p = "m.";
  const LayerWeights full = make_random_layer_weights(config, DType::f32, 5);
  const std::string good = path("good.safetensors"), bad = path("bad.safetensors");
  save_layer_weights(good, full, config, p);
  auto load = [&](int tp = 1, int rank = 0) {
    return load_layer_weights(SafetensorsFile::open(bad), config, p, {tp, rank}, DType::f32);
  };

  // A NaN scale (0xFF) in w2 of expert 1 at row 3, group 5: rank 1 of 2 holds groups 4..7 and names
  // the position in the file's tensor; rank 0 does not read it.
  rewrite(good, bad, [&](std::string& name, HostTensor& tensor) {
    if (name == p + "experts.1.w2.weight_scale") tensor.data_as<uint8_t>()[3 * 8 + 5] = 0xFF;
    return true;
  });
  EXPECT_NO_THROW(load(2, 0));
  expect_error([&] { load(2, 1); }, {bad, "tensor m.experts.1.w2.weight_scale", "0xFF", "row 3, group 5"});
  // In w3 (rows sliced): row 200 of 256 is rank 1's at tp 2 (rows 128..255).
  rewrite(good, bad, [&](std::string& name, HostTensor& tensor) {
    if (name == p + "experts.4.w3.weight_scale") tensor.data_as<uint8_t>()[200 * 2 + 1] = 0xFF;
    return true;
  });
  expect_error([&] { load(); }, {"tensor m.experts.4.w3.weight_scale", "row 200, group 1"});
  expect_error([&] { load(2, 1); }, {"row 200, group 1"});

  // A missing scale tensor.
  rewrite(good, bad, [&](std::string& name, HostTensor&) { return name != p + "experts.2.w1.weight_scale"; });
  expect_error([&] { load(); }, {bad, "missing tensor m.experts.2.w1.weight_scale", "[256, 2]"});

  // Packed columns not in/2, scale columns not in/32.
  rewrite(good, bad, [&](std::string& name, HostTensor& tensor) {
    if (name == p + "experts.0.w3.weight_packed") tensor = HostTensor(DType::u8, {256, 64});
    return true;
  });
  expect_error([&] { load(); }, {"tensor m.experts.0.w3.weight_packed has shape [256, 64], expected [256, 32]"});
  rewrite(good, bad, [&](std::string& name, HostTensor& tensor) {
    if (name == p + "experts.3.w2.weight_scale") tensor = HostTensor(DType::u8, {64, 16});
    return true;
  });
  expect_error([&] { load(); }, {"tensor m.experts.3.w2.weight_scale has shape [64, 16], expected [64, 8]"});

  // BF16 where U8 is expected.
  rewrite(good, bad, [&](std::string& name, HostTensor& tensor) {
    if (name == p + "experts.0.w2.weight_packed") tensor = HostTensor(DType::bf16, {64, 128});
    return true;
  });
  expect_error([&] { load(); }, {"tensor m.experts.0.w2.weight_packed has dtype BF16", "must be U8"});

  // The config declares MXFP4 but the file holds dense experts, and the other way round.
  LayerConfig dense_config = config;
  dense_config.experts_format = ExpertWeightFormat::dense;
  const std::string dense_file = path("dense.safetensors");
  save_layer_weights(dense_file, make_random_layer_weights(dense_config, DType::f32, 5), dense_config, p);
  expect_error(
      [&] {
        load_layer_weights(SafetensorsFile::open(dense_file), config, p, {1, 0}, DType::f32);
      },
      {"declares MXFP4 experts", "dense expert tensors", "m.experts.0.gate_proj.weight",
       "m.experts.0.w1.weight_packed"});
  expect_error(
      [&] {
        load_layer_weights(SafetensorsFile::open(good), dense_config, p, {1, 0}, DType::f32);
      },
      {"holds MXFP4 expert tensors", "m.experts.0.w1.weight_packed", "declares dense experts"});

  // I / tp not a multiple of 32 (64 / 4 = 16, while tp 4 divides every size): refused by the
  // loader and by shard.
  LayerConfig narrow = config;
  narrow.intermediate_size = 64;
  const LayerWeights narrow_full = make_random_layer_weights(narrow, DType::f32, 5);
  save_layer_weights(bad, narrow_full, narrow, p);
  EXPECT_NO_THROW(load_layer_weights(SafetensorsFile::open(bad), narrow, p, {2, 1}, DType::f32));
  expect_error(
      [&] {
        load_layer_weights(SafetensorsFile::open(bad), narrow, p, {4, 0}, DType::f32);
      },
      {"tp 4", "moe_intermediate_size 64 / tp 4 = 16", "multiple of the group size 32"});
  expect_error([&] { shard_layer_weights(narrow_full, narrow, {4, 3}); }, {"tp 4", "64 / tp 4 = 16"});

  // More experts than the file holds, at a size whose buffers could not be allocated: the missing
  // tensor is named before anything is allocated.
  LayerConfig more = config;
  more.num_experts = 50000000;
  rewrite(good, bad, [&](std::string& name, HostTensor&) {
    return name != p + "gate.weight" && name != p + "gate.e_score_correction_bias";  // sized by E
  });
  expect_error(
      [&] {
        load_layer_weights(SafetensorsFile::open(bad), more, p, {1, 0}, DType::f32);
      },
      {"missing tensor m.experts.6.w1.weight_packed"});
}

TEST(Mxfp4Validate, names_the_field) {
  const LayerConfig config = kimi_mxfp4_config();
  const LayerWeights full = make_random_layer_weights(config, DType::f32, 2);
  LayerConfig dense_config = config;
  dense_config.experts_format = ExpertWeightFormat::dense;
  expect_error([&] { validate_layer_weights(full, dense_config, 1); }, {"experts are mxfp4", "declares dense"});

  LayerWeights no_scale = shard_layer_weights(full, config, {1, 0});
  no_scale.expert_down_scale = HostTensor();
  expect_error([&] { validate_layer_weights(no_scale, config, 1); }, {"expert_down_scale is missing", "[6, 64, 8]"});

  LayerWeights nan = shard_layer_weights(full, config, {1, 0});
  nan.expert_up_scale.data_as<uint8_t>()[(3 * 256 + 9) * 2 + 1] = 0xFF;
  expect_error([&] { validate_layer_weights(nan, config, 1); }, {"expert_up_scale of expert 3", "row 9, group 1"});

  LayerWeights wrong_dtype = shard_layer_weights(full, config, {1, 0});
  wrong_dtype.expert_gate = HostTensor(DType::f32, {6, 256, 32});
  expect_error([&] { validate_layer_weights(wrong_dtype, config, 1); }, {"expert_gate has dtype F32, expected U8"});

  // Dense weights carry no scales.
  LayerWeights dense = make_random_layer_weights(dense_config, DType::f32, 2);
  dense.expert_up_scale = HostTensor(DType::u8, {6, 256, 2});
  expect_error([&] { validate_layer_weights(dense, dense_config, 1); }, {"expert_up_scale is present", "dense"});
}

// --- the layer on the CPU reference -------------------------------------------------------------

// The MXFP4 layer at tp 1/2/4/8 (every tier at tp > 1) equals, bit for bit, the same layer run with
// dense experts holding the exactly dequantised values; all ranks agree; the tp-1 run is close to an
// independent double evaluation.
TEST(Mxfp4Layer, cpu_runs_equal_the_dense_runs_on_the_dequantised_weights) {
  for (const LayerConfig& config : {kimi_mxfp4_config(), nemotron_mxfp4_config()}) {
    LayerConfig dense_config = config;
    dense_config.experts_format = ExpertWeightFormat::dense;
    for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
      const LayerWeights full = make_random_layer_weights(config, dtype, 21);
      const LayerWeights dense_full = dequantize_layer_weights(full);
      LocalGroupInputs inputs = testing::random_inputs(config, 13, dtype, 9);
      for (int tp : {1, 2, 4, 8}) {
        std::vector<std::optional<TailTier>> tiers = {std::nullopt};
        if (tp > 1) {
          for (TailTier tier :
               {TailTier::native, TailTier::tail_fusion, TailTier::allreduce_overlap, TailTier::column_parallel}) {
            tiers.emplace_back(tier);
          }
        }
        for (const std::optional<TailTier>& tier : tiers) {
          LocalGroupOptions options;
          options.tp_size = tp;
          options.tier = tier;
          const auto mxfp4 = run_local_group(
              config, [&](const ParallelConfig& p) { return shard_layer_weights(full, config, p); }, inputs, options);
          const auto dense = run_local_group(
              dense_config, [&](const ParallelConfig& p) { return shard_layer_weights(dense_full, dense_config, p); },
              inputs, options);
          const std::string context = std::string(dtype_name(dtype)) + " tp " + std::to_string(tp) + " " +
                                      (tier ? std::string(to_string(*tier)) : "auto");
          for (int rank = 0; rank < tp; ++rank) {
            EXPECT_TRUE(bitwise_equal(mxfp4[rank].output.view(), dense[rank].output.view())) << context;
            EXPECT_TRUE(bitwise_equal(mxfp4[rank].output.view(), mxfp4[0].output.view())) << context;
          }
          EXPECT_TRUE(bitwise_equal(mxfp4[0].topk_ids.view(), dense[0].topk_ids.view())) << context;
          if (tp == 1) {
            const std::vector<double> exact = testing::naive_layer(dense_config, dense_full, inputs.hidden_states,
                                                                   mxfp4[0].topk_ids, mxfp4[0].topk_weights);
            const double error = testing::max_relative_error_vs(mxfp4[0].output, exact);
            EXPECT_LE(error, dtype == DType::f32 ? 1e-5 : 3e-2) << context;
            double largest = 0;
            for (double v : exact) largest = std::max(largest, std::fabs(v));
            EXPECT_GT(largest, 0.1) << context;  // the experts contribute values of a sensible size
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace latentmoe

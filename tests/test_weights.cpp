#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "error_test_util.h"
#include "latentmoe/config.h"
#include "latentmoe/error.h"
#include "latentmoe/safetensors.h"
#include "latentmoe/weights.h"
#include "layer_test_util.h"
#include "scratch_dir.h"

namespace latentmoe {
namespace {

namespace fs = std::filesystem;

// d 16, l 8, E 4 (+1 zero expert), I 12, Is 8: every tp in {1, 2, 4} divides them, and I != l so
// a transposed expert matrix has a visibly wrong shape.
LayerConfig small_config(Activation activation = Activation::silu) {
  LayerConfig config;
  config.hidden_size = 16;
  config.latent_size = 8;
  config.num_experts = 4;
  config.top_k = 2;
  config.intermediate_size = 12;
  config.num_shared_experts = 1;
  config.shared_intermediate_size = 8;
  config.activation = activation;
  config.use_latent_norm = true;
  config.zero_expert_num = 1;
  return config;
}

// Nemotron-H-like: relu2, no latent norm, no shared expert, no zero experts.
LayerConfig relu2_config() {
  LayerConfig config = small_config(Activation::relu2);
  config.num_shared_experts = 0;
  config.shared_intermediate_size = 0;
  config.use_latent_norm = false;
  config.zero_expert_num = 0;
  return config;
}

class WeightsTest : public ::testing::Test {
 protected:
  std::string path(const std::string& name) const { return scratch_.file(name); }
  testing::ScratchDir scratch_{"weights"};
  const fs::path& dir_ = scratch_.path();
};

using testing::expect_identical;

using testing::expect_error;

// Copies a safetensors file, letting `edit` drop (return false), rename or replace each tensor.
void rewrite(const std::string& src, const std::string& dst,
             const std::function<bool(std::string& name, HostTensor& tensor)>& edit) {
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

float element(const HostTensor& tensor, int64_t index) { return load_as_float(tensor.data(), tensor.dtype(), index); }

TEST(Weights, random_weights_are_seeded_and_bounded) {
  const LayerConfig config = small_config();
  const LayerWeights a = make_random_layer_weights(config, DType::bf16, 7);
  const LayerWeights b = make_random_layer_weights(config, DType::bf16, 7);
  expect_identical(a, b, "same seed");
  validate_layer_weights(a, config, 1);

  // splitmix64 values, computed independently: gate = U(-1,1)/sqrt(16) with U = (k - 2^23) / 2^23.
  EXPECT_EQ(a.gate.data_as<float>()[0], std::ldexp(4334249.0f, -25));
  EXPECT_EQ(a.gate.data_as<float>()[1], std::ldexp(7776271.0f, -25));
  EXPECT_EQ(a.gate.data_as<float>()[2], std::ldexp(2123166.0f, -25));

  const LayerWeights other = make_random_layer_weights(config, DType::bf16, 8);
  EXPECT_NE(std::memcmp(a.expert_up.data(), other.expert_up.data(), a.expert_up.nbytes()), 0);

  // Without the gate, every other field keeps its values.
  LayerWeights no_gate = make_random_layer_weights(config, DType::bf16, 7, /*with_gate=*/false);
  EXPECT_FALSE(no_gate.gate.defined());
  no_gate.gate = make_random_layer_weights(config, DType::bf16, 7).gate;
  expect_identical(no_gate, a, "with_gate=false");

  // Ranges: matrices within 1/sqrt(fan_in) (plus bf16 rounding), and (when large) spread over it.
  auto check_range = [](const HostTensor& tensor, const char* name, float low, float high) {
    float min_value = high, max_value = low;
    for (int64_t i = 0; i < tensor.numel(); ++i) {
      const float value = element(tensor, i);
      min_value = std::min(min_value, value);
      max_value = std::max(max_value, value);
    }
    const float slack = (high - low) * 0.01f;
    EXPECT_GE(min_value, low - slack) << name;
    EXPECT_LE(max_value, high + slack) << name;
    if (tensor.numel() >= 64) {
      EXPECT_LT(min_value, low + (high - low) * 0.1f) << name << ": values do not spread";
      EXPECT_GT(max_value, high - (high - low) * 0.1f) << name << ": values do not spread";
    }
  };
  const float inv_sqrt_l = 1.0f / std::sqrt(8.0f), inv_sqrt_d = 0.25f;
  check_range(a.gate, "gate", -inv_sqrt_d, inv_sqrt_d);
  check_range(a.score_bias, "score_bias", -0.1f, 0.1f);
  check_range(a.latent_norm, "latent_norm", 0.75f, 1.25f);
  check_range(a.down_proj, "down_proj", -inv_sqrt_d, inv_sqrt_d);
  check_range(a.up_proj, "up_proj", -inv_sqrt_l, inv_sqrt_l);
  check_range(a.expert_gate, "expert_gate", -inv_sqrt_l, inv_sqrt_l);
  check_range(a.expert_down, "expert_down", -1.0f / std::sqrt(12.0f), 1.0f / std::sqrt(12.0f));
  check_range(a.shared_down, "shared_down", -1.0f / std::sqrt(8.0f), 1.0f / std::sqrt(8.0f));
  EXPECT_EQ(a.gate.dtype(), DType::f32);
  EXPECT_EQ(a.latent_norm.dtype(), DType::f32);
  EXPECT_EQ(a.expert_up.dtype(), DType::bf16);

  // The same seed in f32 rounds to the bf16 values.
  const LayerWeights f32 = make_random_layer_weights(config, DType::f32, 7);
  for (int64_t i = 0; i < f32.expert_down.numel(); ++i) {
    ASSERT_EQ(a.expert_down.data_as<uint16_t>()[i], float_to_bf16(f32.expert_down.data_as<float>()[i])) << i;
  }
  EXPECT_THROW(make_random_layer_weights(config, DType::i32, 7), Error);
}

TEST_F(WeightsTest, saved_weights_load_as_the_in_memory_shards) {
  const LayerConfig config = small_config();
  const LayerWeights full = make_random_layer_weights(config, DType::bf16, 3);
  const std::string prefix = "model.layers.3.mlp.";
  const std::string file_path = path("layer.safetensors");
  save_layer_weights(file_path, full, config, prefix);

  const SafetensorsFile file = SafetensorsFile::open(file_path);
  const SafetensorsEntry* down = file.find(prefix + "experts.3.down_proj.weight");
  ASSERT_NE(down, nullptr);
  EXPECT_EQ(down->shape, (std::vector<int64_t>{8, 12}));
  EXPECT_EQ(down->dtype, DType::bf16);
  ASSERT_NE(file.find(prefix + "routed_expert_norm.weight"), nullptr);
  EXPECT_EQ(file.at(prefix + "gate.weight").shape, (std::vector<int64_t>{5, 16}));
  EXPECT_EQ(file.at(prefix + "gate.e_score_correction_bias").dtype, DType::f32);
  EXPECT_EQ(file.at(prefix + "shared_experts.down_proj.weight").shape, (std::vector<int64_t>{16, 8}));
  EXPECT_EQ(file.find("experts.0.up_proj.weight"), nullptr);  // everything carries the prefix
  // 5 replicated tensors, 3 per expert, 3 shared.
  EXPECT_EQ(file.entries().size(), 5u + 3u * 4 + 3u);

  for (int tp : {1, 2, 4}) {
    for (int rank = 0; rank < tp; ++rank) {
      const ParallelConfig parallel{tp, rank};
      const LayerWeights loaded = load_layer_weights(file, config, prefix, parallel, DType::bf16);
      const LayerWeights expected = shard_layer_weights(full, config, parallel);
      const std::string context = "tp " + std::to_string(tp) + " rank " + std::to_string(rank);
      expect_identical(loaded, expected, context);
      validate_layer_weights(loaded, config, tp);
    }
  }

  // Hand-indexed: tp 2 rank 1 holds rows [6, 12) of I and the same columns of the down projections.
  const LayerWeights shard = load_layer_weights(file, config, prefix, {2, 1}, DType::bf16);
  const auto full_at = [](const HostTensor& t, int64_t i, int64_t j, int64_t k) {
    return t.data_as<uint16_t>()[(i * t.size(1) + j) * t.size(2) + k];
  };
  EXPECT_EQ(full_at(shard.expert_up, 2, 0, 3), full_at(full.expert_up, 2, 6, 3));
  EXPECT_EQ(full_at(shard.expert_gate, 3, 5, 7), full_at(full.expert_gate, 3, 11, 7));
  EXPECT_EQ(full_at(shard.expert_down, 1, 5, 2), full_at(full.expert_down, 1, 5, 8));
  // Shared expert: Is_r = 4; rank 1 has rows [4, 8) of gate/up and columns [4, 8) of down.
  EXPECT_EQ(shard.shared_up.data_as<uint16_t>()[1 * 16 + 9], full.shared_up.data_as<uint16_t>()[5 * 16 + 9]);
  EXPECT_EQ(shard.shared_down.data_as<uint16_t>()[10 * 4 + 3], full.shared_down.data_as<uint16_t>()[10 * 8 + 7]);
  EXPECT_EQ(std::memcmp(shard.up_proj.data(), full.up_proj.data(), full.up_proj.nbytes()), 0);
  EXPECT_EQ(shard.expert_down.shape(), (std::vector<int64_t>{4, 8, 6}));

  // Without the prefix nothing is found.
  expect_error(
      [&] {
        load_layer_weights(file, config, "", {1, 0}, DType::bf16);
      },
      {"missing tensor routed_expert_down_proj.weight", file_path});
}

TEST_F(WeightsTest, converts_to_the_compute_dtype) {
  const LayerConfig config = small_config();
  const LayerWeights full = make_random_layer_weights(config, DType::f32, 11);
  save_layer_weights(path("f32.safetensors"), full, config);
  const SafetensorsFile file = SafetensorsFile::open(path("f32.safetensors"));

  const LayerWeights bf16 = load_layer_weights(file, config, "", {1, 0}, DType::bf16);
  EXPECT_EQ(bf16.dtype, DType::bf16);
  validate_layer_weights(bf16, config, 1);
  for (const HostTensor LayerWeights::*member :
       {&LayerWeights::down_proj, &LayerWeights::up_proj, &LayerWeights::expert_gate, &LayerWeights::expert_up,
        &LayerWeights::expert_down, &LayerWeights::shared_gate, &LayerWeights::shared_up, &LayerWeights::shared_down}) {
    const HostTensor& source = full.*member;
    const HostTensor& converted = bf16.*member;
    ASSERT_EQ(converted.dtype(), DType::bf16);
    for (int64_t i = 0; i < source.numel(); ++i) {
      ASSERT_EQ(converted.data_as<uint16_t>()[i], float_to_bf16(source.data_as<float>()[i])) << i;
    }
  }
  // Router and norm stay f32, bit for bit.
  EXPECT_EQ(std::memcmp(bf16.gate.data(), full.gate.data(), full.gate.nbytes()), 0);
  EXPECT_EQ(std::memcmp(bf16.score_bias.data(), full.score_bias.data(), full.score_bias.nbytes()), 0);
  EXPECT_EQ(std::memcmp(bf16.latent_norm.data(), full.latent_norm.data(), full.latent_norm.nbytes()), 0);

  const LayerWeights f16 = load_layer_weights(file, config, "", {2, 1}, DType::f16);
  const LayerWeights f32_shard = shard_layer_weights(full, config, {2, 1});
  for (int64_t i = 0; i < f32_shard.expert_down.numel(); ++i) {
    ASSERT_EQ(f16.expert_down.data_as<uint16_t>()[i], float_to_f16(f32_shard.expert_down.data_as<float>()[i])) << i;
  }

  // A BF16 file loaded as F32 widens exactly; loaded as F16 goes through float.
  const LayerWeights full_bf16 = make_random_layer_weights(config, DType::bf16, 11);
  save_layer_weights(path("bf16.safetensors"), full_bf16, config);
  const SafetensorsFile bf16_file = SafetensorsFile::open(path("bf16.safetensors"));
  const LayerWeights widened = load_layer_weights(bf16_file, config, "", {1, 0}, DType::f32);
  for (int64_t i = 0; i < full_bf16.expert_up.numel(); ++i) {
    ASSERT_EQ(widened.expert_up.data_as<float>()[i], bf16_to_float(full_bf16.expert_up.data_as<uint16_t>()[i]));
  }
  expect_error([&] { load_layer_weights(bf16_file, config, "", {1, 0}, DType::i32); }, {"I32", "compute dtype"});
}

TEST_F(WeightsTest, nemotron_aliases_and_relu2_without_gate_proj) {
  const LayerConfig config = relu2_config();
  const LayerWeights full = make_random_layer_weights(config, DType::bf16, 5, /*with_gate=*/false);
  EXPECT_FALSE(full.expert_gate.defined());
  EXPECT_FALSE(full.shared_up.defined());
  EXPECT_FALSE(full.latent_norm.defined());

  const std::string prefix = "backbone.layers.1.mixer.";
  save_layer_weights(path("canonical.safetensors"), full, config, prefix);
  rewrite(path("canonical.safetensors"), path("nemotron.safetensors"), [&](std::string& name, HostTensor&) {
    EXPECT_EQ(name.find("gate_proj"), std::string::npos) << name;  // relu2: none written
    if (name == prefix + "routed_expert_down_proj.weight") name = prefix + "fc1_latent_proj.weight";
    if (name == prefix + "routed_expert_up_proj.weight") name = prefix + "fc2_latent_proj.weight";
    return true;
  });
  const SafetensorsFile file = SafetensorsFile::open(path("nemotron.safetensors"));
  ASSERT_NE(file.find(prefix + "fc1_latent_proj.weight"), nullptr);
  ASSERT_EQ(file.find(prefix + "routed_expert_down_proj.weight"), nullptr);
  for (int rank = 0; rank < 2; ++rank) {
    const LayerWeights loaded = load_layer_weights(file, config, prefix, {2, rank}, DType::bf16);
    expect_identical(loaded, shard_layer_weights(full, config, {2, rank}), "rank " + std::to_string(rank));
    EXPECT_FALSE(loaded.gate.defined());
    EXPECT_TRUE(loaded.score_bias.defined());
    EXPECT_FALSE(loaded.expert_gate.defined());
  }

  // Both spellings at once is ambiguous.
  {
    const SafetensorsFile canonical = SafetensorsFile::open(path("canonical.safetensors"));
    std::vector<std::pair<std::string, HostTensor>> tensors;
    for (const SafetensorsEntry& entry : canonical.entries())
      tensors.emplace_back(entry.name, canonical.read(entry.name));
    tensors.emplace_back(prefix + "fc2_latent_proj.weight", canonical.read(prefix + "routed_expert_up_proj.weight"));
    std::vector<std::pair<std::string, TensorView>> views;
    for (const auto& [name, tensor] : tensors) views.emplace_back(name, tensor.view());
    write_safetensors(path("both.safetensors"), views);
  }
  const SafetensorsFile both = SafetensorsFile::open(path("both.safetensors"));
  expect_error(
      [&] {
        load_layer_weights(both, config, prefix, {1, 0}, DType::bf16);
      },
      {prefix + "routed_expert_up_proj.weight", prefix + "fc2_latent_proj.weight", "both"});

  // A gated config on the same file needs the gate projections.
  LayerConfig gated = config;
  gated.activation = Activation::silu;
  expect_error(
      [&] {
        load_layer_weights(file, gated, prefix, {1, 0}, DType::bf16);
      },
      {"missing tensor " + prefix + "experts.0.gate_proj.weight", "[12, 8]"});
}

TEST_F(WeightsTest, bad_tensors_are_errors_naming_them) {
  const LayerConfig config = small_config();
  const LayerWeights full = make_random_layer_weights(config, DType::bf16, 9);
  const std::string prefix = "model.layers.0.mlp.";
  const std::string good = path("good.safetensors");
  save_layer_weights(good, full, config, prefix);

  auto load_edited = [&](const std::string& name, const std::function<bool(std::string&, HostTensor&)>& edit) {
    const std::string edited = path(name);
    rewrite(good, edited, edit);
    return [&config, &prefix, edited] {
      const SafetensorsFile file = SafetensorsFile::open(edited);
      load_layer_weights(file, config, prefix, {2, 1}, DType::bf16);
    };
  };

  const std::string missing_name = prefix + "experts.2.up_proj.weight";
  expect_error(load_edited("missing.safetensors", [&](std::string& name, HostTensor&) { return name != missing_name; }),
               {"missing tensor " + missing_name, path("missing.safetensors"), "[12, 8]"});

  const std::string shape_name = prefix + "experts.1.down_proj.weight";
  expect_error(load_edited("shape.safetensors",
                           [&](std::string& name, HostTensor& tensor) {
                             if (name == shape_name) tensor = HostTensor(DType::bf16, {12, 8});  // transposed
                             return true;
                           }),
               {"tensor " + shape_name + " has shape [12, 8], expected [8, 12]", path("shape.safetensors")});

  const std::string dtype_name_ = prefix + "routed_expert_norm.weight";
  expect_error(load_edited("dtype.safetensors",
                           [&](std::string& name, HostTensor& tensor) {
                             if (name == dtype_name_) tensor = HostTensor(DType::i64, {8});
                             return true;
                           }),
               {"tensor " + dtype_name_ + " has dtype I64", path("dtype.safetensors")});

  const std::string norm_name = prefix + "routed_expert_norm.weight";
  expect_error(load_edited("no_norm.safetensors", [&](std::string& name, HostTensor&) { return name != norm_name; }),
               {"missing tensor " + norm_name, "[8]"});

  // Optional tensors are still checked when present.
  const std::string gate_name = prefix + "gate.weight";
  expect_error(load_edited("gate_shape.safetensors",
                           [&](std::string& name, HostTensor& tensor) {
                             if (name == gate_name) tensor = HostTensor(DType::f32, {4, 16});  // E, not E+Z
                             return true;
                           }),
               {"tensor " + gate_name + " has shape [4, 16], expected [5, 16]"});

  const std::string shared_name = prefix + "shared_experts.gate_proj.weight";
  expect_error(
      load_edited("no_shared.safetensors", [&](std::string& name, HostTensor&) { return name != shared_name; }),
      {"missing tensor " + shared_name, "[8, 16]"});

  // Optional ones may be absent.
  rewrite(good, path("no_router.safetensors"), [&](std::string& name, HostTensor&) {
    return name != gate_name && name != prefix + "gate.e_score_correction_bias";
  });
  const SafetensorsFile no_router = SafetensorsFile::open(path("no_router.safetensors"));
  const LayerWeights loaded = load_layer_weights(no_router, config, prefix, {1, 0}, DType::bf16);
  EXPECT_FALSE(loaded.gate.defined());
  EXPECT_FALSE(loaded.score_bias.defined());
  validate_layer_weights(loaded, config, 1);

  // A layout the config forbids.
  const SafetensorsFile file = SafetensorsFile::open(good);
  EXPECT_THROW(load_layer_weights(file, config, prefix, {3, 0}, DType::bf16), Error);  // 3 divides nothing
  EXPECT_THROW(load_layer_weights(file, config, prefix, {2, 2}, DType::bf16), Error);  // rank out of range
}

TEST(Weights, validate_names_the_field) {
  const LayerConfig config = small_config();
  LayerWeights weights = make_random_layer_weights(config, DType::bf16, 1);
  validate_layer_weights(weights, config, 1);
  // Full weights are not one rank's shard of a tp-2 group.
  expect_error([&] { validate_layer_weights(weights, config, 2); },
               {"expert_gate has shape [4, 12, 8], expected [4, 6, 8]"});
  expect_error([&] { validate_layer_weights(weights, config, 5); }, {"tp size 5"});

  weights.down_proj = HostTensor(DType::f32, {8, 16});
  expect_error([&] { validate_layer_weights(weights, config, 1); }, {"down_proj has dtype F32, expected BF16"});
  weights = make_random_layer_weights(config, DType::bf16, 1);
  weights.expert_up = HostTensor();
  expect_error([&] { validate_layer_weights(weights, config, 1); }, {"expert_up is missing", "[4, 12, 8]"});
  weights = make_random_layer_weights(config, DType::bf16, 1);
  weights.score_bias = HostTensor(DType::f32, {4});
  expect_error([&] { validate_layer_weights(weights, config, 1); }, {"score_bias has shape [4], expected [5]"});

  // Fields a relu2 layer without norm or shared expert must not have.
  const LayerConfig relu2 = relu2_config();
  LayerWeights extra = make_random_layer_weights(relu2, DType::f32, 1);
  validate_layer_weights(extra, relu2, 1);
  extra.expert_gate = HostTensor(DType::f32, {4, 12, 8});
  expect_error([&] { validate_layer_weights(extra, relu2, 1); }, {"expert_gate is present", "not gated"});
  extra.expert_gate = HostTensor();
  extra.latent_norm = HostTensor(DType::f32, {8});
  expect_error([&] { validate_layer_weights(extra, relu2, 1); }, {"latent_norm is present"});

  // Sharding checks its input.
  expect_error([&] { shard_layer_weights(extra, relu2, {2, 0}); }, {"latent_norm is present"});
  expect_error([&] { save_layer_weights("/nonexistent/x.safetensors", extra, relu2); }, {"latent_norm is present"});
}

TEST_F(WeightsTest, sizes_are_checked_against_the_file_before_anything_is_allocated) {
  const LayerConfig config = small_config();
  const LayerWeights full = make_random_layer_weights(config, DType::bf16, 3);
  const std::string prefix = "p.";
  const std::string good = path("good.safetensors");
  save_layer_weights(good, full, config, prefix);
  // Without the router gate (optional), the first tensor the config's sizes touch is an expert's.
  rewrite(good, path("no_router.safetensors"), [&](std::string& name, HostTensor&) {
    return name != prefix + "gate.weight" && name != prefix + "gate.e_score_correction_bias";
  });
  const SafetensorsFile file = SafetensorsFile::open(path("no_router.safetensors"));

  // E = I = 100000: the stacked expert buffers would be 3 x 160 GB. The loader must name the first
  // mismatching tensor at once, without allocating them.
  LayerConfig huge = config;
  huge.num_experts = 100000;
  huge.intermediate_size = 100000;
  const auto start = std::chrono::steady_clock::now();
  expect_error(
      [&] {
        load_layer_weights(file, huge, prefix, {1, 0}, DType::f32);
      },
      {path("no_router.safetensors"), "tensor p.experts.0.gate_proj.weight has shape [12, 8], expected [100000, 8]"});
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 2.0);

  // More experts than the file holds: the missing one is named, also before allocating.
  LayerConfig more = config;
  more.num_experts = 50000000;
  expect_error(
      [&] {
        load_layer_weights(file, more, prefix, {1, 0}, DType::f32);
      },
      {"missing tensor p.experts.4.gate_proj.weight"});

  // A wrong shared expert (checked last) is still reported before the experts are copied.
  LayerConfig shared = config;
  shared.shared_intermediate_size = 400000000;
  expect_error(
      [&] {
        load_layer_weights(file, shared, prefix, {1, 0}, DType::f32);
      },
      {"tensor p.shared_experts.gate_proj.weight has shape [8, 16], expected [400000000, 16]"});
}

}  // namespace
}  // namespace latentmoe

// End-to-end tests of the built `latentmoe` command: `run` on files for every tier, tp and dtype,
// and the error contract (one line on stderr, non-zero exit, no output file) for bad inputs.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "checkpoint_test_util.h"
#include "cli_test_util.h"
#include "latentmoe/compare.h"
#include "latentmoe/local_group.h"
#include "latentmoe/safetensors.h"
#include "latentmoe/weights.h"
#include "layer_test_util.h"
#include "scratch_dir.h"

namespace latentmoe {
namespace {

namespace fs = std::filesystem;

using testing::CommandResult;

class CliTest : public ::testing::Test {
 protected:
  CommandResult latentmoe(const std::string& arguments) { return testing::run_cli(arguments, dir); }

  // Writes config.json, weights.safetensors (names under `prefix`) and input.safetensors.
  void write_problem(const LayerConfig& config, DType dtype, int64_t num_tokens, const std::string& prefix,
                     bool with_logits = true) {
    std::ofstream(dir / "config.json") << config.to_json();
    weights = make_random_layer_weights(config, dtype, /*seed=*/17, /*with_gate=*/true);
    save_layer_weights((dir / "weights.safetensors").string(), weights, config, prefix);
    inputs = testing::random_inputs(config, num_tokens, dtype, /*seed=*/5);
    if (!with_logits) inputs.router_logits = HostTensor();
    std::vector<std::pair<std::string, TensorView>> tensors{{"hidden_states", inputs.hidden_states.view()}};
    if (with_logits) tensors.emplace_back("router_logits", inputs.router_logits.view());
    write_safetensors((dir / "input.safetensors").string(), tensors);
  }

  std::string files(const std::string& prefix = "") const {
    std::string args = "--config " + (dir / "config.json").string() + " --weights " +
                       (dir / "weights.safetensors").string() + " --input " + (dir / "input.safetensors").string() +
                       " --output " + (dir / "out.safetensors").string();
    if (!prefix.empty()) args += " --prefix " + prefix;
    return args;
  }

  // The command failed with exactly one line on stderr containing `fragment`, and wrote no output.
  void expect_failure(const CommandResult& result, const std::string& fragment) {
    EXPECT_NE(result.exit_code, 0);
    EXPECT_NE(result.err.find(fragment), std::string::npos) << "stderr: " << result.err;
    EXPECT_EQ(std::count(result.err.begin(), result.err.end(), '\n'), 1) << "stderr: " << result.err;
    EXPECT_FALSE(fs::exists(dir / "out.safetensors"));
    for (const auto& entry : fs::directory_iterator(dir)) {
      EXPECT_EQ(entry.path().filename().string().find("out.safetensors"), std::string::npos)
          << "partial file left: " << entry.path();
    }
  }

  testing::ScratchDir scratch{"cli"};
  const fs::path& dir = scratch.path();
  LayerWeights weights;
  LocalGroupInputs inputs;
};

TEST_F(CliTest, run_writes_the_same_output_as_the_library_for_every_tier_tp_and_dtype) {
  const LayerConfig config = testing::nemotron_like_config();
  for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
    write_problem(config, dtype, 17, "model.layers.3.mlp.");
    for (int tp : {1, 2, 4}) {
      for (const char* tier : {"auto", "native", "tail_fusion", "allreduce_overlap", "column_parallel"}) {
        if (tp == 1 && std::string(tier) != "auto" && std::string(tier) != "native") continue;
        fs::remove(dir / "out.safetensors");
        const CommandResult result = latentmoe("run " + files("model.layers.3.mlp.") + " --tp " + std::to_string(tp) +
                                               " --tier " + tier + " --backend cpu");
        ASSERT_EQ(result.exit_code, 0) << result.err;
        const SafetensorsFile out = SafetensorsFile::open((dir / "out.safetensors").string());
        ASSERT_EQ(out.entries().size(), 3u);
        const HostTensor output = out.read("output");
        EXPECT_EQ(output.dtype(), dtype);
        EXPECT_EQ(output.shape(), (std::vector<int64_t>{17, config.hidden_size}));
        EXPECT_EQ(out.at("topk_ids").dtype, DType::i32);
        EXPECT_EQ(out.at("topk_ids").shape, (std::vector<int64_t>{17, config.top_k}));
        EXPECT_EQ(out.at("topk_weights").dtype, DType::f32);

        LocalGroupOptions options;
        options.tp_size = tp;
        if (std::string(tier) != "auto") options.tier = parse_tail_tier(tier);
        const auto expected = run_local_group(
            config, [&](const ParallelConfig& p) { return shard_layer_weights(weights, config, p); }, inputs, options);
        EXPECT_TRUE(bitwise_equal(output.view(), expected[0].output.view())) << tier << " tp " << tp;
        EXPECT_TRUE(bitwise_equal(out.read("topk_ids").view(), expected[0].topk_ids.view()));
        EXPECT_EQ(out.metadata().at("tier"), std::string(to_string(expected[0].tier)));
      }
    }
  }
}

TEST_F(CliTest, run_computes_router_logits_from_the_gate_and_takes_latent_states) {
  const LayerConfig config = testing::kimi_like_config();
  write_problem(config, DType::f32, 5, "", /*with_logits=*/false);
  CommandResult result = latentmoe("run " + files() + " --tp 2");
  ASSERT_EQ(result.exit_code, 0) << result.err;
  EXPECT_NE(result.out.find("tp 2"), std::string::npos);

  HostTensor latent = testing::random_host_tensor(DType::f32, {5, config.latent_size}, 3);
  write_safetensors((dir / "input.safetensors").string(),
                    {{"hidden_states", inputs.hidden_states.view()}, {"latent_states", latent.view()}});
  fs::remove(dir / "out.safetensors");
  result = latentmoe("run " + files() + " --tp 4 --tier column_parallel");
  ASSERT_EQ(result.exit_code, 0) << result.err;
  const SafetensorsFile out = SafetensorsFile::open((dir / "out.safetensors").string());
  const std::vector<double> exact = testing::naive_layer(config, weights, inputs.hidden_states, out.read("topk_ids"),
                                                         out.read("topk_weights"), latent);
  EXPECT_LE(testing::max_relative_error_vs(out.read("output"), exact), 1e-5);
}

TEST_F(CliTest, bad_inputs_fail_with_one_line_and_no_output) {
  const LayerConfig config = testing::kimi_like_config();
  write_problem(config, DType::f32, 4, "p.");
  expect_failure(latentmoe("run " + files("p.") + " --tp 3"), "does not divide");
  expect_failure(latentmoe("run " + files("p.") + " --tier tail_fusion"), "tail_fusion");
  expect_failure(latentmoe("run " + files("p.") + " --tier fastest"), "fastest");
  expect_failure(latentmoe("run " + files("p.") + " --backend tpu"), "tpu");
  expect_failure(latentmoe("run " + files("wrong.")), "wrong.");  // no tensors under that prefix
  expect_failure(latentmoe("run " + files("p.") + " --tp 0"), "--tp");
  expect_failure(latentmoe("run " + files("p.") + " --tune-file " + (dir / "absent.json").string()), "absent.json");
  std::ofstream(dir / "tune.json") << R"({"format": "latentmoe-tune-1", "entries": [{"tp": 2}]})";
  expect_failure(latentmoe("run " + files("p.") + " --tp 2 --tune-file " + (dir / "tune.json").string()),
                 "tail_fusion_max_tokens");

  // Missing files.
  std::string no_config = files("p.");
  no_config.replace(no_config.find("config.json"), 11, "nope.json");
  expect_failure(latentmoe("run " + no_config), "nope.json");
  expect_failure(latentmoe("run --config " + (dir / "config.json").string()), "--weights");  // parse error: one line

  // A truncated weights file.
  const std::string bytes = testing::read_text_file(dir / "weights.safetensors");
  std::ofstream(dir / "weights.safetensors", std::ios::binary | std::ios::trunc) << bytes.substr(0, bytes.size() / 2);
  expect_failure(latentmoe("run " + files("p.")), "weights.safetensors");
  std::ofstream(dir / "weights.safetensors", std::ios::binary | std::ios::trunc) << bytes;

  // Inputs: wrong width, wrong dtype, missing hidden_states, logits of the wrong width.
  HostTensor wide(DType::f32, {4, config.hidden_size + 8});
  write_safetensors((dir / "input.safetensors").string(), {{"hidden_states", wide.view()}});
  expect_failure(latentmoe("run " + files("p.")), "hidden_states has shape");
  HostTensor ints(DType::i32, {4, config.hidden_size});
  write_safetensors((dir / "input.safetensors").string(), {{"hidden_states", ints.view()}});
  expect_failure(latentmoe("run " + files("p.")), "I32");
  write_safetensors((dir / "input.safetensors").string(), {{"router_logits", inputs.router_logits.view()}});
  expect_failure(latentmoe("run " + files("p.")), "hidden_states");
  HostTensor narrow_logits(DType::f32, {4, config.num_router_outputs() - 1});
  write_safetensors((dir / "input.safetensors").string(),
                    {{"hidden_states", inputs.hidden_states.view()}, {"router_logits", narrow_logits.view()}});
  expect_failure(latentmoe("run " + files("p.")), "router_logits has shape");

  // A config with a missing key.
  std::ofstream(dir / "config.json", std::ios::trunc) << R"({"hidden_size": 40})";
  expect_failure(latentmoe("run " + files("p.")), "moe_latent_size");
}

TEST_F(CliTest, backend_cuda_is_a_clear_error_without_a_gpu) {
#ifdef LATENTMOE_WITH_CUDA
  GTEST_SKIP() << "built with CUDA: the GPU tests cover --backend cuda";
#else
  const LayerConfig config = testing::kimi_like_config();
  write_problem(config, DType::f32, 2, "");
  expect_failure(latentmoe("run " + files() + " --backend cuda"), "CUDA");
#endif
}

TEST_F(CliTest, existing_output_is_untouched_when_a_run_fails) {
  const LayerConfig config = testing::kimi_like_config();
  write_problem(config, DType::f32, 2, "");
  std::ofstream(dir / "out.safetensors") << "previous";
  const CommandResult result = latentmoe("run " + files() + " --tp 3");
  EXPECT_NE(result.exit_code, 0);
  EXPECT_EQ(testing::read_text_file(dir / "out.safetensors"), "previous");
}

TEST_F(CliTest, inspect_lists_tensors_and_version_and_help_work) {
  const LayerConfig config = testing::kimi_like_config();
  write_problem(config, DType::bf16, 2, "m.");
  CommandResult result = latentmoe("inspect " + (dir / "weights.safetensors").string());
  ASSERT_EQ(result.exit_code, 0) << result.err;
  EXPECT_NE(result.out.find("m.experts.11.down_proj.weight"), std::string::npos);
  EXPECT_NE(result.out.find("BF16"), std::string::npos);
  EXPECT_NE(result.out.find("[24, 24]"), std::string::npos);  // l x I of one expert
  expect_failure(latentmoe("inspect " + (dir / "missing.safetensors").string()), "missing.safetensors");

  result = latentmoe("--version");
  EXPECT_EQ(result.exit_code, 0);
  EXPECT_NE(result.out.find("latentmoe"), std::string::npos);
  for (const char* command : {"--help", "run --help", "demo --help", "inspect --help", "bench --help"}) {
    result = latentmoe(command);
    EXPECT_EQ(result.exit_code, 0) << command;
    EXPECT_NE(result.out.find("Usage"), std::string::npos) << command;
  }
  result = latentmoe("frobnicate");
  EXPECT_NE(result.exit_code, 0);
}

// The error contract's bound (include/latentmoe/error.h): a header holding a 10 MB tensor name gives one
// line under 300 characters, 179 characters of the name and how many it left out.
TEST_F(CliTest, inspect_of_a_ten_megabyte_tensor_name_fails_with_a_short_line) {
  const std::string header =
      "{\"" + std::string(10'000'000, 'n') + R"(": {"dtype": "F31", "shape": [1], "data_offsets": [0, 4]}})";
  std::string length(8, '\0');
  for (int i = 0; i < 8; ++i) length[i] = static_cast<char>(header.size() >> (8 * i));
  std::ofstream(dir / "long.safetensors", std::ios::binary) << length << header << std::string(4, '\0');
  // Run in the scratch folder, so that the echoed path (a part of its own) is short.
  const CommandResult result =
      testing::run_cli("inspect long.safetensors", dir, "cd '" + dir.string() + "' && " + LATENTMOE_CLI_PATH);
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_EQ(result.err, "latentmoe: error: long.safetensors: tensor \"" + std::string(179, 'n') +
                            "...(+9,999,821 more)\": unknown dtype \"F31\"\n");
  EXPECT_LT(result.err.size(), 300u);
}

// A Kimi-K3-style checkpoint: MXFP4 routed experts under the K3 names and prefix, the config as
// published (layer keys and quantization_config under text_config). run gives, bit for bit, the
// library's result on dense experts holding the exactly dequantised values; inspect lists it.
TEST_F(CliTest, run_and_inspect_take_a_k3_style_mxfp4_checkpoint) {
  LayerConfig config = resized(kimi_k3_config(), {40, 64, 6, 3, 256, 40});
  config.experts_format = ExpertWeightFormat::mxfp4;
  const std::string prefix = "language_model.model.layers.3.block_sparse_moe.";
  std::ofstream(dir / "config.json") << R"({"architectures": ["KimiK3ForConditionalGeneration"], "text_config": )"
                                     << config.to_json() << "}";
  weights = make_random_layer_weights(config, DType::bf16, /*seed=*/17);
  save_layer_weights((dir / "weights.safetensors").string(), weights, config, prefix);
  inputs = testing::random_inputs(config, 7, DType::bf16, /*seed=*/5);
  write_safetensors((dir / "input.safetensors").string(),
                    {{"hidden_states", inputs.hidden_states.view()}, {"router_logits", inputs.router_logits.view()}});

  LayerConfig dense_config = config;
  dense_config.experts_format = ExpertWeightFormat::dense;
  const LayerWeights dense = dequantize_layer_weights(weights);
  for (int tp : {1, 2, 8}) {
    fs::remove(dir / "out.safetensors");
    const CommandResult result =
        latentmoe("run " + files(prefix) + " --tp " + std::to_string(tp) + " --tier native --backend cpu");
    ASSERT_EQ(result.exit_code, 0) << result.err;
    const SafetensorsFile out = SafetensorsFile::open((dir / "out.safetensors").string());
    LocalGroupOptions options;
    options.tp_size = tp;
    options.tier = TailTier::native;
    const auto expected = run_local_group(
        dense_config, [&](const ParallelConfig& p) { return shard_layer_weights(dense, dense_config, p); }, inputs,
        options);
    EXPECT_TRUE(bitwise_equal(out.read("output").view(), expected[0].output.view())) << "tp " << tp;
  }

  // The same checkpoint sharded as published (three shards and an index, with another layer's
  // tensors beside it): every tier at tp 4 gives what the single file gives, bit for bit.
  auto tensors = testing::read_all_tensors((dir / "weights.safetensors").string());
  tensors.emplace_back("language_model.model.layers.4.block_sparse_moe.experts.0.w1.weight_packed",
                       testing::random_host_tensor(DType::f32, {2, 2}, 3));
  const std::string index = testing::write_sharded_checkpoint(dir / "k3", tensors, 3);
  for (const char* tier : {"native", "tail_fusion", "allreduce_overlap", "column_parallel"}) {
    const std::string options = " --tp 4 --backend cpu --tier " + std::string(tier);
    fs::remove(dir / "out.safetensors");
    CommandResult result = latentmoe("run " + files(prefix) + options);
    ASSERT_EQ(result.exit_code, 0) << result.err;
    const HostTensor single = SafetensorsFile::open((dir / "out.safetensors").string()).read("output");
    for (const std::string& weights : {(dir / "k3").string(), index}) {
      fs::remove(dir / "out.safetensors");
      std::string command = "run " + files(prefix) + options;
      command.replace(command.find((dir / "weights.safetensors").string()),
                      (dir / "weights.safetensors").string().size(), weights);
      result = latentmoe(command);
      ASSERT_EQ(result.exit_code, 0) << result.err;
      EXPECT_TRUE(
          bitwise_equal(SafetensorsFile::open((dir / "out.safetensors").string()).read("output").view(), single.view()))
          << tier << " " << weights;
    }
  }

  // A config that does not declare the experts' format is one clear line.
  std::ofstream(dir / "config.json", std::ios::trunc) << dense_config.to_json();
  fs::remove(dir / "out.safetensors");
  expect_failure(latentmoe("run " + files(prefix) + " --backend cpu"), "holds MXFP4 expert tensors");

  const CommandResult listed = latentmoe("inspect " + (dir / "weights.safetensors").string());
  ASSERT_EQ(listed.exit_code, 0) << listed.err;
  EXPECT_NE(listed.out.find(prefix + "experts.5.w2.weight_packed"), std::string::npos);
  EXPECT_NE(listed.out.find(prefix + "experts.0.w1.weight_scale"), std::string::npos);
  EXPECT_NE(listed.out.find("U8"), std::string::npos);
}

TEST_F(CliTest, demo_passes) {
  const CommandResult result = latentmoe("demo --tokens 5 --runs 1");
  EXPECT_EQ(result.exit_code, 0) << result.err;
  EXPECT_NE(result.out.find("all checks passed"), std::string::npos);
  EXPECT_EQ(result.out.find("FAILED"), std::string::npos);
}

// demo --save writes files that `run` takes: each model's run at tp 2 and 4 matches its tp 1 run
// within bf16 rounding (the tp 1 run itself equals the library's, tested above), with the same
// routing; an unusable --save target and a bad --placement are one-line errors.
TEST_F(CliTest, demo_saves_files_that_run_takes) {
  const CommandResult saved = latentmoe("demo --backend cpu --tokens 6 --runs 1 --save " + (dir / "files").string());
  ASSERT_EQ(saved.exit_code, 0) << saved.err;
  for (const std::string model : {"kimi-k3-mini", "nemotron3-mini"}) {
    SCOPED_TRACE(model);
    const fs::path folder = dir / "files" / model;
    const std::string problem = "--config " + (folder / "config.json").string() + " --weights " +
                                (folder / "weights.safetensors").string() + " --input " +
                                (folder / "input.safetensors").string();
    std::vector<SafetensorsFile> outputs;
    for (int tp : {1, 2, 4}) {
      const fs::path out = dir / (model + "_tp" + std::to_string(tp) + ".safetensors");
      const CommandResult ran =
          latentmoe("run --backend cpu --tp " + std::to_string(tp) + " " + problem + " --output " + out.string());
      ASSERT_EQ(ran.exit_code, 0) << ran.err;
      outputs.push_back(SafetensorsFile::open(out.string()));
    }
    const HostTensor reference = outputs[0].read("output");
    EXPECT_EQ(reference.size(0), 6);
    for (size_t i = 1; i < outputs.size(); ++i) {
      EXPECT_LT(max_relative_error(outputs[i].read("output").view(), reference.view()), 3e-2);
      EXPECT_TRUE(bitwise_equal(outputs[i].read("topk_ids").view(), outputs[0].read("topk_ids").view()));
    }
  }
  std::ofstream(dir / "a_file") << "x";
  const CommandResult blocked = latentmoe("demo --backend cpu --tokens 2 --runs 1 --save " + (dir / "a_file").string());
  EXPECT_NE(blocked.exit_code, 0);
  EXPECT_NE(blocked.err.find("demo --save: cannot create"), std::string::npos) << blocked.err;
  EXPECT_EQ(std::count(blocked.err.begin(), blocked.err.end(), '\n'), 1) << blocked.err;
  const CommandResult placement = latentmoe("demo --backend cpu --placement sideways");
  EXPECT_NE(placement.exit_code, 0);
  EXPECT_NE(placement.err.find("sideways"), std::string::npos) << placement.err;
}

}  // namespace
}  // namespace latentmoe

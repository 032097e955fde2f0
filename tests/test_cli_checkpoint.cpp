// The `latentmoe` command on sharded Hugging Face checkpoints: `inspect` on a folder or an index
// (a summary from the index alone, or the tensors under --prefix from the shards holding them),
// `run --weights` on a folder, and the one-line error contract for bad checkpoints.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "checkpoint_test_util.h"
#include "cli_test_util.h"
#include "latentmoe/compare.h"
#include "latentmoe/safetensors.h"
#include "latentmoe/weights.h"
#include "layer_test_util.h"
#include "scratch_dir.h"

namespace latentmoe {
namespace {

namespace fs = std::filesystem;
using testing::shard_file_name;

using testing::CommandResult;

class CliCheckpoint : public ::testing::Test {
 protected:
  CommandResult latentmoe(const std::string& arguments) { return testing::run_cli(arguments, dir); }

  static void expect_failure(const CommandResult& result, const std::string& fragment) {
    EXPECT_EQ(result.exit_code, 1);
    EXPECT_NE(result.err.find(fragment), std::string::npos) << "stderr: " << result.err;
    EXPECT_EQ(std::count(result.err.begin(), result.err.end(), '\n'), 1) << "stderr: " << result.err;
    EXPECT_EQ(result.out, "") << "partial listing before the error";
  }

  // config.json, input.safetensors and the layer's weights under `prefix` as one file,
  // weights.safetensors, in `dir`.
  void write_problem(const std::string& prefix) {
    config = testing::nemotron_like_config();
    std::ofstream(dir / "config.json") << config.to_json();
    const LayerWeights weights = make_random_layer_weights(config, DType::bf16, /*seed=*/23, /*with_gate=*/true);
    save_layer_weights((dir / "weights.safetensors").string(), weights, config, prefix);
    const LocalGroupInputs inputs = testing::random_inputs(config, 9, DType::bf16, /*seed=*/7);
    write_safetensors((dir / "input.safetensors").string(),
                      {{"hidden_states", inputs.hidden_states.view()}, {"router_logits", inputs.router_logits.view()}});
  }

  std::string run_arguments(const std::string& weights, const std::string& output, const std::string& prefix) const {
    return "run --config " + (dir / "config.json").string() + " --weights " + weights + " --input " +
           (dir / "input.safetensors").string() + " --output " + (dir / output).string() + " --prefix " + prefix +
           " --tp 2 --backend cpu";
  }

  testing::ScratchDir scratch{"cli_checkpoint"};
  const fs::path& dir = scratch.path();
  LayerConfig config;
};

TEST_F(CliCheckpoint, inspect_summarises_a_sharded_checkpoint_from_the_index_alone) {
  write_problem("model.layers.3.mlp.");
  auto tensors = testing::read_all_tensors((dir / "weights.safetensors").string());
  const size_t count = tensors.size();
  const std::string index = testing::write_sharded_checkpoint(dir / "ckpt", tensors, 3);
  // The summary reads no shard: a missing one does not matter.
  fs::remove(dir / "ckpt" / shard_file_name(2, 3));

  for (const std::string& path : {(dir / "ckpt").string(), index}) {
    const CommandResult result = latentmoe("inspect " + path);
    ASSERT_EQ(result.exit_code, 0) << result.err;
    EXPECT_NE(result.out.find(index + ": " + std::to_string(count) + " tensors in 3 shards"), std::string::npos)
        << result.out;
    for (int shard = 0; shard < 3; ++shard) {
      const size_t in_shard = count / 3 + (static_cast<size_t>(shard) < count % 3 ? 1 : 0);
      EXPECT_NE(result.out.find(shard_file_name(shard, 3) + "  " + std::to_string(in_shard) + "\n"), std::string::npos)
          << result.out;
    }
    EXPECT_NE(result.out.find("# metadata total_size = "), std::string::npos) << result.out;
  }
}

TEST_F(CliCheckpoint, inspect_with_a_prefix_lists_its_tensors_and_their_shards) {
  // Layer 3's tensors in two shards; layer 4's one tensor alone in a third, which is corrupt: it is
  // never opened for layer 3.
  write_problem("model.layers.3.mlp.");
  const SafetensorsFile weights = SafetensorsFile::open((dir / "weights.safetensors").string());
  fs::create_directories(dir / "ckpt");
  std::vector<std::pair<std::string, TensorView>> first, second;
  std::vector<HostTensor> keep;
  std::vector<std::pair<std::string, std::string>> weight_map;
  for (const auto& entry : weights.entries()) {
    keep.push_back(weights.read(entry.name));
    auto& shard = keep.size() % 2 == 0 ? first : second;
    shard.emplace_back(entry.name, keep.back().view());
    weight_map.emplace_back(entry.name, keep.size() % 2 == 0 ? "a.safetensors" : "b.safetensors");
  }
  write_safetensors((dir / "ckpt" / "a.safetensors").string(), first);
  write_safetensors((dir / "ckpt" / "b.safetensors").string(), second);
  std::ofstream(dir / "ckpt" / "c.safetensors") << "corrupt";
  weight_map.emplace_back("model.layers.4.mlp.gate.weight", "c.safetensors");
  testing::write_index(dir / "ckpt" / "model.safetensors.index.json", weight_map);

  CommandResult result = latentmoe("inspect " + (dir / "ckpt").string() + " --prefix model.layers.3.mlp.");
  ASSERT_EQ(result.exit_code, 0) << result.err;
  for (const auto& entry : weights.entries()) {
    const size_t line = result.out.find(entry.name + " ");
    ASSERT_NE(line, std::string::npos) << entry.name << "\n" << result.out;
    const std::string text = result.out.substr(line, result.out.find('\n', line) - line);
    EXPECT_NE(text.find(std::string(dtype_name(entry.dtype))), std::string::npos) << text;
    EXPECT_NE(text.find(shape_string(entry.shape)), std::string::npos) << text;
    EXPECT_NE(text.find(std::to_string(entry.end - entry.begin)), std::string::npos) << text;
  }
  EXPECT_EQ(result.out.find("model.layers.4"), std::string::npos) << result.out;
  EXPECT_NE(
      result.out.find("# " + std::to_string(weights.entries().size()) + " tensors under prefix model.layers.3.mlp., "),
      std::string::npos)
      << result.out;
  EXPECT_NE(result.out.find("in 2 of 3 shards"), std::string::npos) << result.out;

  // The corrupt shard is an error only when asked for.
  expect_failure(latentmoe("inspect " + (dir / "ckpt").string() + " --prefix model.layers.4."),
                 "shard \"c.safetensors\" (holding tensor \"model.layers.4.mlp.gate.weight\")");
}

TEST_F(CliCheckpoint, inspect_prefix_filters_a_single_file_too) {
  write_problem("model.layers.3.mlp.");
  const CommandResult all = latentmoe("inspect " + (dir / "weights.safetensors").string());
  ASSERT_EQ(all.exit_code, 0) << all.err;
  const CommandResult some =
      latentmoe("inspect " + (dir / "weights.safetensors").string() + " --prefix model.layers.3.mlp.experts.0.");
  ASSERT_EQ(some.exit_code, 0) << some.err;
  EXPECT_NE(some.out.find("model.layers.3.mlp.experts.0.up_proj.weight"), std::string::npos) << some.out;
  EXPECT_EQ(some.out.find("model.layers.3.mlp.experts.1."), std::string::npos) << some.out;
  EXPECT_LT(some.out.size(), all.out.size());
}

TEST_F(CliCheckpoint, bad_checkpoints_are_one_line_errors) {
  fs::create_directories(dir / "two");
  write_problem("");
  fs::copy_file(dir / "weights.safetensors", dir / "two" / "a.safetensors");
  fs::copy_file(dir / "weights.safetensors", dir / "two" / "b.safetensors");
  expect_failure(latentmoe("inspect " + (dir / "two").string()),
                 "no model.safetensors.index.json and 2 .safetensors files (a.safetensors, b.safetensors)");

  fs::create_directories(dir / "empty");
  expect_failure(latentmoe("inspect " + (dir / "empty").string()), "no .safetensors file in this folder");

  fs::create_directories(dir / "escape");
  testing::write_index(dir / "escape" / "model.safetensors.index.json", {{"x", "../weights.safetensors"}});
  expect_failure(latentmoe("inspect " + (dir / "escape").string()), "shard name \"../weights.safetensors\" has a");

  std::ofstream(dir / "escape" / "model.safetensors.index.json") << R"({"weight_map": {"x": "a", "x": "a"}})";
  expect_failure(latentmoe("inspect " + (dir / "escape").string()), "weight_map lists tensor \"x\" twice");
}

TEST_F(CliCheckpoint, run_accepts_a_folder_holding_one_safetensors_file) {
  const std::string prefix = "model.layers.3.mlp.";
  write_problem(prefix);
  fs::create_directories(dir / "w");
  fs::copy_file(dir / "weights.safetensors", dir / "w" / "weights.safetensors");
  CommandResult result = latentmoe(run_arguments((dir / "weights.safetensors").string(), "file.safetensors", prefix));
  ASSERT_EQ(result.exit_code, 0) << result.err;
  result = latentmoe(run_arguments((dir / "w").string(), "folder.safetensors", prefix));
  ASSERT_EQ(result.exit_code, 0) << result.err;
  const SafetensorsFile a = SafetensorsFile::open((dir / "file.safetensors").string());
  const SafetensorsFile b = SafetensorsFile::open((dir / "folder.safetensors").string());
  EXPECT_TRUE(bitwise_equal(a.read("output").view(), b.read("output").view()));
  EXPECT_TRUE(bitwise_equal(a.read("topk_ids").view(), b.read("topk_ids").view()));
}

// latentmoe run reads its weights through a Checkpoint (tools/cmd_run.cpp): the same layer, sharded over
// three files with an index, gives output bit-identical to the one file's, by folder and by index.
TEST_F(CliCheckpoint, run_reads_a_sharded_checkpoint) {
  const std::string prefix = "model.layers.3.mlp.";
  write_problem(prefix);
  auto tensors = testing::read_all_tensors((dir / "weights.safetensors").string());
  tensors.emplace_back("model.layers.4.mlp.gate.weight", testing::random_host_tensor(DType::f32, {3, 3}, 1));
  const std::string index = testing::write_sharded_checkpoint(dir / "ckpt", tensors, 3);
  CommandResult result = latentmoe(run_arguments((dir / "weights.safetensors").string(), "file.safetensors", prefix));
  ASSERT_EQ(result.exit_code, 0) << result.err;
  const SafetensorsFile expected = SafetensorsFile::open((dir / "file.safetensors").string());
  for (const std::string& weights : {(dir / "ckpt").string(), index}) {
    fs::remove(dir / "sharded.safetensors");
    result = latentmoe(run_arguments(weights, "sharded.safetensors", prefix));
    ASSERT_EQ(result.exit_code, 0) << result.err;
    const SafetensorsFile out = SafetensorsFile::open((dir / "sharded.safetensors").string());
    EXPECT_TRUE(bitwise_equal(out.read("output").view(), expected.read("output").view()));
    EXPECT_TRUE(bitwise_equal(out.read("topk_ids").view(), expected.read("topk_ids").view()));
  }
}

}  // namespace
}  // namespace latentmoe

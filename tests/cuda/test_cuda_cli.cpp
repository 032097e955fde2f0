// `latentmoe run --backend cuda` end to end: the command-line tool itself on the GPU, not only the
// library under it (tests/cuda/test_cuda_runner.cpp). Issue 16's case: a Kimi-K3-style checkpoint
// (MXFP4 routed experts under the K3 names and prefix, the config as published with its layer keys
// under text_config, three shards and an index) run at tp 1, 2, 4 and 8 (ranks simulated on GPU 0)
// against the same command on the CPU backend: within bf16 rounding, the same routing.
//
// The tool run is the one beside this test binary where there is one (scripts/gpu_build.sh copies both
// to one folder, which is what the GPU machine gets), else the build tree's.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>

#include "checkpoint_test_util.h"
#include "cli_test_util.h"
#include "cuda_test_util.h"
#include "latentmoe/compare.h"
#include "latentmoe/presets.h"
#include "latentmoe/safetensors.h"
#include "latentmoe/weights.h"
#include "layer_test_util.h"
#include "scratch_dir.h"

namespace latentmoe::cuda::testing {
namespace {

namespace fs = std::filesystem;

std::string tool_path() {
  std::error_code error;
  const fs::path self = fs::read_symlink("/proc/self/exe", error);
  if (!error) {
    const fs::path beside = self.parent_path() / "latentmoe";
    if (fs::is_regular_file(beside)) return beside.string();
  }
  return LATENTMOE_CLI_PATH;
}

TEST(CudaCli, run_takes_a_sharded_k3_mxfp4_checkpoint_at_every_tp) {
  LATENTMOE_REQUIRE_GPU();
  const std::string tool = tool_path();
  ASSERT_TRUE(fs::is_regular_file(tool)) << "no latentmoe tool at " << tool;
  const latentmoe::testing::ScratchDir scratch("cuda_cli");
  const fs::path& dir = scratch.path();

  LayerConfig config = resized(kimi_k3_config(), {40, 64, 6, 3, 256, 40});
  config.experts_format = ExpertWeightFormat::mxfp4;
  const std::string prefix = "language_model.model.layers.3.block_sparse_moe.";
  std::ofstream(dir / "config.json") << R"({"architectures": ["KimiK3ForConditionalGeneration"], "text_config": )"
                                     << config.to_json() << "}";
  const fs::path single = dir / "single.safetensors";
  save_layer_weights(single.string(), make_random_layer_weights(config, DType::bf16, 31), config, prefix);
  const std::string index = latentmoe::testing::write_sharded_checkpoint(
      dir / "k3", latentmoe::testing::read_all_tensors(single.string()), 3);
  fs::remove(single);
  // 37 tokens: the MXFP4 decode kernels in batches of 8 and a last batch of 5.
  const LocalGroupInputs inputs = latentmoe::testing::random_inputs(config, 37, DType::bf16, 37);
  write_safetensors((dir / "input.safetensors").string(),
                    {{"hidden_states", inputs.hidden_states.view()}, {"router_logits", inputs.router_logits.view()}});

  auto run = [&](int tp, const std::string& backend, const fs::path& out) {
    return latentmoe::testing::run_cli("run --config " + (dir / "config.json").string() + " --weights " + index +
                                           " --input " + (dir / "input.safetensors").string() + " --output " +
                                           out.string() + " --prefix " + prefix + " --tp " + std::to_string(tp) +
                                           " --backend " + backend + " --placement simulated",
                                       dir, tool);
  };
  for (int tp : {1, 2, 4, 8}) {
    SCOPED_TRACE("tp " + std::to_string(tp));
    const fs::path cpu_out = dir / ("cpu_tp" + std::to_string(tp) + ".safetensors");
    const fs::path gpu_out = dir / ("cuda_tp" + std::to_string(tp) + ".safetensors");
    const latentmoe::testing::CommandResult cpu_run = run(tp, "cpu", cpu_out);
    ASSERT_EQ(cpu_run.exit_code, 0) << cpu_run.err;
    const latentmoe::testing::CommandResult gpu_run = run(tp, "cuda", gpu_out);
    ASSERT_EQ(gpu_run.exit_code, 0) << gpu_run.err;
    const SafetensorsFile cpu = SafetensorsFile::open(cpu_out.string());
    const SafetensorsFile gpu = SafetensorsFile::open(gpu_out.string());
    const HostTensor output = gpu.read("output");
    EXPECT_EQ(count_non_finite(output), 0);
    EXPECT_LT(relative_error(output, cpu.read("output")), tolerance(DType::bf16));
    EXPECT_TRUE(bitwise_equal(gpu.read("topk_ids").view(), cpu.read("topk_ids").view()));
  }
}

}  // namespace
}  // namespace latentmoe::cuda::testing

// `latentmoe tune`: the pure derivation of the crossovers from measured times (derive_crossovers),
// the table's writer (to_json round trip, atomic write), and the command end to end on the CPU
// backend: a table that `latentmoe run --tune-file` accepts, and bad options failing with one line,
// a non-zero exit and no output file.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "cli_test_util.h"
#include "error_test_util.h"
#include "latentmoe/error.h"
#include "latentmoe/safetensors.h"
#include "latentmoe/tune.h"
#include "latentmoe/weights.h"
#include "layer_test_util.h"
#include "scratch_dir.h"

namespace latentmoe {
namespace {

namespace fs = std::filesystem;

using testing::message_of;

// One row of a hand-made time table: native, tail_fusion, allreduce_overlap, column_parallel (ms;
// a negative value stands for "not run").
TierTimes row(int64_t tokens, double native, double tail_fusion, double overlap, double column) {
  TierTimes times;
  times.num_tokens = tokens;
  const double values[] = {native, tail_fusion, overlap, column};
  for (size_t i = 0; i < 4; ++i) {
    if (values[i] >= 0) times.ms[i] = values[i];
  }
  return times;
}

constexpr double kNotRun = -1;

TEST(DeriveCrossovers, the_usual_shape_tier0_then_overlap_then_column) {
  const Crossovers c = derive_crossovers({row(1, 9, 1, 2, 3), row(2, 9, 1, 2, 3), row(4, 9, 3, 2, 4),
                                          row(8, 9, 5, 2, 4), row(16, 9, 6, 5, 4), row(32, 9, 9, 8, 7)});
  EXPECT_EQ(c.tail_fusion_max_tokens, 2);
  EXPECT_EQ(c.shared_stream_token_threshold, 8);
}

TEST(DeriveCrossovers, tier0_never_wins_or_always_wins) {
  Crossovers never = derive_crossovers({row(1, 1, 5, 2, 3), row(4, 1, 5, 2, 3), row(16, 1, 5, 2, 3)});
  EXPECT_EQ(never.tail_fusion_max_tokens, 0);  // 0 turns tier 0 off
  EXPECT_EQ(never.shared_stream_token_threshold, 16);
  Crossovers always = derive_crossovers({row(1, 9, 1, 3, 2), row(4, 9, 1, 3, 2), row(16, 9, 1, 3, 2)});
  EXPECT_EQ(always.tail_fusion_max_tokens, 16);  // the largest measured: nothing extrapolated
  EXPECT_EQ(always.shared_stream_token_threshold, 0);
}

TEST(DeriveCrossovers, native_does_not_take_part) {
  // native is fastest everywhere, yet the policy never takes it on the fused path.
  const Crossovers c = derive_crossovers({row(1, 0.1, 1, 2, 3), row(2, 0.1, 4, 2, 3)});
  EXPECT_EQ(c.tail_fusion_max_tokens, 1);
  EXPECT_EQ(c.shared_stream_token_threshold, 2);
}

TEST(DeriveCrossovers, a_point_costs_what_it_measured) {
  // Tier 0 wins at 1, 2, loses badly at 4 (5 against 2), wins again at 8: taking it up to 8 would cost
  // 2.5x at 4, stopping at 2 costs 2x at 8 (overlap's 2 against tier 0's 1): it stops at 2.
  // Without tier 0, overlap loses at 2 (3 against 2) but wins at 4 and 8: overlap up to 8 (the worst
  // ratio is 3 either way; the sum is lowest).
  const Crossovers c =
      derive_crossovers({row(1, 9, 1, 2, 3), row(2, 9, 1, 3, 2), row(4, 9, 5, 2, 3), row(8, 9, 1, 2, 3)});
  EXPECT_EQ(c.tail_fusion_max_tokens, 2);
  EXPECT_EQ(c.shared_stream_token_threshold, 8);
}

TEST(DeriveCrossovers, a_near_tie_does_not_turn_a_tier_off) {
  // Tier 0 a hair slower at one token (noise, 0.2%) and clearly faster at 8 and 64: it stays on through
  // 64 (the rule it replaced turned tier 0 off for good at the first loss; seen on one H200, nemotron3-super
  // on simulated ranks at f312294).
  const Crossovers c =
      derive_crossovers({row(1, 0.1676, 0.1689, 0.1685, 0.1715), row(8, 0.4230, 0.4113, 0.4294, 0.4135),
                         row(64, 0.7477, 0.7442, 0.7514, 0.7499), row(512, 1.2324, 1.43, 1.2371, 1.2024)});
  EXPECT_EQ(c.tail_fusion_max_tokens, 64);
  EXPECT_EQ(c.shared_stream_token_threshold, 1);  // overlap at 1 (0.1685 against 0.1715), column from 8
}

TEST(DeriveCrossovers, ties_go_to_the_tier_the_policy_tries_first) {
  const Crossovers c = derive_crossovers({row(1, 9, 2, 2, 2), row(2, 9, 3, 2, 2), row(4, 9, 9, 3, 2)});
  EXPECT_EQ(c.tail_fusion_max_tokens, 1);         // tied with both rivals at 1
  EXPECT_EQ(c.shared_stream_token_threshold, 2);  // tied with column_parallel at 1 and 2
}

TEST(DeriveCrossovers, a_tier_that_does_not_run_is_passed_over_as_the_policy_does) {
  // Tier 0 does not run at 8, overlap not at 4: the policy falls through to the next tier there, so
  // neither gap ends a threshold (overlap up to 16 takes column at 4 and overlap at 8).
  Crossovers c =
      derive_crossovers({row(1, 9, 1, 2, 3), row(4, 9, 1, kNotRun, 3), row(8, 9, kNotRun, 2, 3), row(16, 9, 1, 2, 3)});
  EXPECT_EQ(c.tail_fusion_max_tokens, 16);
  EXPECT_EQ(c.shared_stream_token_threshold, 16);
  // A rival that does not run: the tier that does wins. At 1 only tier 0 (and native) ran; overlap up
  // to 2, where column does not run, column from 4.
  c = derive_crossovers({row(1, 9, 5, kNotRun, kNotRun), row(2, 9, 5, 1, kNotRun), row(4, 9, 5, 1, 0.5)});
  EXPECT_EQ(c.tail_fusion_max_tokens, 1);
  EXPECT_EQ(c.shared_stream_token_threshold, 2);
  // Nothing but native measured (e.g. a layer without a shared expert).
  c = derive_crossovers({row(1, 1, kNotRun, kNotRun, kNotRun), row(2, 1, kNotRun, kNotRun, kNotRun)});
  EXPECT_EQ(c.tail_fusion_max_tokens, 0);
  EXPECT_EQ(c.shared_stream_token_threshold, 0);
}

TEST(DeriveCrossovers, rejects_bad_tables) {
  EXPECT_NE(message_of([] { derive_crossovers({}); }).find("no measured"), std::string::npos);
  EXPECT_NE(message_of([] {
              derive_crossovers({row(4, 1, 1, 1, 1), row(2, 1, 1, 1, 1)});
            }).find("strictly increasing"),
            std::string::npos);
  EXPECT_NE(message_of([] {
              derive_crossovers({row(2, 1, 1, 1, 1), row(2, 1, 1, 1, 1)});
            }).find("strictly increasing"),
            std::string::npos);
  EXPECT_NE(message_of([] { derive_crossovers({row(0, 1, 1, 1, 1)}); }).find("below 1"), std::string::npos);
  TierTimes nan = row(1, 1, 1, 1, 1);
  nan.ms[2] = std::numeric_limits<double>::quiet_NaN();
  EXPECT_NE(message_of([&] { derive_crossovers({nan}); }).find("allreduce_overlap"), std::string::npos);
  TierTimes negative = row(1, 1, 1, 1, 1);
  negative.ms[1] = -0.5;
  EXPECT_NE(message_of([&] { derive_crossovers({negative}); }).find("tail_fusion"), std::string::npos);
}

TEST(TuneTableWriter, round_trips_and_writes_atomically) {
  testing::ScratchDir scratch{"tune_writer"};
  TuneTable table;
  table.machine = "box \"A\"";
  TuneEntry pinned;
  pinned.tp_size = 4;
  pinned.dtype = DType::f16;
  pinned.hidden_size = 112;
  pinned.latent_size = 56;
  pinned.tail_fusion_max_tokens = 0;
  pinned.shared_stream_token_threshold = 32;
  TuneEntry loose;
  loose.tp_size = 8;
  loose.tail_fusion_max_tokens = 16;
  loose.shared_stream_token_threshold = 128;
  table.entries = {pinned, loose};

  const std::string path = scratch.file("table.json");
  table.write_file(path);
  const TuneTable back = TuneTable::from_file(path);
  EXPECT_EQ(back.machine, table.machine);
  ASSERT_EQ(back.entries.size(), 2u);
  EXPECT_EQ(back.entries[0].dtype, DType::f16);
  EXPECT_EQ(back.entries[0].hidden_size, 112);
  EXPECT_EQ(back.entries[0].latent_size, 56);
  EXPECT_EQ(back.entries[0].shared_stream_token_threshold, 32);
  EXPECT_FALSE(back.entries[1].dtype.has_value());
  EXPECT_FALSE(back.entries[1].hidden_size.has_value());
  EXPECT_EQ(back.entries[1].tail_fusion_max_tokens, 16);
  // Overwrites a regular file; no temporary file is left behind.
  table.machine = "second";
  table.write_file(path);
  EXPECT_EQ(TuneTable::from_file(path).machine, "second");
  int files = 0;
  for (const auto& entry : fs::directory_iterator(scratch.path())) {
    ++files;
    EXPECT_EQ(entry.path().filename(), "table.json");
  }
  EXPECT_EQ(files, 1);
  // Refuses a directory and a missing directory.
  fs::create_directory(scratch.path() / "dir");
  EXPECT_NE(message_of([&] { table.write_file(scratch.file("dir")); }).find("not a regular file"), std::string::npos);
  EXPECT_NE(message_of([&] { table.write_file(scratch.file("missing/t.json")); }).find("cannot create"),
            std::string::npos);
}

using testing::CommandResult;

class TuneCommandTest : public ::testing::Test {
 protected:
  CommandResult latentmoe(const std::string& arguments) { return testing::run_cli(arguments, dir); }

  // Failed with one line on stderr containing `fragment`, and left no table (nor a temporary file).
  void expect_failure(const CommandResult& result, const std::string& fragment) {
    EXPECT_NE(result.exit_code, 0);
    EXPECT_NE(result.err.find(fragment), std::string::npos) << "stderr: " << result.err;
    EXPECT_EQ(std::count(result.err.begin(), result.err.end(), '\n'), 1) << "stderr: " << result.err;
    EXPECT_FALSE(fs::exists(dir / "tune.json"));
    for (const auto& entry : fs::recursive_directory_iterator(dir)) {
      EXPECT_EQ(entry.path().filename().string().find(".tmp"), std::string::npos) << entry.path();
    }
  }

  testing::ScratchDir scratch{"tune_cli"};
  const fs::path& dir = scratch.path();
};

TEST_F(TuneCommandTest, writes_a_table_that_run_accepts) {
  const LayerConfig config = testing::kimi_like_config();
  std::ofstream(dir / "config.json") << config.to_json();
  const std::string table_path = (dir / "tune.json").string();
  const CommandResult tuned =
      latentmoe("tune --config " + (dir / "config.json").string() +
                " --backend cpu --tp 2,4 --tokens 4,1 --repeats 1 --warmup 0 --dtype f32 --output " + table_path);
  ASSERT_EQ(tuned.exit_code, 0) << tuned.err;
  EXPECT_NE(tuned.out.find("noisy"), std::string::npos) << tuned.out;
  EXPECT_NE(tuned.out.find("tail_fusion_max_tokens"), std::string::npos) << tuned.out;

  // The table: one entry per tp, pinned to the layer's dtype and shapes, crossovers among the tokens.
  const nlohmann::json json = nlohmann::json::parse(testing::read_text_file(table_path));
  EXPECT_EQ(json.at("format"), "latentmoe-tune-1");
  EXPECT_FALSE(json.at("machine").get<std::string>().empty());
  // Ranks as threads: no device, so the table cannot become a built-in one (tune/).
  EXPECT_FALSE(json.contains("device"));
  const TuneTable table = TuneTable::from_file(table_path);
  ASSERT_EQ(table.entries.size(), 2u);
  for (int i = 0; i < 2; ++i) {
    const TuneEntry& entry = table.entries[i];
    EXPECT_EQ(entry.tp_size, i == 0 ? 2 : 4);
    EXPECT_EQ(entry.dtype, DType::f32);
    EXPECT_EQ(entry.hidden_size, config.hidden_size);
    EXPECT_EQ(entry.latent_size, config.latent_size);
    for (int64_t knob : {entry.tail_fusion_max_tokens, entry.shared_stream_token_threshold}) {
      EXPECT_TRUE(knob == 0 || knob == 1 || knob == 4) << knob;
    }
  }

  // `run --tune-file` takes it: the tier it runs is the one the table's entry selects.
  const LayerWeights weights = make_random_layer_weights(config, DType::f32, /*seed=*/17, /*with_gate=*/true);
  save_layer_weights((dir / "weights.safetensors").string(), weights, config, "");
  for (int64_t tokens : {1, 4, 9}) {
    const LocalGroupInputs inputs = testing::random_inputs(config, tokens, DType::f32, /*seed=*/5);
    write_safetensors((dir / "input.safetensors").string(), {{"hidden_states", inputs.hidden_states.view()}});
    const std::string out = (dir / "out.safetensors").string();
    fs::remove(out);
    const CommandResult run =
        latentmoe("run --config " + (dir / "config.json").string() + " --weights " +
                  (dir / "weights.safetensors").string() + " --input " + (dir / "input.safetensors").string() +
                  " --output " + out + " --backend cpu --tp 2 --tune-file " + table_path);
    ASSERT_EQ(run.exit_code, 0) << run.err;
    TierPolicy policy;
    policy.tail_fusion_max_tokens = table.entries[0].tail_fusion_max_tokens;
    policy.shared_stream_token_threshold = table.entries[0].shared_stream_token_threshold;
    FusedPathConditions conditions;
    conditions.tp_size = 2;
    conditions.has_shared_expert = true;
    EXPECT_EQ(SafetensorsFile::open(out).metadata().at("tier"),
              std::string(to_string(select_tail_tier(policy, conditions, tokens))))
        << tokens << " tokens";
  }
}

TEST_F(TuneCommandTest, tiny_preset_with_default_machine_text) {
  const std::string table_path = (dir / "tune.json").string();
  const CommandResult tuned = latentmoe(
      "tune --preset nemotron3-super --scale 64 --backend cpu --tp 2 --tokens 1,4 "
      "--repeats 2 --warmup 1 --machine 'test box' --output " +
      table_path);
  ASSERT_EQ(tuned.exit_code, 0) << tuned.err;
  const TuneTable table = TuneTable::from_file(table_path);
  EXPECT_EQ(table.machine, "test box");
  ASSERT_EQ(table.entries.size(), 1u);
  EXPECT_EQ(table.entries[0].dtype, DType::bf16);
  EXPECT_EQ(table.entries[0].hidden_size, 4096 / 64);
  EXPECT_EQ(table.entries[0].latent_size, 1024 / 64);
  // Every tier was timed at both token counts (the table printed a time in every column).
  for (const char* tier : {"native", "tail_fusion", "allreduce_overlap", "column_parallel"}) {
    EXPECT_NE(tuned.out.find(tier), std::string::npos);
  }
}

TEST_F(TuneCommandTest, bad_options_fail_with_one_line_and_no_table) {
  const std::string base = "tune --preset kimi-k3 --scale 64 --backend cpu --tokens 1 --repeats 1 --warmup 0 ";
  const std::string out = " --output " + (dir / "tune.json").string();
  expect_failure(latentmoe(base + "--tp 2 --tiers native,fastest" + out), "unknown tail tier 'fastest'");
  expect_failure(latentmoe(base + "--tp 3" + out), "tp 3 does not divide");
  expect_failure(latentmoe(base + "--tp 1" + out), "--tp 1");
  expect_failure(latentmoe(base + "--tp 2 --dtype f64" + out), "--dtype 'f64'");
  expect_failure(latentmoe(base + "--tp 2 --tokens 0" + out), "--tokens");
  expect_failure(latentmoe("tune --preset kimi-k3 --scale 5 --backend cpu --tp 2" + out), "--scale 5 does not divide");
  expect_failure(latentmoe("tune --preset mixtral --backend cpu --tp 2" + out), "unknown preset 'mixtral'");
  expect_failure(latentmoe(base + "--tp 2 --output " + (dir / "missing" / "tune.json").string()), "does not exist");
  fs::create_directory(dir / "tune.json");  // an existing directory in the output's place
  CommandResult result = latentmoe(base + "--tp 2" + out);
  EXPECT_NE(result.exit_code, 0);
  EXPECT_NE(result.err.find("not a regular file"), std::string::npos) << result.err;
  EXPECT_TRUE(fs::is_directory(dir / "tune.json"));
  fs::remove(dir / "tune.json");
  if (::geteuid() != 0) {  // root writes anywhere
    fs::create_directory(dir / "locked");
    fs::permissions(dir / "locked", fs::perms::owner_read | fs::perms::owner_exec);
    expect_failure(latentmoe(base + "--tp 2 --output " + (dir / "locked" / "tune.json").string()), "not writable");
    fs::permissions(dir / "locked", fs::perms::owner_all);
  }
  // A malformed command line (CLI11) is one line too, exit 2.
  result = latentmoe("tune --repeats 0 --output x.json");
  EXPECT_EQ(result.exit_code, 2);
  EXPECT_EQ(std::count(result.err.begin(), result.err.end(), '\n'), 1) << result.err;
}

}  // namespace
}  // namespace latentmoe

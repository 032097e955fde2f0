// `latentmoe bench tail`: the harness's statistics and group timing loop (bench/harness/runs.h,
// group_timing.h), the report's pure functions (tools/bench_tail_report.h: floors, table lines, the
// JSON schema), and the command end to end in its CPU mode: every tier and the unfused path timed
// at tp 2, and bad options failing with one line, a non-zero exit and no JSON file.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "bench_tail_report.h"
#include "cli_test_util.h"
#include "harness/group_timing.h"
#include "harness/runs.h"
#include "latentmoe/error.h"
#include "scratch_dir.h"

namespace latentmoe {
namespace {

namespace fs = std::filesystem;
using tools::GroupTime;
using tools::PathResult;
using tools::TailPath;
using tools::TailPoint;
using tools::TailRunInfo;

// --- statistics ---------------------------------------------------------------------------------

TEST(BenchRuns, median_is_the_upper_median) {
  EXPECT_EQ(bench::median({3.0, 1.0, 2.0}), 2.0);
  EXPECT_EQ(bench::median({4.0, 1.0, 3.0, 2.0}), 3.0);
  EXPECT_THROW(bench::median({}), Error);
}

TEST(BenchRuns, median_of_slowest_takes_each_runs_slowest_rank) {
  // Run by run the slowest ranks are 5, 7, 4: median 5 (each rank's own median would say 3 and 4).
  EXPECT_EQ(bench::median_of_slowest({{5.0, 1.0, 3.0}, {2.0, 7.0, 4.0}}), 5.0);
  EXPECT_EQ(bench::median_of_slowest({{1.0}}), 1.0);
  EXPECT_THROW(bench::median_of_slowest({}), Error);
  EXPECT_THROW(bench::median_of_slowest({{1.0, 2.0}, {1.0}}), Error);
}

// --- the group timing loop ------------------------------------------------------------------------

// A clock that records what the loop asks of it and returns 10, 20, 30, ... µs.
class RecordingClock final : public bench::RunClock {
 public:
  void flush() override { log += 'f'; }
  void wait() override { log += 'w'; }
  void start() override { log += '['; }
  void stop() override { log += ']'; }
  double elapsed_us() override { return 10.0 * static_cast<double>(++calls); }
  void hold() override { log += 'h'; }
  void open() override { log += 'o'; }
  std::string log;
  int calls = 0;
};

TEST(GroupTiming, flushes_and_prepares_outside_the_timed_region_and_drops_the_warmups) {
  bench::Rendezvous rendezvous(1);
  bench::Rendezvous::Seat seat(rendezvous);
  RecordingClock clock;
  const std::vector<double> times = bench::time_group_runs(
      clock, seat, bench::Runs{.warmup = 2, .iterations = 3, .flush_l2 = true}, [&] { clock.log += 'p'; },
      [&] { clock.log += 'b'; });
  seat.finish();
  EXPECT_EQ(times, (std::vector<double>{30.0, 40.0, 50.0}));
  // The first run is not held at the start gate; every later one is, and opened after it is enqueued.
  EXPECT_EQ(clock.log, "fpw[b]fpwh[b]ofpwh[b]ofpwh[b]ofpwh[b]o");
}

TEST(GroupTiming, no_flush_when_the_runs_say_so_and_no_run_without_iterations) {
  bench::Rendezvous rendezvous(1);
  bench::Rendezvous::Seat seat(rendezvous);
  RecordingClock clock;
  bench::time_group_runs(clock, seat, bench::Runs{.warmup = 0, .iterations = 1, .flush_l2 = false}, nullptr, [] {});
  EXPECT_EQ(clock.log, "w[]");
  clock.log.clear();
  bench::time_group_runs(clock, seat, bench::Runs{.warmup = 0, .iterations = 2, .flush_l2 = false}, nullptr, [] {});
  EXPECT_EQ(clock.log, "w[]wh[]o");
  EXPECT_THROW(bench::time_group_runs(clock, seat, bench::Runs{.warmup = 0, .iterations = 0}, nullptr, [] {}), Error);
  seat.finish();
}

TEST(GroupTiming, every_rank_starts_each_run_after_every_rank_prepared) {
  constexpr int kRanks = 3, kRuns = 4;
  bench::Rendezvous rendezvous(kRanks);
  std::atomic<int> prepared{0};
  std::atomic<bool> early{false};
  std::vector<std::thread> threads;
  for (int rank = 0; rank < kRanks; ++rank) {
    threads.emplace_back([&, rank] {
      bench::Rendezvous::Seat seat(rendezvous);
      bench::HostClock clock;
      int run = 0;
      bench::time_group_runs(
          clock, seat, bench::Runs{.warmup = 1, .iterations = kRuns - 1, .flush_l2 = false},
          [&] {
            // A slow rank: its peers must not start before it has prepared.
            if (rank == 2) std::this_thread::sleep_for(std::chrono::milliseconds(5));
            ++prepared;
          },
          [&] {
            ++run;
            if (prepared.load() < run * kRanks) early = true;
          });
      seat.finish();
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_FALSE(early.load());
  EXPECT_EQ(prepared.load(), kRanks * kRuns);
}

// A clock whose gate opening checks that every rank has enqueued (here: run) its body for this run.
class GateCheckingClock final : public bench::RunClock {
 public:
  GateCheckingClock(const std::atomic<int>& bodies, int ranks, std::atomic<bool>& early)
      : bodies_(bodies), ranks_(ranks), early_(early) {}
  void flush() override {}
  void wait() override {}
  void start() override {}
  void stop() override {}
  double elapsed_us() override { return 1.0; }
  void hold() override { ++held_; }
  void open() override {
    // Run number held_ (the first run, not held, is number 0): every rank's bodies of runs 0..held_.
    if (bodies_.load() < (held_ + 1) * ranks_) early_ = true;
  }

 private:
  const std::atomic<int>& bodies_;
  int ranks_;
  std::atomic<bool>& early_;
  int held_ = 0;
};

TEST(GroupTiming, the_start_gate_opens_only_once_every_rank_has_enqueued_its_run) {
  constexpr int kRanks = 3, kRuns = 5;
  bench::Rendezvous rendezvous(kRanks);
  std::atomic<int> bodies{0};
  std::atomic<bool> early{false};
  std::vector<std::thread> threads;
  for (int rank = 0; rank < kRanks; ++rank) {
    threads.emplace_back([&, rank] {
      bench::Rendezvous::Seat seat(rendezvous);
      GateCheckingClock clock(bodies, kRanks, early);
      bench::time_group_runs(clock, seat, bench::Runs{.warmup = 2, .iterations = kRuns - 2, .flush_l2 = false}, nullptr,
                             [&] {
                               // A slow rank: the gate must not open before it has enqueued.
                               if (rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(3));
                               ++bodies;
                             });
      seat.finish();
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_FALSE(early.load());
  EXPECT_EQ(bodies.load(), kRanks * kRuns);
}

TEST(GroupTiming, a_rank_that_fails_leaves_the_rendezvous_so_its_peers_finish) {
  bench::Rendezvous rendezvous(2);
  std::vector<double> survivor;
  std::thread failing([&] {
    bench::Rendezvous::Seat seat(rendezvous);
    try {
      throw std::runtime_error("rank 1 failed while building");
    } catch (const std::runtime_error&) {
    }
    // The seat goes without finish(): the rank left.
  });
  std::thread peer([&] {
    bench::Rendezvous::Seat seat(rendezvous);
    bench::HostClock clock;
    survivor = bench::time_group_runs(clock, seat, bench::Runs{.warmup = 0, .iterations = 2, .flush_l2 = false},
                                      nullptr, [] {});
    seat.finish();
  });
  failing.join();
  peer.join();
  EXPECT_EQ(survivor.size(), 2u);
}

// --- the report -----------------------------------------------------------------------------------

TEST(BenchTailReport, floors) {
  // Two rounds of 5 µs, and 1 MB at 1 TB/s = 1 µs.
  EXPECT_DOUBLE_EQ(tools::tail_floor_us(5.0, 1e6, 1e12), 11.0);
  EXPECT_DOUBLE_EQ(tools::layer_floor_us(2e6, 1e12, 5.0), 12.0);
  EXPECT_THROW(tools::tail_floor_us(5.0, 1e6, 0.0), Error);
}

TailPoint hand_made_point() {
  TailPoint point;
  point.preset = "kimi-k3";
  point.scale = 1;
  point.tp = 8;
  point.tokens = 16;
  point.dtype = "bf16";
  point.hidden_size = 7168;
  point.latent_size = 3584;
  point.touched_experts = 200;
  double us = 1.0;
  for (TailPath path : tools::kTailPaths) {
    PathResult result;
    result.path = path;
    result.ran = path != TailPath::tail_fusion;
    if (!result.ran) {
      result.reason = "tier tail_fusion carries at most 12 tokens here";
    } else {
      result.time = GroupTime{us, {us - 0.5, us}};
      if (tools::is_tier(path)) result.layer = GroupTime{100.0 + us, {99.0 + us, 100.0 + us}};
    }
    us += 1.0;
    point.paths.push_back(result);
  }
  return point;
}

std::vector<std::string> fields_of(const std::string& line) {
  std::vector<std::string> fields;
  std::string field;
  for (char c : line) {
    if (c == ' ' || c == '\n') {
      if (!field.empty()) fields.push_back(field);
      field.clear();
    } else {
      field += c;
    }
  }
  if (!field.empty()) fields.push_back(field);
  return fields;
}

TEST(BenchTailReport, a_point_line_has_one_column_per_title_and_a_dash_for_what_did_not_run) {
  const TailPoint point = hand_made_point();
  const std::string line = tools::format_point_line(point);
  EXPECT_EQ(line.back(), '\n');
  const std::vector<std::string> fields = fields_of(line);
  // tokens, touched, 4 tiers x (tail, layer), unfused, ar+rms, ar,rms, ar(Txd), t0_floor, auto, auto/best
  ASSERT_EQ(fields.size(), 2u + 8u + 7u);
  EXPECT_EQ(fields[0], "16");
  EXPECT_EQ(fields[1], "200");
  EXPECT_EQ(fields[2], "1.0");    // native tail
  EXPECT_EQ(fields[3], "101.0");  // native layer
  EXPECT_EQ(fields[4], "-");      // tail_fusion: not run
  EXPECT_EQ(fields[5], "-");
  EXPECT_EQ(fields[10], "5.0");  // unfused
  EXPECT_EQ(fields[13], "8.0");  // all_reduce
  EXPECT_EQ(fields[14], "-");    // no tier-0 floor without tier 0
  EXPECT_EQ(fields[15], "-");    // no policy tier given
  EXPECT_EQ(fields[16], "-");
  const std::string header = tools::format_block_header(point);
  EXPECT_NE(header.find("# preset kimi-k3 (scale 1)  tp 8  bf16  d 7168  l 3584"), std::string::npos);
  // Every data column lines up under the title line's columns.
  const size_t titles = header.find("#       tokens");
  ASSERT_NE(titles, std::string::npos);
  const std::string title_line = header.substr(titles, header.find('\n', titles) - titles);
  EXPECT_EQ(title_line.size(), line.size() - 1);
  EXPECT_EQ(fields_of(title_line).size(), 1u + fields.size());  // "#" first
}

// The policy's column: its tier and its layer time over the fastest forced tier's (the target of issue
// 14 is at most 1.05); none where the policy's tier did not run.
TEST(BenchTailReport, the_policy_column_names_its_tier_and_its_layer_over_the_best) {
  TailPoint point = hand_made_point();  // layers: native 101, tail_fusion not run, overlap 103, column 104
  point.policy_tier = TailTier::column_parallel;
  ASSERT_TRUE(tools::policy_layer_ratio(point).has_value());
  EXPECT_DOUBLE_EQ(*tools::policy_layer_ratio(point), 104.0 / 101.0);
  std::vector<std::string> fields = fields_of(tools::format_point_line(point));
  EXPECT_EQ(fields[15], "column");
  EXPECT_EQ(fields[16], "1.030");
  nlohmann::json rows = tools::to_json(TailRunInfo{}, {point})["rows"];
  EXPECT_EQ(rows[0]["policy_tier"], "column_parallel");
  EXPECT_DOUBLE_EQ(rows[0]["policy_layer_ratio"].get<double>(), 104.0 / 101.0);
  point.policy_tier = TailTier::native;
  EXPECT_DOUBLE_EQ(*tools::policy_layer_ratio(point), 1.0);
  point.policy_tier = TailTier::tail_fusion;  // did not run here
  EXPECT_FALSE(tools::policy_layer_ratio(point).has_value());
  fields = fields_of(tools::format_point_line(point));
  EXPECT_EQ(fields[15], "fusion");
  EXPECT_EQ(fields[16], "-");
  EXPECT_FALSE(tools::to_json(TailRunInfo{}, {point})["rows"][0].contains("policy_layer_ratio"));
}

TEST(BenchTailReport, the_run_header_says_simulated_and_that_the_cpu_times_are_no_result) {
  TailRunInfo info;
  info.backend = "cpu";
  info.placement = "simulated";
  info.device = "test CPU";
  info.iterations = 3;
  info.warmup = 1;
  info.copy_bytes_per_s = 2e10;
  const std::string header = tools::format_run_header(info);
  EXPECT_NE(header.find("placement simulated"), std::string::npos);
  EXPECT_NE(header.find("no NVLink cost"), std::string::npos);
  EXPECT_NE(header.find("times are not a result"), std::string::npos);
  EXPECT_NE(header.find("copy bandwidth 0.020 TB/s"), std::string::npos);
}

TEST(BenchTailReport, json_rows_carry_the_run_fields_and_leave_out_the_times_of_what_did_not_run) {
  TailRunInfo info;
  info.backend = "cuda";
  info.placement = "simulated";
  info.device = "NVIDIA H200";
  info.commit = "abc1234";
  info.warmup = 3;
  info.iterations = 20;
  info.flush = true;
  info.copy_bytes_per_s = 4.2e12;
  info.skipped = {"nemotron3-super tp 8 tokens 4096"};
  TailPoint point = hand_made_point();
  point.paths[static_cast<size_t>(TailPath::all_reduce)].message_bytes = 16 * 7168 * 2;
  point.paths[static_cast<size_t>(TailPath::native)].layer_floor_us = 50.0;
  const nlohmann::json document = tools::to_json(info, {point});
  EXPECT_EQ(document["format"], "latentmoe-bench-tail-1");
  EXPECT_EQ(document["placement"], "simulated");
  EXPECT_DOUBLE_EQ(document["ceilings"]["copy_tb_per_s"].get<double>(), 4.2);
  EXPECT_EQ(document["runs"]["iterations"], 20);
  EXPECT_EQ(document["skipped"].size(), 1u);
  EXPECT_TRUE(document["complete"].get<bool>());
  EXPECT_FALSE(document.contains("error"));
  const nlohmann::json& rows = document["rows"];
  ASSERT_EQ(rows.size(), tools::kTailPaths.size());
  std::set<std::string> paths;
  for (const nlohmann::json& row : rows) {
    paths.insert(row["path"].get<std::string>());
    EXPECT_EQ(row["placement"], "simulated");
    EXPECT_EQ(row["device"], "NVIDIA H200");
    EXPECT_EQ(row["commit"], "abc1234");
    EXPECT_EQ(row["backend"], "cuda");
    EXPECT_EQ(row["tp"], 8);
    EXPECT_EQ(row["tokens"], 16);
    if (row["ran"].get<bool>()) {
      EXPECT_FALSE(row.contains("reason"));
      EXPECT_EQ(row["time_us_per_rank"].size(), 2u);
      EXPECT_EQ(row.contains("layer_time_us"), row["kind"] == "tier");
    } else {
      EXPECT_EQ(row["path"], "tail_fusion");
      EXPECT_FALSE(row.contains("time_us"));
      EXPECT_NE(row["reason"].get<std::string>().find("at most 12 tokens"), std::string::npos);
    }
  }
  EXPECT_EQ(paths.size(), tools::kTailPaths.size());
  EXPECT_EQ(rows[0]["kind"], "tier");
  EXPECT_EQ(rows[0]["layer_floor_us"], 50.0);
  EXPECT_EQ(rows[4]["kind"], "unfused");
  EXPECT_EQ(rows[7]["kind"], "collective");
  EXPECT_EQ(rows[7]["message_bytes"], 16 * 7168 * 2);
}

TEST(BenchTailReport, a_run_that_ended_early_says_so_and_keeps_its_rows) {
  TailRunInfo info;
  info.backend = "cuda";
  info.complete = false;
  info.error = "rank 1: the GPU all-reduce timed out";
  const nlohmann::json document = tools::to_json(info, {hand_made_point()});
  EXPECT_FALSE(document["complete"].get<bool>());
  EXPECT_EQ(document["error"], "rank 1: the GPU all-reduce timed out");
  EXPECT_EQ(document["rows"].size(), tools::kTailPaths.size());
}

TEST(BenchTailReport, scaled_presets) {
  const LayerConfig config = tools::scaled_preset("kimi-k3", 64);
  EXPECT_EQ(config.hidden_size, 112);
  EXPECT_EQ(config.latent_size, 56);
  EXPECT_EQ(config.num_experts, 14);
  EXPECT_EQ(config.top_k, 14);  // capped at E
  EXPECT_EQ(tools::scaled_preset("kimi-k3", 1).hidden_size, 7168);
  EXPECT_THROW(tools::scaled_preset("kimi-k3", 5), Error);
  EXPECT_THROW(tools::scaled_preset("gpt-2", 1), Error);
}

// --- the command, CPU mode ---------------------------------------------------------------------------

constexpr const char* kTiny =
    "bench tail --backend cpu --preset kimi-k3,nemotron3-super --scale 64 --tp 2 --tokens 1,4";

TEST(BenchTailCommand, cpu_mode_times_every_tier_and_the_unfused_path_at_tp_2) {
  testing::ScratchDir scratch("bench_tail");
  const fs::path json = scratch.path() / "tail.json";
  const testing::CommandResult result =
      testing::run_cli(std::string(kTiny) + " --commit test123 --json " + json.string(), scratch.path());
  ASSERT_EQ(result.exit_code, 0) << result.err;
  EXPECT_NE(result.out.find("placement simulated"), std::string::npos);
  EXPECT_NE(result.out.find("# preset nemotron3-super (scale 64)  tp 2"), std::string::npos);
  const nlohmann::json document = nlohmann::json::parse(testing::read_text_file(json));
  EXPECT_EQ(document["format"], "latentmoe-bench-tail-1");
  EXPECT_EQ(document["backend"], "cpu");
  EXPECT_TRUE(document["skipped"].empty());
  EXPECT_TRUE(document["complete"].get<bool>());
  std::set<std::tuple<std::string, int64_t, std::string>> seen;
  for (const nlohmann::json& row : document["rows"]) {
    EXPECT_EQ(row["placement"], "simulated");
    EXPECT_EQ(row["commit"], "test123");
    EXPECT_EQ(row["tp"], 2);
    ASSERT_TRUE(row["ran"].get<bool>()) << row.dump();  // the CPU backend runs every tier, unbounded
    const double time = row["time_us"].get<double>();
    EXPECT_TRUE(std::isfinite(time) && time > 0) << row.dump();
    ASSERT_EQ(row["time_us_per_rank"].size(), 2u);
    for (const auto& rank_time : row["time_us_per_rank"]) EXPECT_GT(rank_time.get<double>(), 0);
    if (row["kind"] == "tier") {
      const double layer = row["layer_time_us"].get<double>();
      EXPECT_TRUE(std::isfinite(layer) && layer > 0) << row.dump();
      EXPECT_GT(row["layer_floor_us"].get<double>(), 0);
    }
    if (row["path"] == "tail_fusion") EXPECT_GT(row["floor_us"].get<double>(), 0);
    seen.insert({row["preset"].get<std::string>(), row["tokens"].get<int64_t>(), row["path"].get<std::string>()});
  }
  for (const char* preset : {"kimi-k3", "nemotron3-super"}) {
    for (int64_t tokens : {1, 4}) {
      for (TailPath path : tools::kTailPaths) {
        EXPECT_TRUE(seen.count({preset, tokens, std::string(tools::path_name(path))}))
            << preset << " " << tokens << " " << tools::path_name(path);
      }
    }
  }
  EXPECT_EQ(document["rows"].size(), 2u * 2u * tools::kTailPaths.size());
}

struct BadOption {
  const char* name;
  std::string arguments;
  const char* message;  // a part of the one error line
};

class BenchTailBadOption : public ::testing::TestWithParam<BadOption> {};

TEST_P(BenchTailBadOption, fails_with_one_line_and_writes_no_json) {
  testing::ScratchDir scratch("bench_tail_bad");
  const fs::path json = scratch.path() / "tail.json";
  const std::string arguments = GetParam().arguments + " --json " + json.string();
  const testing::CommandResult result = testing::run_cli(arguments, scratch.path());
  EXPECT_NE(result.exit_code, 0);
  EXPECT_EQ(std::count(result.err.begin(), result.err.end(), '\n'), 1) << result.err;
  EXPECT_NE(result.err.find(GetParam().message), std::string::npos) << result.err;
  EXPECT_FALSE(fs::exists(json));
  // Nothing else either (no temporary file left behind).
  for (const auto& entry : fs::directory_iterator(scratch.path())) {
    const std::string name = entry.path().filename().string();
    EXPECT_TRUE(name == "stdout.txt" || name == "stderr.txt") << name;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, BenchTailBadOption,
    ::testing::Values(
        BadOption{"unknown_preset", "bench tail --backend cpu --preset gpt-2 --scale 64 --tp 2 --tokens 1", "gpt-2"},
        BadOption{"tp_not_dividing", "bench tail --backend cpu --preset kimi-k3 --scale 64 --tp 3 --tokens 1",
                  "--tp 3"},
        BadOption{"tokens_zero", "bench tail --backend cpu --preset kimi-k3 --scale 64 --tp 2 --tokens 0,1",
                  "--tokens: 0"},
        BadOption{"tp_one", "bench tail --backend cpu --preset kimi-k3 --scale 64 --tp 1 --tokens 1", "--tp 1"},
        BadOption{"scale_not_dividing", "bench tail --backend cpu --preset kimi-k3 --scale 5 --tp 2 --tokens 1",
                  "--scale 5"},
        BadOption{"bad_dtype", "bench tail --backend cpu --preset kimi-k3 --scale 64 --tp 2 --dtype f8", "f8"},
        // The bound the CUDA backend accepts (fused_up_projection_bounds.h), checked on every backend.
        BadOption{"fused_up_projection_past_the_push_kernel",
                  "bench tail --backend cpu --preset kimi-k3 --scale 64 --tp 2 --tokens 1 "
                  "--fused-up-projection-max-tokens 129",
                  "--fused-up-projection-max-tokens 129 is outside 0..128"},
        BadOption{"fused_up_projection_negative",
                  "bench tail --backend cpu --preset kimi-k3 --scale 64 --tp 2 --tokens 1 "
                  "--fused-up-projection-max-tokens -1",
                  "--fused-up-projection-max-tokens -1 is outside 0..128"}),
    [](const ::testing::TestParamInfo<BadOption>& info) { return std::string(info.param.name); });

TEST(BenchTailCommand, an_unwritable_json_fails_before_anything_is_measured) {
  testing::ScratchDir scratch("bench_tail_unwritable");
  // A directory that does not exist, and a path that is a directory.
  const fs::path missing = scratch.path() / "no_such_dir" / "tail.json";
  testing::CommandResult result = testing::run_cli(std::string(kTiny) + " --json " + missing.string(), scratch.path());
  EXPECT_NE(result.exit_code, 0);
  EXPECT_EQ(std::count(result.err.begin(), result.err.end(), '\n'), 1) << result.err;
  EXPECT_NE(result.err.find(missing.string()), std::string::npos) << result.err;
  EXPECT_EQ(result.out.find("# preset"), std::string::npos);  // nothing measured
  EXPECT_FALSE(fs::exists(missing.parent_path()));

  const fs::path directory = scratch.path() / "a_directory";
  fs::create_directories(directory);
  result = testing::run_cli(std::string(kTiny) + " --json " + directory.string(), scratch.path());
  EXPECT_NE(result.exit_code, 0);
  EXPECT_EQ(std::count(result.err.begin(), result.err.end(), '\n'), 1) << result.err;
  EXPECT_TRUE(fs::is_directory(directory));
  EXPECT_TRUE(fs::is_empty(directory));
}

}  // namespace
}  // namespace latentmoe

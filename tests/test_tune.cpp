// The tuned crossover table (latentmoe/tune.h): reading and rejecting files, the most specific
// entry for a layer, and the order defaults < table < environment in the policy a runner takes.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>

#include "core/builtin_tune.h"
#include "error_test_util.h"
#include "latentmoe/error.h"
#include "latentmoe/tune.h"
#include "scratch_dir.h"

namespace latentmoe {
namespace {

constexpr const char* kTable = R"({
  "format": "latentmoe-tune-1",
  "machine": "test box",
  "entries": [
    {"tp": 8, "tail_fusion_max_tokens": 32, "shared_stream_token_threshold": 512},
    {"tp": 8, "dtype": "bf16", "hidden_size": 7168, "latent_size": 3584,
     "tail_fusion_max_tokens": 96, "shared_stream_token_threshold": 1024},
    {"tp": 4, "dtype": "f16", "tail_fusion_max_tokens": 0, "shared_stream_token_threshold": 128}
  ]})";

using testing::message_of;

TEST(TuneTable, picks_the_most_specific_entry_of_the_layers_tp) {
  const TuneTable table = TuneTable::from_json(kTable, "t.json");
  EXPECT_EQ(table.machine, "test box");
  ASSERT_EQ(table.entries.size(), 3u);
  const auto kimi = table.find(8, DType::bf16, 7168, 3584);
  ASSERT_TRUE(kimi.has_value());
  EXPECT_EQ(kimi->tail_fusion_max_tokens, 96);
  EXPECT_EQ(kimi->shared_stream_token_threshold, 1024);
  const auto other = table.find(8, DType::bf16, 4096, 1024);  // only the tp-wide entry matches
  ASSERT_TRUE(other.has_value());
  EXPECT_EQ(other->tail_fusion_max_tokens, 32);
  EXPECT_FALSE(table.find(4, DType::bf16, 7168, 3584).has_value());  // tp 4 is pinned to f16
  EXPECT_EQ(table.find(4, DType::f16, 7168, 3584)->tail_fusion_max_tokens, 0);
  EXPECT_FALSE(table.find(2, DType::bf16, 7168, 3584).has_value());
}

TEST(TuneTable, two_equally_specific_matches_are_an_error) {
  const TuneTable table = TuneTable::from_json(R"({"format": "latentmoe-tune-1", "entries": [
      {"tp": 2, "dtype": "bf16", "tail_fusion_max_tokens": 1, "shared_stream_token_threshold": 2},
      {"tp": 2, "hidden_size": 64, "tail_fusion_max_tokens": 3, "shared_stream_token_threshold": 4}]})",
                                               "t.json");
  EXPECT_NE(message_of([&] { table.find(2, DType::bf16, 64, 32); }).find("equally"), std::string::npos);
  EXPECT_EQ(table.find(2, DType::f16, 64, 32)->tail_fusion_max_tokens, 3);
}

TEST(TuneTable, rejects_malformed_tables_naming_the_problem) {
  const std::pair<const char*, const char*> cases[] = {
      {"{", "invalid JSON"},
      {"[]", "JSON object"},
      {R"({"entries": []})", "\"format\""},
      {R"({"format": "latentmoe-tune-2", "entries": []})", "\"format\""},
      {R"({"format": "latentmoe-tune-1"})", "\"entries\""},
      {R"({"format": "latentmoe-tune-1", "entries": [1]})", "entries[0] must be an object"},
      {R"({"format": "latentmoe-tune-1", "entries": [{"tp": 2, "shared_stream_token_threshold": 1}]})",
       "\"tail_fusion_max_tokens\" is missing"},
      {R"({"format": "latentmoe-tune-1", "entries": [{"tp": 0, "tail_fusion_max_tokens": 1,
          "shared_stream_token_threshold": 1}]})",
       "\"tp\" is 0"},
      {R"({"format": "latentmoe-tune-1", "entries": [{"tp": 2, "tail_fusion_max_tokens": -1,
          "shared_stream_token_threshold": 1}]})",
       "\"tail_fusion_max_tokens\" is -1"},
      {R"({"format": "latentmoe-tune-1", "entries": [{"tp": 2, "tail_fusion_max_tokens": "8",
          "shared_stream_token_threshold": 1}]})",
       "must be an integer"},
      {R"({"format": "latentmoe-tune-1", "entries": [{"tp": 2, "dtype": "fp8", "tail_fusion_max_tokens": 1,
          "shared_stream_token_threshold": 1}]})",
       "bf16, f16 or f32"},
      {R"({"format": "latentmoe-tune-1", "entries": [
          {"tp": 2, "tail_fusion_max_tokens": 1, "shared_stream_token_threshold": 1},
          {"tp": 2, "tail_fusion_max_tokens": 5, "shared_stream_token_threshold": 5}]})",
       "entries[1] repeats"},
      {R"({"format": "latentmoe-tune-1", "device": "", "entries": []})", "\"device\" must be a non-empty string"},
      {R"({"format": "latentmoe-tune-1", "device": 90, "entries": []})", "\"device\" must be a non-empty string"},
  };
  for (const auto& [text, expected] : cases) {
    const std::string message = message_of([&] { TuneTable::from_json(text, "bad.json"); });
    EXPECT_NE(message.find(expected), std::string::npos) << text << " -> " << message;
    EXPECT_NE(message.find("bad.json"), std::string::npos) << message;
  }
}

TEST(TuneTable, a_missing_file_or_a_folder_is_a_clear_error) {
  testing::ScratchDir dir("tune_files");
  EXPECT_NE(message_of([&] {
              TuneTable::from_file(dir.file("absent.json"));
            }).find("cannot read tune table: No such file or directory"),
            std::string::npos);
  EXPECT_NE(message_of([&] { TuneTable::from_file(dir.path().string()); }).find("not a regular file"),
            std::string::npos);
}

TEST(TuneTable, the_policy_takes_defaults_then_the_table_then_the_environment) {
  testing::ScratchDir dir("tune_policy");
  const std::string path = dir.file("tune.json");
  std::ofstream(path) << kTable;
  unsetenv("LATENTMOE_TAIL_FUSION_MAX_TOKENS");
  unsetenv("LATENTMOE_TUNE_FILE");
  // No table: the constants.
  EXPECT_EQ(tuned_policy("", 8, DType::bf16, 7168, 3584).tail_fusion_max_tokens,
            TierPolicy::kDefaultTailFusionMaxTokens);
  // The table, named directly or by LATENTMOE_TUNE_FILE.
  EXPECT_EQ(tuned_policy(path, 8, DType::bf16, 7168, 3584).tail_fusion_max_tokens, 96);
  setenv("LATENTMOE_TUNE_FILE", path.c_str(), 1);
  EXPECT_EQ(tuned_policy("", 8, DType::bf16, 7168, 3584).shared_stream_token_threshold, 1024);
  // No entry for this tp: the constants.
  EXPECT_EQ(tuned_policy("", 2, DType::bf16, 7168, 3584).tail_fusion_max_tokens,
            TierPolicy::kDefaultTailFusionMaxTokens);
  // A variable overrides the table.
  setenv("LATENTMOE_TAIL_FUSION_MAX_TOKENS", "7", 1);
  const TierPolicy policy = tuned_policy("", 8, DType::bf16, 7168, 3584);
  EXPECT_EQ(policy.tail_fusion_max_tokens, 7);
  EXPECT_EQ(policy.shared_stream_token_threshold, 1024);
  unsetenv("LATENTMOE_TAIL_FUSION_MAX_TOKENS");
  unsetenv("LATENTMOE_TUNE_FILE");
}

TEST(TuneTable, the_device_is_read_and_written_back) {
  TuneTable table = TuneTable::from_json(
      R"({"format": "latentmoe-tune-1", "device": "NVIDIA H200", "entries": [
          {"tp": 2, "tail_fusion_max_tokens": 16, "shared_stream_token_threshold": 128}]})",
      "t.json");
  EXPECT_EQ(table.device, "NVIDIA H200");
  EXPECT_EQ(TuneTable::from_json(table.to_json(), "again").device, "NVIDIA H200");
  table.device.clear();  // ranks as threads or simulated: no "device" key at all
  EXPECT_EQ(table.to_json().find("device"), std::string::npos);
  EXPECT_TRUE(TuneTable::from_json(table.to_json(), "again").device.empty());
}

// Whatever tune/ holds in this checkout reads: a malformed or device-less table fails here, in CI,
// not in a user's run.
TEST(BuiltinTuneTables, every_table_under_tune_reads_and_names_its_device) {
  const std::vector<TuneTable>& tables = builtin_tune_tables();
  EXPECT_EQ(tables.size(), detail::builtin_tune_files().size());
  for (const TuneTable& table : tables) EXPECT_FALSE(table.device.empty()) << table.machine;
}

constexpr const char* kH200Table = R"({"format": "latentmoe-tune-1", "machine": "8x NVIDIA H200, NVLink",
  "device": "NVIDIA H200", "entries": [
    {"tp": 8, "dtype": "bf16", "tail_fusion_max_tokens": 16, "shared_stream_token_threshold": 128},
    {"tp": 2, "tail_fusion_max_tokens": 512, "shared_stream_token_threshold": 2048}]})";

// The files of one device merge (one `latentmoe tune` run per tp); one without a device, or one that
// repeats another's entry, is refused naming the file.
TEST(BuiltinTuneTables, files_of_one_device_merge_and_bad_ones_are_refused) {
  const detail::BuiltinTuneFile per_tp[] = {
      {"tune/h200_tp4.json", R"({"format": "latentmoe-tune-1", "device": "NVIDIA H200", "entries": [
          {"tp": 4, "tail_fusion_max_tokens": 32, "shared_stream_token_threshold": 256}]})"},
      {"tune/h100.json", R"({"format": "latentmoe-tune-1", "device": "NVIDIA H100 80GB HBM3", "entries": [
          {"tp": 4, "tail_fusion_max_tokens": 8, "shared_stream_token_threshold": 64}]})"},
      {"tune/h200_tp8.json", kH200Table}};
  const std::vector<TuneTable> tables = detail::read_builtin_tune_tables(per_tp);
  ASSERT_EQ(tables.size(), 2u);
  EXPECT_EQ(tables[0].device, "NVIDIA H200");
  EXPECT_EQ(tables[0].entries.size(), 3u);
  EXPECT_EQ(tables[0].find(4, DType::bf16, 7168, 3584)->tail_fusion_max_tokens, 32);
  EXPECT_EQ(tables[0].find(8, DType::bf16, 7168, 3584)->tail_fusion_max_tokens, 16);
  EXPECT_EQ(tables[1].find(4, DType::bf16, 7168, 3584)->tail_fusion_max_tokens, 8);

  const detail::BuiltinTuneFile no_device[] = {{"tune/a.json", R"({"format": "latentmoe-tune-1", "entries": []})"}};
  std::string message = message_of([&] { detail::read_builtin_tune_tables(no_device); });
  EXPECT_NE(message.find("tune/a.json: a built-in tune table must name its \"device\""), std::string::npos) << message;
  const detail::BuiltinTuneFile twice[] = {{"tune/a.json", kH200Table}, {"tune/b.json", kH200Table}};
  message = message_of([&] { detail::read_builtin_tune_tables(twice); });
  EXPECT_NE(message.find("tune/b.json: entries[0] repeats the tp, dtype and shapes of an entry of another table for "
                         "device 'NVIDIA H200'"),
            std::string::npos)
      << message;
  const detail::BuiltinTuneFile broken[] = {{"tune/c.json", "{"}};
  message = message_of([&] { detail::read_builtin_tune_tables(broken); });
  EXPECT_NE(message.find("tune/c.json: invalid JSON"), std::string::npos) << message;
}

// defaults < the built-in table of the ranks' device < a table given < the environment.
TEST(BuiltinTuneTables, apply_to_ranks_on_gpus_of_their_device_under_a_given_table_and_the_environment) {
  const detail::BuiltinTuneFile files[] = {{"tune/h200.json", kH200Table}};
  const std::vector<TuneTable> builtin = detail::read_builtin_tune_tables(files);
  testing::ScratchDir dir("tune_builtin");
  const std::string path = dir.file("tune.json");
  std::ofstream(path) << kTable;  // tp 8 bf16 7168/3584: 96 and 1024; no tp 2 entry
  unsetenv("LATENTMOE_TAIL_FUSION_MAX_TOKENS");
  unsetenv("LATENTMOE_TUNE_FILE");
  auto policy = [&](const std::string& table, int tp, DType dtype, std::string_view device) {
    return detail::tuned_policy_over(builtin, table, tp, dtype, 7168, 3584, device);
  };
  // No device (threads, simulated ranks) or another device: the constants.
  EXPECT_EQ(policy("", 8, DType::bf16, "").tail_fusion_max_tokens, TierPolicy::kDefaultTailFusionMaxTokens);
  EXPECT_EQ(policy("", 8, DType::bf16, "NVIDIA H100 80GB HBM3").tail_fusion_max_tokens,
            TierPolicy::kDefaultTailFusionMaxTokens);
  // The device's table, per tp and dtype.
  TierPolicy tuned = policy("", 8, DType::bf16, "NVIDIA H200");
  EXPECT_EQ(tuned.tail_fusion_max_tokens, 16);
  EXPECT_EQ(tuned.shared_stream_token_threshold, 128);
  EXPECT_EQ(policy("", 8, DType::f16, "NVIDIA H200").tail_fusion_max_tokens, TierPolicy::kDefaultTailFusionMaxTokens);
  EXPECT_EQ(policy("", 4, DType::bf16, "NVIDIA H200").tail_fusion_max_tokens, TierPolicy::kDefaultTailFusionMaxTokens);
  // A table given wins where it has an entry, and leaves the built-in one where it has none.
  EXPECT_EQ(policy(path, 8, DType::bf16, "NVIDIA H200").tail_fusion_max_tokens, 96);
  EXPECT_EQ(policy(path, 2, DType::bf16, "NVIDIA H200").tail_fusion_max_tokens, 512);
  // A variable wins over both; the other knob keeps the table's value.
  setenv("LATENTMOE_TAIL_FUSION_MAX_TOKENS", "7", 1);
  tuned = policy("", 8, DType::bf16, "NVIDIA H200");
  EXPECT_EQ(tuned.tail_fusion_max_tokens, 7);
  EXPECT_EQ(tuned.shared_stream_token_threshold, 128);
  unsetenv("LATENTMOE_TAIL_FUSION_MAX_TOKENS");
}

}  // namespace
}  // namespace latentmoe

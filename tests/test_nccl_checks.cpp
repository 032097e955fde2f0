// The host logic of the NCCL GPU group, on the CPU: the libnccl version check, the NVLink multicast
// (NVLS) decision, where a group's ranks are placed, the packing between latentmoe's column-block shards
// and NCCL's contiguous chunks (against the column-block semantics of the communicator contract, at
// T > 1 where the two layouts differ), and the tier support a GPU group's limits give.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "core/backend.h"
#include "core/gpu_tier_support.h"
#include "core/nccl_checks.h"
#include "core/shard_layout.h"
#include "error_test_util.h"
#include "latentmoe/device.h"
#include "latentmoe/error.h"
#include "latentmoe/gpu_group.h"
#include "layer_test_util.h"

namespace latentmoe::detail {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

using testing::message_of;

TEST(NcclVersion, codes_read_as_major_minor_patch) {
  EXPECT_EQ(nccl_version_text(22809), "2.28.9");
  EXPECT_EQ(nccl_version_text(22803), "2.28.3");
  EXPECT_EQ(nccl_version_text(23012), "2.30.12");
  EXPECT_EQ(nccl_version_text(2804), "2.8.4");  // the old encoding, up to 2.8
}

TEST(NcclVersion, only_the_release_built_against_is_accepted) {
  EXPECT_FALSE(nccl_version_mismatch(22809, 22809).has_value());
  const auto older = nccl_version_mismatch(22803, 22809);
  ASSERT_TRUE(older.has_value());
  EXPECT_THAT(*older, HasSubstr("built against NCCL 2.28.9"));
  EXPECT_THAT(*older, HasSubstr("loaded libnccl 2.28.3"));
  EXPECT_THAT(*older, HasSubstr("no ABI compatibility"));
  EXPECT_THAT(*older, HasSubstr("LD_LIBRARY_PATH"));
  EXPECT_THAT(*older, HasSubstr("import nvidia.nccl"));
  // A newer patch release is refused too: the device API's structures may change in any release.
  EXPECT_TRUE(nccl_version_mismatch(22810, 22809).has_value());
  EXPECT_TRUE(nccl_version_mismatch(22909, 22809).has_value());
}

// The library sets no NCCL variable: NVLink multicast must be off (0) in the process's environment, and
// unset (NCCL's default: multicast where the GPUs have it) is refused like 1 or 2.
TEST(NcclNvls, only_zero_passes_and_unset_is_refused_too) {
  EXPECT_FALSE(nvls_problem(0).has_value());
  const std::string tail =
      "; expected 0: latentmoe keeps NVLS off (it can put GPUs shared with others out of service) and sets no NCCL "
      "variable itself; set NCCL_NVLS_ENABLE=0 before NCCL starts";
  EXPECT_EQ(nvls_problem(std::nullopt).value_or(""),
            "NCCL_NVLS_ENABLE is not set, so NCCL uses NVLink multicast (NVLS) where the GPUs have it" + tail +
                " (the latentmoe tool does)");
  for (int64_t on : {1, 2}) {
    EXPECT_EQ(nvls_problem(on).value_or(""),
              "NCCL_NVLS_ENABLE='" + std::to_string(on) + "' lets NCCL use NVLink multicast (NVLS)" + tail);
  }
}

TEST(NcclNvls, the_check_reads_the_environment_and_writes_nothing) {
  const char* saved = std::getenv("NCCL_NVLS_ENABLE");
  const std::optional<std::string> saved_value = saved != nullptr ? std::optional<std::string>(saved) : std::nullopt;
  ::setenv("NCCL_NVLS_ENABLE", "0", 1);
  EXPECT_NO_THROW(require_nvls_off());
  ::unsetenv("NCCL_NVLS_ENABLE");
  EXPECT_THAT(message_of([] { require_nvls_off(); }), HasSubstr("NCCL_NVLS_ENABLE is not set"));
  EXPECT_EQ(std::getenv("NCCL_NVLS_ENABLE"), nullptr);  // refused, not set behind the caller's back
  ::setenv("NCCL_NVLS_ENABLE", "1", 1);
  EXPECT_THAT(message_of([] { require_nvls_off(); }), HasSubstr("NCCL_NVLS_ENABLE='1' lets NCCL use"));
  // A value NCCL does not define is refused by the registry's parser, naming it.
  ::setenv("NCCL_NVLS_ENABLE", "yes", 1);
  EXPECT_EQ(message_of([] { require_nvls_off(); }),
            "NCCL_NVLS_ENABLE='yes' is not an integer; expected an integer in 0..2");
  if (saved_value) {
    ::setenv("NCCL_NVLS_ENABLE", saved_value->c_str(), 1);
  } else {
    ::unsetenv("NCCL_NVLS_ENABLE");
  }
}

TEST(GpuPlacement, names_round_trip_and_unknown_names_fail) {
  for (GpuPlacement placement : {GpuPlacement::automatic, GpuPlacement::simulated, GpuPlacement::devices})
    EXPECT_EQ(parse_gpu_placement(to_string(placement)), placement);
  EXPECT_THAT(message_of([] { parse_gpu_placement("gpus"); }), HasSubstr("unknown GPU placement 'gpus'"));
}

TEST(GpuPlacement, automatic_takes_devices_only_when_every_condition_holds) {
  std::string why;
  EXPECT_EQ(choose_gpu_placement(GpuPlacement::automatic, 8, 8, true, "", &why), GpuPlacement::devices);
  EXPECT_EQ(why, "8 ranks on GPUs 0..7, one thread per GPU (NCCL)");
  EXPECT_EQ(choose_gpu_placement(GpuPlacement::automatic, 4, 1, false, "", &why), GpuPlacement::simulated);
  EXPECT_EQ(why, "4 ranks simulated on GPU 0 (1 GPU present)");
  EXPECT_EQ(choose_gpu_placement(GpuPlacement::automatic, 4, 8, false, "", &why), GpuPlacement::simulated);
  EXPECT_THAT(why, HasSubstr("lack peer access"));
  EXPECT_EQ(choose_gpu_placement(GpuPlacement::automatic, 2, 2, true, "latentmoe was built without NCCL", &why),
            GpuPlacement::simulated);
  EXPECT_EQ(why, "2 ranks simulated on GPU 0 (latentmoe was built without NCCL)");
  // The wrong libnccl: simulated, saying why (the message names both versions).
  const std::string mismatch = *nccl_version_mismatch(22803, 22809);
  EXPECT_EQ(choose_gpu_placement(GpuPlacement::automatic, 2, 2, true, mismatch, &why), GpuPlacement::simulated);
  EXPECT_THAT(why, HasSubstr("loaded libnccl 2.28.3"));
  EXPECT_EQ(choose_gpu_placement(GpuPlacement::simulated, 2, 8, true, "", &why), GpuPlacement::simulated);
  EXPECT_THAT(why, HasSubstr("placement simulated"));
}

TEST(GpuPlacement, devices_that_are_not_there_are_an_error_naming_why) {
  EXPECT_EQ(message_of([] { choose_gpu_placement(GpuPlacement::devices, 4, 2, false, "", nullptr); }),
            "placement devices: tp 4 needs 4 GPUs with peer access and NCCL, but 2 GPUs present");
  EXPECT_EQ(choose_gpu_placement(GpuPlacement::devices, 2, 2, true, "", nullptr), GpuPlacement::devices);
  EXPECT_THAT(message_of([] { choose_gpu_placement(GpuPlacement::devices, 2, 2, true, "no NCCL", nullptr); }),
              HasSubstr("but no NCCL"));
}

TEST(GpuPlacement, this_machine_without_a_gpu_simulates) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "a GPU is present";
  std::string why;
  EXPECT_EQ(resolve_gpu_placement(GpuPlacement::automatic, 2, &why), GpuPlacement::simulated);
  EXPECT_THAT(why, HasSubstr("2 ranks simulated on GPU 0"));
  EXPECT_THROW(resolve_gpu_placement(GpuPlacement::devices, 2), Error);
}

// NCCL's semantics on packed buffers, computed on the host: rank r's reduce-scatter result is the r-th
// contiguous chunk of the sum, and an all-gather concatenates the ranks' chunks.
std::vector<float> nccl_reduce_scatter_chunk(const std::vector<std::vector<float>>& sends, int rank, int size) {
  const size_t chunk = sends[0].size() / size;
  std::vector<float> out(chunk, 0.0f);
  for (const auto& send : sends)
    for (size_t i = 0; i < chunk; ++i) out[i] += send[rank * chunk + i];
  return out;
}

std::vector<float> random_values(size_t count, uint32_t seed) {
  std::mt19937 generator(seed);
  std::uniform_real_distribution<float> distribution(-1.0f, 1.0f);
  std::vector<float> values(count);
  for (float& value : values) value = distribution(generator);
  return values;
}

TEST(ShardLayout, packing_gives_nccls_chunks_the_column_block_layout_at_every_token_count) {
  for (int size : {2, 4, 8}) {
    for (int64_t rows : {1, 3, 17, 133}) {
      SCOPED_TRACE("size " + std::to_string(size) + ", rows " + std::to_string(rows));
      const int64_t cols = 6 * size, chunk = cols / size, ld = cols + 5;  // strided rows
      std::vector<std::vector<float>> inputs, packed(size, std::vector<float>(rows * cols));
      for (int r = 0; r < size; ++r) {
        inputs.push_back(random_values(rows * ld, 100 * size + r));
        pack_column_blocks_host(inputs[r].data(), ld, rows, cols, size, sizeof(float), packed[r].data());
      }
      // Reduce-scatter: chunk r of the packed sum is rank r's column block of the sum, row by row.
      for (int r = 0; r < size; ++r) {
        const std::vector<float> got = nccl_reduce_scatter_chunk(packed, r, size);
        for (int64_t t = 0; t < rows; ++t) {
          for (int64_t c = 0; c < chunk; ++c) {
            float expected = 0.0f;
            for (int p = 0; p < size; ++p) expected += inputs[p][t * ld + r * chunk + c];
            ASSERT_EQ(got[t * chunk + c], expected) << "rank " << r << ", row " << t << ", col " << c;
          }
        }
      }
      // All-gather: the ranks' blocks concatenated as NCCL does, unpacked, are every row's column blocks.
      std::vector<float> gathered;
      std::vector<std::vector<float>> blocks(size);
      for (int r = 0; r < size; ++r) {
        blocks[r] = random_values(rows * chunk, 7 * r + 1);
        gathered.insert(gathered.end(), blocks[r].begin(), blocks[r].end());
      }
      std::vector<float> out(rows * ld, -7.0f);
      unpack_column_blocks_host(gathered.data(), rows, cols, size, sizeof(float), out.data(), ld);
      for (int64_t t = 0; t < rows; ++t) {
        for (int64_t c = 0; c < cols; ++c) ASSERT_EQ(out[t * ld + c], blocks[c / chunk][t * chunk + c % chunk]);
        for (int64_t c = cols; c < ld; ++c) ASSERT_EQ(out[t * ld + c], -7.0f) << "padding written";
      }
    }
  }
}

TEST(ShardLayout, unpacked_chunks_are_row_blocks_and_differ_from_column_blocks_above_one_token) {
  // What the packing is for: NCCL's chunk r of a contiguous [T, d] is a block of rows, which is rank r's
  // column block only at T = 1.
  const int size = 4;
  const int64_t cols = 8;
  for (int64_t rows : {1, 3}) {
    std::vector<float> x(rows * cols);
    for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i);
    std::vector<float> packed(x.size());
    pack_column_blocks_host(x.data(), cols, rows, cols, size, sizeof(float), packed.data());
    EXPECT_EQ(packed == x, rows == 1) << "rows " << rows;
  }
  EXPECT_EQ(packed_index(0, 0, 3, 8, 4), 0);
  EXPECT_EQ(packed_index(0, 2, 3, 8, 4), 6);   // column block 1 starts after block 0's 3 rows x 2
  EXPECT_EQ(packed_index(2, 7, 3, 8, 4), 23);  // the last element stays last
}

TEST(OneShotTokens, the_default_is_512_for_two_ranks_64_above_and_the_variable_must_be_a_positive_integer) {
  const char* saved = std::getenv("LATENTMOE_ONE_SHOT_MAX_TOKENS");
  const std::string saved_value = saved != nullptr ? saved : "";
  ::unsetenv("LATENTMOE_ONE_SHOT_MAX_TOKENS");
  EXPECT_EQ(default_one_shot_tokens(2), kDefaultOneShotTokensTwoRanks);
  EXPECT_EQ(kDefaultOneShotTokensTwoRanks, 512);
  for (int tp : {3, 4, 8, 16}) EXPECT_EQ(default_one_shot_tokens(tp), kDefaultOneShotTokens) << tp;
  EXPECT_EQ(kDefaultOneShotTokens, 64);
  ::setenv("LATENTMOE_ONE_SHOT_MAX_TOKENS", "256", 1);
  EXPECT_EQ(default_one_shot_tokens(2), 256);
  EXPECT_EQ(default_one_shot_tokens(8), 256);
  for (const char* bad : {"0", "-3", "12x", "x", "2000000"}) {
    ::setenv("LATENTMOE_ONE_SHOT_MAX_TOKENS", bad, 1);
    EXPECT_THAT(message_of([] { default_one_shot_tokens(4); }),
                AllOf(HasSubstr(std::string("LATENTMOE_ONE_SHOT_MAX_TOKENS='") + bad + "' is "),
                      HasSubstr("; expected an integer in 1..1048576 (tokens)")))
        << bad;
  }
  if (saved != nullptr) {
    ::setenv("LATENTMOE_ONE_SHOT_MAX_TOKENS", saved_value.c_str(), 1);
  } else {
    ::unsetenv("LATENTMOE_ONE_SHOT_MAX_TOKENS");
  }
}

TEST(OneShotTokens, an_nccl_group_is_one_shot_up_to_the_bound_and_nccl_above) {
  GpuGroupOptions options;
  size_nccl_group(options, 4096, 7168 + 3584, 64);
  EXPECT_EQ(options.capacity_elements, 64 * (7168 + 3584));
  EXPECT_EQ(options.max_elements, 4096 * (7168 + 3584));
  size_nccl_group(options, 8, 100, 64);  // fewer tokens than the bound: every message one-shot
  EXPECT_EQ(options.capacity_elements, 800);
  EXPECT_EQ(options.max_elements, 800);
  EXPECT_THROW(size_nccl_group(options, 0, 100, 64), Error);
  EXPECT_THROW(size_nccl_group(options, 8, 100, 0), Error);
  // What the tiers then get: tier 0 and the rest one-shot up to 64 tokens, NCCL's staging above.
  const LayerConfig config = latentmoe::testing::kimi_like_config();  // d 40, l 24
  size_nccl_group(options, 100, config.hidden_size + config.latent_size, 4);
  TierSupport support;
  const GpuGroupLimits limits{DType::bf16, true, options.capacity_elements * 2, options.max_elements};
  apply_gpu_group_limits(support, config, DType::bf16, 2, limits);
  EXPECT_THAT(support.collectives, HasSubstr("NCCL above"));
  EXPECT_EQ(support[TailTier::native].max_tokens, 100 * 64 / 40);
}

TEST(GpuGroupLimits, one_shot_only_bounds_every_tier_by_its_widest_message) {
  const LayerConfig config = latentmoe::testing::kimi_like_config();  // d 40, l 24, shared expert
  TierSupport support;
  GpuGroupLimits limits{DType::bf16, true, 640, 0};
  apply_gpu_group_limits(support, config, DType::bf16, 2, limits);
  EXPECT_TRUE(support.peers_reachable);
  EXPECT_EQ(support[TailTier::tail_fusion].max_tokens, 7);  // l + d/2 = 44 bf16 = 88 bytes per token
  EXPECT_EQ(support[TailTier::native].max_tokens, 8);       // max(d, l) = 40 bf16 = 80 bytes
  EXPECT_THAT(support[TailTier::native].reason, HasSubstr("one-shot buffer holds 640 bytes"));
}

TEST(GpuGroupLimits, nccl_above_the_capacity_lifts_the_bounds_to_its_staging) {
  const LayerConfig config = latentmoe::testing::kimi_like_config();
  TierSupport support;
  GpuGroupLimits limits{DType::bf16, true, 640, 40 * 100};
  apply_gpu_group_limits(support, config, DType::bf16, 2, limits);
  EXPECT_TRUE(support.peers_reachable);
  EXPECT_THAT(support.collectives, HasSubstr("NCCL above"));
  for (TailTier tier :
       {TailTier::native, TailTier::tail_fusion, TailTier::allreduce_overlap, TailTier::column_parallel}) {
    EXPECT_TRUE(support[tier].supported);
    EXPECT_EQ(support[tier].max_tokens, 100) << to_string(tier);
    EXPECT_THAT(support[tier].reason, HasSubstr("max_elements"));
  }
}

TEST(GpuGroupLimits, without_load_store_reach_the_fused_tier_is_refused_and_the_rest_use_nccl) {
  const LayerConfig config = latentmoe::testing::kimi_like_config();
  TierSupport support;
  GpuGroupLimits limits{DType::bf16, false, 0, 40 * 16};
  apply_gpu_group_limits(support, config, DType::bf16, 4, limits);
  EXPECT_FALSE(support.peers_reachable);
  EXPECT_THAT(support.collectives, HasSubstr("NCCL collectives"));
  EXPECT_FALSE(support[TailTier::tail_fusion].supported);
  EXPECT_THAT(support[TailTier::tail_fusion].reason, HasSubstr("load and store"));
  for (TailTier tier : {TailTier::native, TailTier::allreduce_overlap, TailTier::column_parallel}) {
    EXPECT_TRUE(support[tier].supported) << to_string(tier);
    EXPECT_EQ(support[tier].max_tokens, 16) << to_string(tier);
  }
}

TEST(GpuGroupLimits, a_group_of_another_dtype_refuses_every_tier) {
  const LayerConfig config = latentmoe::testing::kimi_like_config();
  TierSupport support;
  apply_gpu_group_limits(support, config, DType::f16, 2, GpuGroupLimits{DType::bf16, true, 1 << 20, 0});
  for (TailTier tier :
       {TailTier::native, TailTier::tail_fusion, TailTier::allreduce_overlap, TailTier::column_parallel}) {
    EXPECT_FALSE(support[tier].supported);
    EXPECT_THAT(support[tier].reason, HasSubstr("carries BF16"));
  }
}

}  // namespace
}  // namespace latentmoe::detail

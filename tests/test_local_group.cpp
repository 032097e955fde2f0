// run_local_group_points (latentmoe/local_group.h): a sweep of points on one group built once gives, per
// point, what a group built for that point alone gives; a forced tier the runners do not support is
// skipped per point; bad sweeps are refused with one clear message. The seeded random tensors that such
// sweeps build their layers from: filled in parallel pieces, the same bits as one sequential pass. And
// the host's bounded wait for a rank's device work.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/runner_state.h"
#include "error_test_util.h"
#include "latentmoe/local_group.h"
#include "latentmoe/random.h"
#include "latentmoe/weights.h"
#include "layer_test_util.h"

namespace latentmoe {
namespace {

using testing::message_of;

TEST(LocalGroupPoints, a_sweep_on_one_group_matches_a_group_per_point) {
  const LayerConfig config = testing::kimi_like_config();
  const LayerWeights weights = make_random_layer_weights(config, DType::f32, 21);
  auto shard = [&](const ParallelConfig& p) { return shard_layer_weights(weights, config, p); };
  // Token counts out of order (the group is sized for the largest, 7), every tier and the policy.
  const std::vector<int64_t> tokens = {3, 7, 1};
  std::vector<LocalGroupInputs> inputs;
  for (int64_t t : tokens) inputs.push_back(testing::random_inputs(config, t, DType::f32, 100 + t));
  std::vector<LocalGroupPoint> points;
  const std::vector<std::optional<TailTier>> tiers = {
      TailTier::native, TailTier::tail_fusion, TailTier::allreduce_overlap, TailTier::column_parallel, std::nullopt};
  for (const LocalGroupInputs& in : inputs)
    for (const auto& tier : tiers) points.push_back(LocalGroupPoint{&in, tier});
  LocalGroupOptions options;
  options.tp_size = 2;
  options.num_timed_runs = 2;
  const auto swept = run_local_group_points(config, shard, points, options);
  ASSERT_EQ(swept.size(), points.size());
  for (size_t p = 0; p < points.size(); ++p) {
    SCOPED_TRACE("point " + std::to_string(p));
    LocalGroupOptions alone = options;
    alone.tier = points[p].tier;
    const std::vector<RankResult> expected = run_local_group(config, shard, *points[p].inputs, alone);
    ASSERT_EQ(swept[p].size(), 2u);
    for (int rank = 0; rank < 2; ++rank) {
      const RankResult& got = swept[p][rank];
      EXPECT_TRUE(got.ran);
      EXPECT_EQ(got.tier, expected[rank].tier);
      if (points[p].tier) EXPECT_EQ(got.tier, *points[p].tier);
      ASSERT_EQ(got.output.shape(), expected[rank].output.shape());
      EXPECT_EQ(std::memcmp(got.output.data(), expected[rank].output.data(), got.output.nbytes()), 0);
      EXPECT_EQ(std::memcmp(got.topk_ids.data(), expected[rank].topk_ids.data(), got.topk_ids.nbytes()), 0);
      EXPECT_GE(got.forward_ms, 0.0);
    }
  }
}

TEST(LocalGroupPoints, an_unsupported_forced_tier_is_skipped_per_point) {
  const LayerConfig config = testing::kimi_like_config();
  const LayerWeights weights = make_random_layer_weights(config, DType::f32, 22);
  auto shard = [&](const ParallelConfig& p) { return shard_layer_weights(weights, config, p); };
  const LocalGroupInputs inputs = testing::random_inputs(config, 2, DType::f32, 5);
  // tp 1 runs only the native tier.
  const std::vector<LocalGroupPoint> points = {{&inputs, TailTier::column_parallel}, {&inputs, TailTier::native}};
  LocalGroupOptions options;
  options.skip_unsupported_tier = true;
  const auto results = run_local_group_points(config, shard, points, options);
  ASSERT_EQ(results.size(), 2u);
  EXPECT_FALSE(results[0][0].ran);
  EXPECT_TRUE(results[1][0].ran);
  options.skip_unsupported_tier = false;
  EXPECT_EQ(message_of([&] { run_local_group_points(config, shard, points, options); }),
            "tier column_parallel needs tp > 1 (tp is 1)");
}

TEST(LocalGroupPoints, bad_sweeps_are_refused) {
  const LayerConfig config = testing::kimi_like_config();
  const LayerWeights weights = make_random_layer_weights(config, DType::f32, 23);
  auto shard = [&](const ParallelConfig& p) { return shard_layer_weights(weights, config, p); };
  LocalGroupOptions options;
  EXPECT_EQ(message_of([&] { run_local_group_points(config, shard, {}, options); }),
            "run_local_group_points: no point to run");
  EXPECT_EQ(message_of([&] { run_local_group_points(config, shard, {LocalGroupPoint{}}, options); }),
            "run_local_group_points: point 0 has no inputs");
  const LocalGroupInputs f32 = testing::random_inputs(config, 2, DType::f32, 6);
  const LocalGroupInputs bf16 = testing::random_inputs(config, 2, DType::bf16, 6);
  EXPECT_EQ(message_of([&] {
              run_local_group_points(config, shard, {{&f32, std::nullopt}, {&bf16, std::nullopt}}, options);
            }),
            "point 1: hidden_states are BF16 but point 0's are F32 (one group runs one dtype)");
  LocalGroupInputs flat;
  flat.hidden_states = HostTensor(DType::f32, {config.hidden_size});
  EXPECT_EQ(message_of([&] {
              run_local_group_points(config, shard, {{&f32, std::nullopt}, {&flat, std::nullopt}}, options);
            }),
            "hidden_states must be a rank-2 tensor [tokens, hidden_size] (point 1)");
}

// Large enough to be filled by several threads (pieces of 4M elements) on a machine that has them; the
// bits must be those of one sequential pass of SplitMix64 over the elements.
TEST(RandomTensors, a_parallel_fill_gives_the_sequential_bits) {
  const int64_t count = (int64_t{1} << 23) + 12345;
  const HostTensor tensor = random_uniform_tensor(DType::f32, {count}, 77, 0.5f, 1.0f);
  SplitMix64 rng(77);
  const float* values = tensor.data_as<float>();
  int64_t mismatches = 0;
  for (int64_t i = 0; i < count; ++i) mismatches += values[i] != 1.0f + rng.uniform_pm1() * 0.5f;
  EXPECT_EQ(mismatches, 0);
  // discard(n) lands where n draws land.
  SplitMix64 stepped(5), jumped(5);
  for (int i = 0; i < 1000; ++i) stepped.next();
  jumped.discard(1000);
  EXPECT_EQ(stepped.next(), jumped.next());
}

// A communicator that records abort() and reports a fixed record of collectives.
class RecordingCommunicator final : public Communicator {
 public:
  int size() const override { return 2; }
  int rank() const override { return 1; }
  void all_reduce_sum(const TensorView&, StreamHandle) override {}
  void reduce_scatter_sum(const TensorView&, const TensorView&, StreamHandle) override {}
  void all_gather(const TensorView&, const TensorView&, StreamHandle) override {}
  void barrier(StreamHandle) override {}
  void abort() override { ++aborts; }
  std::string recent_collectives() const override { return "#7 all-reduce [37, 3584] NCCL"; }
  std::chrono::milliseconds timeout() const override { return own_timeout; }
  int aborts = 0;
  std::chrono::milliseconds own_timeout{0};  // 0: the environment's default
};

// The host's bounded wait for a rank's device work (detail::wait_or_abort, behind wait_for_device): work
// that completes costs nothing; work that does not within twice the collective timeout aborts the group
// and names the rank, the step, the limit and the rank's last collectives.
TEST(WaitForDevice, a_wait_that_ends_passes_one_that_does_not_aborts_the_group_and_says_where) {
  const char* saved = std::getenv("LATENTMOE_COLLECTIVE_TIMEOUT_MS");
  const std::string saved_value = saved != nullptr ? saved : "";
  ::setenv("LATENTMOE_COLLECTIVE_TIMEOUT_MS", "1500", 1);
  RecordingCommunicator comm;
  std::chrono::milliseconds asked{0};
  detail::wait_or_abort(
      [&](std::chrono::milliseconds limit) {
        asked = limit;
        return true;
      },
      detail::host_wait_limit(comm), comm, 1, "the forward");
  EXPECT_EQ(asked, std::chrono::milliseconds(3000));
  EXPECT_EQ(comm.aborts, 0);
  EXPECT_EQ(message_of([&] {
              detail::wait_or_abort([](std::chrono::milliseconds) { return false; }, detail::host_wait_limit(comm),
                                    comm, 1, "the forward");
            }),
            "rank 1: the forward did not finish on the device within 3000 ms (twice the collective timeout): most "
            "likely a collective that never completed; the group was aborted; this rank's last collectives, oldest "
            "first: #7 all-reduce [37, 3584] NCCL");
  EXPECT_EQ(comm.aborts, 1);
  // A group that states its own timeout (a GPU group built with a longer one) is waited for twice that.
  comm.own_timeout = std::chrono::milliseconds(7000);
  EXPECT_NE(message_of([&] {
              detail::wait_or_abort(
                  [&](std::chrono::milliseconds limit) {
                    asked = limit;
                    return false;
                  },
                  detail::host_wait_limit(comm), comm, 1, "the forward");
            }).find("within 14000 ms (twice the collective timeout)"),
            std::string::npos);
  EXPECT_EQ(asked, std::chrono::milliseconds(14000));
  if (saved != nullptr) {
    ::setenv("LATENTMOE_COLLECTIVE_TIMEOUT_MS", saved_value.c_str(), 1);
  } else {
    ::unsetenv("LATENTMOE_COLLECTIVE_TIMEOUT_MS");
  }
}

}  // namespace
}  // namespace latentmoe

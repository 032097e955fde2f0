// GPU groups on real GPUs through NCCL (latentmoe/gpu_group.h, latentmoe/nccl_group.h).
//   - One GPU: a one-rank NCCL group with a registered symmetric window runs every op one-shot and, above
//     the capacity or with the one-shot path off, through NCCL, at strided views; the caller's-communicator
//     path; the pack kernels against the host reference at several group sizes; refusals (NVLS on).
//   - Several GPUs (each skips unless that many are present): every collective at T 1, 3, 17, 133 against
//     rank-order sums, one-shot (bit-exact) and through NCCL (within rounding, bit-identical on all ranks
//     for the all-reduce); every tier of the layer at tp 2/4/8 on GPUs 0..tp-1 against the CPU runner with
//     bit-identical outputs on all ranks; forward captured into a CUDA graph on each rank's thread
//     (thread-local capture) and replayed with new inputs.
// NCCL's device API must be the release latentmoe was compiled against: where the loaded libnccl is another,
// these tests skip, or fail when LATENTMOE_TEST_REQUIRE_NCCL=1 (scripts/gpu_run.sh's nccl step sets it).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <thread>

#include "core/shard_layout.h"
#include "cuda/comm/lamport_communicator.h"
#include "cuda/comm/shard_pack.h"
#include "cuda_test_util.h"
#include "graph_test_util.h"
#include "lamport_test_util.h"
#include "latentmoe/compare.h"
#include "latentmoe/error.h"
#include "latentmoe/gpu_group.h"
#include "latentmoe/local_group.h"
#include "latentmoe/runner.h"
#include "latentmoe/weights.h"
#include "layer_test_util.h"
#include "nccl_test_util.h"

#if defined(LATENTMOE_WITH_NCCL)
#include <nccl.h>

#include "latentmoe/nccl_group.h"
#endif

namespace latentmoe::cuda::testing {
namespace {

// One rank's device side on GPU `device`: its backend and stream.
struct Rank {
  int device;
  std::unique_ptr<Backend> backend;
  cudaStream_t stream = nullptr;
  explicit Rank(int device_ordinal) : device(device_ordinal), backend(detail::make_cuda_backend(device_ordinal)) {
    DeviceGuard guard(device);
    EXPECT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  }
  ~Rank() {
    DeviceGuard guard(device);
    cudaStreamDestroy(stream);
  }
};

HostTensor rank_order_sum(const std::vector<HostTensor>& inputs) {
  const HostTensor& first = inputs.front();
  HostTensor sum(first.dtype(), first.shape());
  for (int64_t i = 0; i < first.numel(); ++i) {
    float total = 0.0f;
    for (const HostTensor& input : inputs) total += load_as_float(input.data(), input.dtype(), i);
    store_from_float(sum.data(), first.dtype(), i, total);
  }
  return sum;
}

HostTensor column_block(const HostTensor& whole, int block, int blocks) {
  const int64_t rows = whole.size(0), cols = whole.size(1), chunk = cols / blocks;
  HostTensor out(whole.dtype(), {rows, chunk});
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t c = 0; c < chunk; ++c)
      store_from_float(out.data(), whole.dtype(), t * chunk + c,
                       load_as_float(whole.data(), whole.dtype(), t * cols + block * chunk + c));
  return out;
}

// --- one GPU ---------------------------------------------------------------------------------------

// The library sets no NCCL variable: a group is refused unless NCCL_NVLS_ENABLE is 0, unset included
// (NCCL's default uses multicast), before NCCL starts.
TEST(NcclGroup, refuses_nvlink_multicast) {
  const char* saved = std::getenv("NCCL_NVLS_ENABLE");
  const std::string saved_value = saved != nullptr ? saved : "";
  GpuGroupOptions options;
  options.capacity_elements = 64;
  for (const char* value : {"1", "2", ""}) {
    SCOPED_TRACE(std::string("NCCL_NVLS_ENABLE='") + value + "'");
    setenv("NCCL_NVLS_ENABLE", value, 1);
    try {
      make_nccl_gpu_group(1, options);
      ADD_FAILURE() << "accepted";
    } catch (const Error& error) {
#if defined(LATENTMOE_WITH_NCCL)
      const std::string expected =
          *value == '\0' ? std::string("NCCL_NVLS_ENABLE is not set") : std::string("NCCL_NVLS_ENABLE='") + value + "'";
      EXPECT_NE(std::string(error.what()).find(expected), std::string::npos) << error.what();
      EXPECT_NE(std::string(error.what()).find("set NCCL_NVLS_ENABLE=0"), std::string::npos) << error.what();
#endif
    }
    // Still as the test left it: the library wrote nothing.
    ASSERT_NE(std::getenv("NCCL_NVLS_ENABLE"), nullptr);
    EXPECT_EQ(std::string(std::getenv("NCCL_NVLS_ENABLE")), value);
  }
  if (saved != nullptr) {
    setenv("NCCL_NVLS_ENABLE", saved_value.c_str(), 1);
  } else {
    unsetenv("NCCL_NVLS_ENABLE");
  }
}

TEST(NcclGroup, pack_kernels_match_the_host_layout) {
  LATENTMOE_REQUIRE_GPU();
  Rank rank(0);
  for (DType dtype : {DType::bf16, DType::f32}) {
    for (int size : {1, 2, 4, 8}) {
      for (int64_t rows : {1, 3, 17, 133}) {
        SCOPED_TRACE(name_of(dtype) + ", size " + std::to_string(size) + ", rows " + std::to_string(rows));
        const int64_t cols = 24 * size, ld = cols + 8;
        const size_t e = dtype_size(dtype);
        const HostTensor input = random_tensor(dtype, {rows, ld}, static_cast<uint32_t>(rows * size));
        HostTensor expected_packed(dtype, {rows * cols});
        ::latentmoe::detail::pack_column_blocks_host(input.data(), ld, rows, cols, size, e, expected_packed.data());
        DeviceTensor in = upload(*rank.backend, input);
        DeviceTensor packed = poisoned(*rank.backend, dtype, {rows * cols});
        DeviceTensor out = upload(*rank.backend, input);  // the padding columns must survive the unpack
        launch_pack_column_blocks(in.view.data(), ld, rows, cols, size, e, packed.view.data(),
                                  static_cast<cudaStream_t>(rank.backend->stream()));
        const HostTensor got_packed = download(*rank.backend, packed.view);
        EXPECT_TRUE(bitwise_equal(got_packed.view(), expected_packed.view()));
        ASSERT_EQ(cudaMemsetAsync(out.view.data(), 0, static_cast<size_t>(rows * ld) * e,
                                  static_cast<cudaStream_t>(rank.backend->stream())),
                  cudaSuccess);
        launch_unpack_column_blocks(packed.view.data(), rows, cols, size, e, out.view.data(), ld,
                                    static_cast<cudaStream_t>(rank.backend->stream()));
        const HostTensor got = download(*rank.backend, out.view);
        for (int64_t t = 0; t < rows; ++t) {
          ASSERT_EQ(std::memcmp(static_cast<const char*>(got.data()) + t * ld * e,
                                static_cast<const char*>(input.data()) + t * ld * e, cols * e),
                    0)
              << "row " << t;
        }
      }
    }
  }
}

// One rank, one GPU: every op one-shot through the registered window (5 rows), through NCCL above the
// capacity (40 rows, strided views), and with the one-shot path off; with one rank every result is the
// input. The fused AR + RMSNorm through the window's peer struct as well.
TEST(NcclGroup, a_one_rank_group_runs_every_op_through_the_window_and_through_nccl) {
  LATENTMOE_REQUIRE_NCCL(1);
  for (bool one_shot : {true, false}) {
    SCOPED_TRACE(one_shot ? "one-shot" : "NCCL only");
    GpuGroupOptions options;
    options.dtype = DType::bf16;
    options.capacity_elements = 5 * 200;
    options.max_elements = 64 * 200;
    options.one_shot = one_shot;
    auto group = make_nccl_gpu_group(1, options);
    auto& lamport = dynamic_cast<LamportCommunicator&>(*group[0]);
    EXPECT_EQ(lamport.one_shot(), one_shot);
    EXPECT_EQ(lamport.fallback_elements(), 64 * 200);
    Rank rank(0);
    for (int64_t rows : {5, 40}) {
      SCOPED_TRACE("rows " + std::to_string(rows));
      const HostTensor input = random_tensor(DType::bf16, {rows, 200}, static_cast<uint32_t>(rows));
      DeviceTensor in = upload(*rank.backend, input);
      // Strided: column blocks of wider buffers.
      DeviceTensor wide_a = poisoned(*rank.backend, DType::bf16, {rows, 232});
      DeviceTensor wide_b = poisoned(*rank.backend, DType::bf16, {rows, 216});
      const TensorView a = wide_a.view.slice_cols(16, 216), b = wide_b.view.slice_cols(8, 208);
      for (int call = 0; call < 4; ++call) {  // more calls than slots
        group[0]->reduce_scatter_sum(in.view, a, rank.stream);
        group[0]->all_gather(a, b, rank.stream);
        group[0]->all_reduce_sum(b, rank.stream);
        group[0]->barrier(rank.stream);
      }
      ASSERT_EQ(cudaStreamSynchronize(rank.stream), cudaSuccess);
      group[0]->check();
      EXPECT_TRUE(bitwise_equal(download(*rank.backend, b).view(), input.view()));
    }
    // Above max_elements (129 x 100 > 64 x 200 elements, a strided view): an Error naming it, before
    // anything is enqueued.
    DeviceTensor too_big = device_empty(*rank.backend, DType::bf16, {129, 200});
    const TensorView strided = too_big.view.slice_cols(0, 100);
    EXPECT_THROW(group[0]->all_reduce_sum(strided, rank.stream), Error);
  }
  // The fused AR + RMSNorm kernel through the window's peer pointers.
  GpuGroupOptions options;
  options.dtype = DType::bf16;
  options.capacity_elements = 5 * 200;
  auto group = make_nccl_gpu_group(1, options);
  Rank rank(0);
  const HostTensor input = random_tensor(DType::bf16, {5, 200}, 3);
  const HostTensor gamma = random_tensor(DType::f32, {200}, 4, 0.5f, 1.5f);
  expect_one_rank_fused_norm(*group[0], *rank.backend, rank.stream, input, gamma);
}

#if defined(LATENTMOE_WITH_NCCL)
// One process per GPU, rehearsed with one rank: the caller's ncclComm_t.
TEST(NcclGroup, a_callers_communicator_carries_the_group) {
  LATENTMOE_REQUIRE_NCCL(1);
  setenv("NCCL_NVLS_ENABLE", "0", 0);
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  ncclComm_t comm = nullptr;
  {
    DeviceGuard guard(0);
    ASSERT_EQ(ncclCommInitRank(&comm, 1, id, 0), ncclSuccess);
  }
  {
    GpuGroupOptions options;
    options.dtype = DType::f32;
    options.capacity_elements = 3 * 64;
    options.max_elements = 17 * 64;
    auto communicator = make_nccl_communicator(comm, options);
    EXPECT_EQ(communicator->size(), 1);
    EXPECT_EQ(communicator->rank(), 0);
    Rank rank(0);
    for (int64_t rows : {3, 17}) {
      const HostTensor input = random_tensor(DType::f32, {rows, 64}, 11);
      DeviceTensor buffer = upload(*rank.backend, input);
      communicator->all_reduce_sum(buffer.view, rank.stream);
      ASSERT_EQ(cudaStreamSynchronize(rank.stream), cudaSuccess);
      communicator->check();
      EXPECT_TRUE(bitwise_equal(download(*rank.backend, buffer.view).view(), input.view()));
    }
  }
  EXPECT_EQ(ncclCommDestroy(comm), ncclSuccess);
}
#endif

// --- several GPUs ----------------------------------------------------------------------------------

class NcclGroupCollectives : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(NcclGroupCollectives, match_rank_order_sums_at_every_token_count) {
  const auto [tp, one_shot] = GetParam();
  LATENTMOE_REQUIRE_NCCL(tp);
  const DType dtype = DType::bf16;
  const int64_t cols = 24 * tp;
  const std::vector<int64_t> token_counts = {1, 3, 17, 133, 2};
  GpuGroupOptions options;
  options.dtype = dtype;
  options.capacity_elements = 17 * cols;  // 133 rows go through NCCL even with the one-shot path
  options.max_elements = 133 * cols;
  options.one_shot = one_shot;
  options.timeout = std::chrono::milliseconds(5000);
  auto group = make_nccl_gpu_group(tp, options);
  std::vector<std::unique_ptr<Rank>> ranks;
  std::vector<DeviceTensor> ins, sums, shards, alls;
  for (int r = 0; r < tp; ++r) {
    ranks.push_back(std::make_unique<Rank>(r));
    Backend& backend = *ranks.back()->backend;
    ins.push_back(device_empty(backend, dtype, {133, cols}));
    sums.push_back(device_empty(backend, dtype, {133, cols}));
    shards.push_back(device_empty(backend, dtype, {133, cols / tp}));
    alls.push_back(device_empty(backend, dtype, {133, cols}));
  }
  for (int64_t rows : token_counts) {
    SCOPED_TRACE("T " + std::to_string(rows));
    const bool exact = one_shot && rows <= 17;  // one-shot: rank-order fp32 sums, rounded once
    std::vector<HostTensor> inputs;
    for (int r = 0; r < tp; ++r)
      inputs.push_back(random_tensor(dtype, {rows, cols}, static_cast<uint32_t>(rows * 31 + r)));
    std::vector<HostTensor> reduced(tp), scattered(tp), gathered(tp);
    on_rank_threads(tp, [&](int r) {
      Rank& rank = *ranks[r];
      Communicator& comm = *group[r];
      const TensorView in = ins[r].view.slice_rows(0, rows), sum = sums[r].view.slice_rows(0, rows),
                       shard = shards[r].view.slice_rows(0, rows), all = alls[r].view.slice_rows(0, rows);
      ASSERT_EQ(cudaMemcpyAsync(in.data(), inputs[r].data(), inputs[r].nbytes(), cudaMemcpyHostToDevice, rank.stream),
                cudaSuccess);
      ASSERT_EQ(cudaMemcpyAsync(sum.data(), in.data(), inputs[r].nbytes(), cudaMemcpyDeviceToDevice, rank.stream),
                cudaSuccess);
      comm.all_reduce_sum(sum, rank.stream);
      comm.reduce_scatter_sum(in, shard, rank.stream);
      comm.all_gather(shard, all, rank.stream);
      comm.barrier(rank.stream);
      ASSERT_EQ(cudaStreamSynchronize(rank.stream), cudaSuccess);
      comm.check();
      reduced[r] = download(*rank.backend, sum);
      scattered[r] = download(*rank.backend, shard);
      gathered[r] = download(*rank.backend, all);
    });
    const HostTensor expected = rank_order_sum(inputs);
    for (int r = 0; r < tp; ++r) {
      EXPECT_TRUE(bitwise_equal(reduced[r].view(), reduced[0].view())) << "all-reduce differs on rank " << r;
      const HostTensor block = column_block(expected, r, tp);
      if (exact) {
        EXPECT_TRUE(bitwise_equal(reduced[r].view(), expected.view())) << "all-reduce, rank " << r;
        EXPECT_TRUE(bitwise_equal(scattered[r].view(), block.view())) << "reduce-scatter, rank " << r;
      } else {
        EXPECT_LT(relative_error(reduced[r], expected), tolerance(dtype)) << "all-reduce, rank " << r;
        EXPECT_LT(relative_error(scattered[r], block), tolerance(dtype)) << "reduce-scatter, rank " << r;
      }
      // The all-gather of the scattered blocks: each rank's block in its columns, exactly.
      for (int b = 0; b < tp; ++b)
        EXPECT_TRUE(bitwise_equal(column_block(gathered[r], b, tp).view(), scattered[b].view()))
            << "all-gather, rank " << r << ", block " << b;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(TpAndPath, NcclGroupCollectives,
                         ::testing::Combine(::testing::Values(2, 4, 8), ::testing::Bool()), [](const auto& info) {
                           return "tp" + std::to_string(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "_one_shot" : "_nccl");
                         });

class NcclGroupLayer : public ::testing::TestWithParam<int> {};

TEST_P(NcclGroupLayer, every_tier_on_real_gpus_matches_the_cpu_runner_and_ranks_agree) {
  const int tp = GetParam();
  LATENTMOE_REQUIRE_NCCL(tp);
  if (resolve_gpu_placement(GpuPlacement::automatic, tp) != GpuPlacement::devices)
    GTEST_SKIP() << "no peer access between GPUs 0.." << tp - 1;
  const DType dtype = DType::bf16;
  uint64_t seed = 77 * tp;
  for (const LayerConfig& config :
       {latentmoe::testing::kimi_like_config(), latentmoe::testing::nemotron_like_config()}) {
    const LayerWeights weights = make_random_layer_weights(config, dtype, seed += 1000);
    for (int64_t tokens : {1, 3, 17, 133}) {
      LocalGroupInputs inputs = latentmoe::testing::random_inputs(config, tokens, dtype, seed + tokens);
      for (TailTier tier :
           {TailTier::native, TailTier::tail_fusion, TailTier::allreduce_overlap, TailTier::column_parallel}) {
        SCOPED_TRACE("d " + std::to_string(config.hidden_size) + ", tp " + std::to_string(tp) + ", T " +
                     std::to_string(tokens) + ", " + std::string(to_string(tier)));
        LocalGroupOptions options;
        options.tp_size = tp;
        options.tier = tier;
        auto shard = [&](const ParallelConfig& parallel) { return shard_layer_weights(weights, config, parallel); };
        options.backend = BackendKind::cpu;
        const auto ref = run_local_group(config, shard, inputs, options);
        options.backend = BackendKind::cuda;
        options.placement = GpuPlacement::devices;
        const auto got = run_local_group(config, shard, inputs, options);
        ASSERT_EQ(got.size(), static_cast<size_t>(tp));
        for (int r = 0; r < tp; ++r) {
          EXPECT_TRUE(bitwise_equal(got[r].output.view(), got[0].output.view())) << "rank " << r << " differs";
          EXPECT_EQ(got[r].tier, tier);
        }
        EXPECT_TRUE(got[0].tier_support.peers_reachable);
        EXPECT_EQ(count_non_finite(got[0].output), 0);
        EXPECT_LT(relative_error(got[0].output, ref[0].output), tolerance(dtype));
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Tp, NcclGroupLayer, ::testing::Values(2, 4, 8),
                         [](const auto& info) { return "tp" + std::to_string(info.param); });

// Runner::forward of every rank captured into a graph on the rank's own thread (thread-local capture mode),
// one graph per tier, then replayed with new inputs: bit-identical to the eager forward on every rank.
// Both paths: one-shot (the window) and NCCL only (tier 0 refused there).
class NcclGroupGraph : public ::testing::TestWithParam<bool> {};

TEST_P(NcclGroupGraph, forward_captured_per_rank_thread_replays_with_new_inputs) {
  const bool one_shot = GetParam();
  LATENTMOE_REQUIRE_NCCL(2);
  const int devices = cuda_device_count();
  const int tp = devices >= 8 ? 8 : devices >= 4 ? 4 : 2;
  constexpr int64_t kTokens = 5;
  constexpr int kInputs = 3, kReplays = 60;
  const DType dtype = DType::bf16;
  const LayerConfig config = latentmoe::testing::kimi_like_config();
  const LayerWeights weights = make_random_layer_weights(config, dtype, 99);
  std::vector<TailTier> tiers = {TailTier::native, TailTier::allreduce_overlap, TailTier::column_parallel};
  if (one_shot) tiers.push_back(TailTier::tail_fusion);
  const int num_tiers = static_cast<int>(tiers.size());
  const int64_t d = config.hidden_size;
  const size_t bytes = kTokens * d * dtype_size(dtype);

  GpuGroupOptions group_options;
  group_options.dtype = dtype;
  group_options.capacity_elements = kTokens * (config.hidden_size + config.latent_size);
  group_options.max_elements = group_options.capacity_elements;
  group_options.one_shot = one_shot;
  group_options.timeout = std::chrono::milliseconds(5000);
  auto group = make_nccl_gpu_group(tp, group_options);
  std::vector<std::unique_ptr<Rank>> ranks;
  std::vector<std::unique_ptr<Runner>> runners;
  std::vector<DeviceTensor> xs, outs, logits;
  const HostTensor host_logits =
      latentmoe::testing::random_host_tensor(DType::f32, {kTokens, config.num_router_outputs()}, 7, 3.0f);
  for (int r = 0; r < tp; ++r) {
    ranks.push_back(std::make_unique<Rank>(r));
    RunnerOptions options;
    options.backend = BackendKind::cuda;
    options.max_tokens = kTokens;
    options.device_ordinal = r;
    const ParallelConfig parallel{tp, r, false};
    runners.push_back(
        std::make_unique<Runner>(config, parallel, shard_layer_weights(weights, config, parallel), *group[r], options));
    EXPECT_EQ(runners.back()->tier_support()[TailTier::tail_fusion].supported, one_shot);
    xs.push_back(device_empty(*ranks[r]->backend, dtype, {kTokens, d}));
    outs.push_back(device_empty(*ranks[r]->backend, dtype, {kTokens, d}));
    logits.push_back(upload(*ranks[r]->backend, host_logits));
  }
  std::vector<std::unique_ptr<PinnedBuffer>> inputs;
  for (int i = 0; i < kInputs; ++i) {
    const HostTensor x = latentmoe::testing::random_host_tensor(dtype, {kTokens, d}, 500 + i);
    inputs.push_back(std::make_unique<PinnedBuffer>(bytes));
    std::memcpy(inputs.back()->data, x.data(), bytes);
  }
  auto forward = [&](int r, TailTier tier) {
    ForwardInputs in;
    in.hidden_states = xs[r].view;
    in.router_logits = logits[r].view;
    in.tier = tier;
    runners[r]->forward(in, ForwardOutputs{outs[r].view, {}, {}}, ranks[r]->stream);
  };
  // Eager references per rank, input and tier; ranks must agree bit for bit.
  std::vector<std::vector<std::unique_ptr<PinnedBuffer>>> eager(tp);
  std::vector<std::vector<cudaGraphExec_t>> graphs(tp, std::vector<cudaGraphExec_t>(num_tiers, nullptr));
  std::vector<int> wrong(tp, 0);
  for (int r = 0; r < tp; ++r)
    for (int i = 0; i < kInputs * num_tiers; ++i) eager[r].push_back(std::make_unique<PinnedBuffer>(bytes));
  std::vector<std::unique_ptr<PinnedBuffer>> results;
  for (int r = 0; r < tp; ++r) results.push_back(std::make_unique<PinnedBuffer>(bytes));
  on_rank_threads(tp, [&](int r) {
    DeviceGuard guard(r);
    cudaStream_t stream = ranks[r]->stream;
    for (int i = 0; i < kInputs; ++i) {
      for (int t = 0; t < num_tiers; ++t) {
        ASSERT_EQ(cudaMemcpyAsync(xs[r].view.data(), inputs[i]->data, bytes, cudaMemcpyHostToDevice, stream),
                  cudaSuccess);
        forward(r, tiers[t]);
        ASSERT_EQ(cudaMemcpyAsync(eager[r][i * num_tiers + t]->data, outs[r].view.data(), bytes, cudaMemcpyDeviceToHost,
                                  stream),
                  cudaSuccess);
        ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
        group[r]->check();
      }
    }
    // Capture on this rank's thread while the peers capture theirs.
    for (int t = 0; t < num_tiers; ++t) {
      cudaGraph_t graph = nullptr;
      ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
      forward(r, tiers[t]);
      ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
      ASSERT_EQ(cudaGraphInstantiate(&graphs[r][t], graph, 0), cudaSuccess);
      ASSERT_EQ(cudaGraphDestroy(graph), cudaSuccess);
    }
  });
  for (int r = 0; r < tp; ++r)
    for (int i = 0; i < kInputs * num_tiers; ++i)
      EXPECT_EQ(std::memcmp(eager[r][i]->data, eager[0][i]->data, bytes), 0) << "rank " << r << " differs, run " << i;
  on_rank_threads(tp, [&](int r) {
    DeviceGuard guard(r);
    wrong[r] = wrong_replays(
        ranks[r]->stream, graphs[r], xs[r].view.data(), outs[r].view.data(), bytes, inputs, *results[r],
        [&](int i, int t) { return eager[r][i * num_tiers + t]->data; }, kReplays);
    group[r]->check();
  });
  for (int r = 0; r < tp; ++r) EXPECT_EQ(wrong[r], 0) << "rank " << r << ": replays with a wrong element";
  for (auto& per_rank : graphs)
    for (cudaGraphExec_t exec : per_rank)
      if (exec != nullptr) EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
}

INSTANTIATE_TEST_SUITE_P(Path, NcclGroupGraph, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "one_shot" : "nccl"; });

}  // namespace
}  // namespace latentmoe::cuda::testing

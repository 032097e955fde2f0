// The GPU group with ranks simulated on one GPU (latentmoe/gpu_group.h): every collective against
// sums computed here in rank order, bit-identical on every rank, through many calls (the receive
// slots rotate and sizes change between calls); a rank that never arrives gives its peers a timeout
// Error within a second; an abort releases a waiting rank; and the whole layer at tp 2, 4 and 8,
// every tier, against the CPU runner.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "cuda/comm/lamport.h"
#include "cuda/comm/lamport_communicator.h"
#include "cuda/gemm/dense_push_gemm.h"
#include "cuda_test_util.h"
#include "graph_test_util.h"
#include "lamport_test_util.h"
#include "latentmoe/compare.h"
#include "latentmoe/error.h"
#include "latentmoe/gpu_group.h"
#include "latentmoe/in_process_group.h"
#include "latentmoe/local_group.h"
#include "latentmoe/presets.h"
#include "latentmoe/runner.h"
#include "latentmoe/weights.h"
#include "layer_test_util.h"

namespace latentmoe::cuda::testing {
namespace {

// One rank's device side: its own stream and tensors.
struct Rank {
  std::unique_ptr<Backend> device = detail::make_cuda_backend(0);
  cudaStream_t stream = nullptr;
  Rank() { EXPECT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess); }
  ~Rank() { cudaStreamDestroy(stream); }
};

float rounded(float value, DType dtype) {
  HostTensor one(dtype, {1});
  store_from_float(one.data(), dtype, 0, value);
  return load_as_float(one.data(), dtype, 0);
}

// One rank's device buffers for up to `rows` x `cols` (made before any rank's thread runs).
struct RankBuffers {
  DeviceTensor in, sum, shard, all;
  RankBuffers(Backend& device, DType dtype, int64_t rows, int64_t cols, int tp)
      : in(device_empty(device, dtype, {rows, cols})),
        sum(device_empty(device, dtype, {rows, cols})),
        shard(device_empty(device, dtype, {rows, cols / tp})),
        all(device_empty(device, dtype, {rows, cols})) {}
};

class GpuGroupCollectives : public ::testing::TestWithParam<std::tuple<int, DType>> {};

TEST_P(GpuGroupCollectives, match_rank_order_sums_bit_identically_over_many_calls) {
  LATENTMOE_REQUIRE_GPU();
  const auto [tp, dtype] = GetParam();
  const int64_t kCols = 24 * tp;  // every op splits it into tp column blocks
  const std::vector<int64_t> rows_per_call = {1, 3, 17, 2, 5, 1, 9};
  GpuGroupOptions options;
  options.dtype = dtype;
  options.capacity_elements = 17 * kCols;
  options.timeout = std::chrono::milliseconds(5000);
  auto group = make_simulated_gpu_group(tp, options);
  std::vector<std::unique_ptr<Rank>> ranks;
  std::vector<std::unique_ptr<RankBuffers>> buffers;
  for (int r = 0; r < tp; ++r) {
    ranks.push_back(std::make_unique<Rank>());
    buffers.push_back(std::make_unique<RankBuffers>(*ranks.back()->device, dtype, 17, kCols, tp));
  }

  for (size_t call = 0; call < rows_per_call.size(); ++call) {
    const int64_t rows = rows_per_call[call];
    SCOPED_TRACE("call " + std::to_string(call) + ", rows " + std::to_string(rows));
    std::vector<HostTensor> inputs;
    for (int r = 0; r < tp; ++r) {
      inputs.push_back(random_tensor(dtype, {rows, kCols}, static_cast<uint32_t>(1000 * call + r)));
      // A -0.0 payload must arrive (as a zero), not be taken for the sentinel.
      store_from_float(inputs.back().data(), dtype, 0, -0.0f);
    }
    std::vector<HostTensor> reduced(tp), scattered(tp), gathered(tp);
    on_rank_threads(tp, [&](int r) {
      Rank& rank = *ranks[r];
      Communicator& comm = *group[r];
      const TensorView in = buffers[r]->in.view.slice_rows(0, rows), sum = buffers[r]->sum.view.slice_rows(0, rows),
                       shard = buffers[r]->shard.view.slice_rows(0, rows),
                       all = buffers[r]->all.view.slice_rows(0, rows);
      const size_t bytes = inputs[r].nbytes();
      ASSERT_EQ(cudaMemcpyAsync(in.data(), inputs[r].data(), bytes, cudaMemcpyHostToDevice, rank.stream), cudaSuccess);
      ASSERT_EQ(cudaMemcpyAsync(sum.data(), in.data(), bytes, cudaMemcpyDeviceToDevice, rank.stream), cudaSuccess);
      comm.all_reduce_sum(sum, rank.stream);  // in place
      comm.reduce_scatter_sum(in, shard, rank.stream);
      comm.all_gather(shard, all, rank.stream);
      ASSERT_EQ(cudaStreamSynchronize(rank.stream), cudaSuccess);
      comm.check();
      reduced[r] = download(*rank.device, sum);
      scattered[r] = download(*rank.device, shard);
      gathered[r] = download(*rank.device, all);
    });
    // Rank-order fp32 sums rounded once.
    HostTensor expected(dtype, {rows, kCols});
    for (int64_t i = 0; i < rows * kCols; ++i) {
      float sum = 0.0f;
      for (int r = 0; r < tp; ++r) sum += load_as_float(inputs[r].data(), dtype, i);
      store_from_float(expected.data(), dtype, i, sum);
    }
    for (int r = 0; r < tp; ++r) {
      EXPECT_TRUE(bitwise_equal(reduced[r].view(), expected.view())) << "all-reduce, rank " << r;
      EXPECT_TRUE(bitwise_equal(gathered[r].view(), expected.view())) << "reduce-scatter + all-gather, rank " << r;
      HostTensor block(dtype, {rows, kCols / tp});
      for (int64_t t = 0; t < rows; ++t)
        for (int64_t c = 0; c < kCols / tp; ++c)
          store_from_float(block.data(), dtype, t * (kCols / tp) + c,
                           load_as_float(expected.data(), dtype, t * kCols + r * (kCols / tp) + c));
      EXPECT_TRUE(bitwise_equal(scattered[r].view(), block.view())) << "reduce-scatter, rank " << r;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(TpAndDtype, GpuGroupCollectives,
                         ::testing::Combine(::testing::Values(2, 4, 8),
                                            ::testing::Values(DType::bf16, DType::f16, DType::f32)),
                         [](const auto& info) {
                           return "tp" + std::to_string(std::get<0>(info.param)) + "_" +
                                  name_of(std::get<1>(info.param));
                         });

// Tier 0's up-projection + all-gather (Backend::up_projection_all_gather) on simulated ranks: every
// rank's out [T, d] = [block_0 | ... | block_{tp-1}], block_r = shard_r + x · W_r^T, against a host
// sum, the same bits on every rank. With the fused path (a GEMM's epilogue pushes into the peers,
// LamportCall::presend) `shard` is left as it was; with the composed one (cuBLASLt accumulating into it,
// then the all-gather) it is not: which one ran is observable. The push runs up to the token bound (64
// here) where a rule takes it: with max_latent = -1 the measured rules of sm_90 (decode_dispatch.h: the
// skinny kernel up to 8 tokens with a latent of at most 2048, the tensor-core kernel never); with
// max_latent >= 0 (set_fused_up_projection_max_latent) any latent up to it, on the skinny kernel where it
// takes the rows and on the tensor-core kernel (dense_push_gemm.h) above 8 tokens or with the skinny
// kernels off. T 17, 33, 64 and 65 cross that kernel's m-tiles (16, 32, 64 and 128 rows).
void expect_tier0_up_projection_matches(int kTp, int64_t kLatent, int64_t max_latent = -1) {
  constexpr int64_t kShard = 40;  // the shard is not a multiple of 16 rows
  constexpr int kBound = 64;
  for (DType dtype : {DType::bf16, DType::f16}) {
    GpuGroupOptions options;
    options.dtype = dtype;
    options.capacity_elements = 65 * (kShard * kTp + kLatent);
    options.timeout = std::chrono::milliseconds(5000);
    auto group = make_simulated_gpu_group(kTp, options);
    std::vector<std::unique_ptr<Rank>> ranks;
    for (int r = 0; r < kTp; ++r) ranks.push_back(std::make_unique<Rank>());
    struct Case {
      int64_t tokens;
      bool fused_on;
      bool skinny_on = true;
    };
    // Calls alternate between the paths on one group: the epochs and slots stay in step either way.
    for (const Case& c :
         {Case{1, true}, Case{5, false}, Case{8, true}, Case{3, true}, Case{9, true}, Case{2, true, false},
          Case{17, true}, Case{33, false}, Case{33, true}, Case{64, true}, Case{65, true}, Case{1, true}}) {
      const bool by_rule = c.skinny_on && c.tokens <= 8 && kLatent <= 2048;
      const bool fused = c.fused_on && c.tokens <= kBound && (max_latent >= 0 ? kLatent <= max_latent : by_rule);
      SCOPED_TRACE(name_of(dtype) + ", l " + std::to_string(kLatent) + ", T " + std::to_string(c.tokens) +
                   (fused ? ", fused" : ", composed"));
      const HostTensor x = random_tensor(dtype, {c.tokens, kLatent}, 11 + static_cast<uint32_t>(c.tokens));
      std::vector<HostTensor> weights, shards;
      for (int r = 0; r < kTp; ++r) {
        weights.push_back(random_tensor(dtype, {kShard, kLatent}, 100 + r, -0.1f, 0.1f));
        shards.push_back(random_tensor(dtype, {c.tokens, kShard}, 200 + r + static_cast<uint32_t>(c.tokens)));
      }
      std::vector<HostTensor> outs(kTp), shards_after(kTp);
      on_rank_threads(kTp, [&](int r) {
        auto& backend = dynamic_cast<CudaBackend&>(*ranks[r]->device);
        backend.set_fused_up_projection_max_tokens(c.fused_on ? kBound : 0);
        backend.set_fused_up_projection_max_latent(max_latent);
        backend.set_skinny_max_tokens(c.skinny_on ? 8 : 0);
        DeviceTensor dx = upload(backend, x), dw = upload(backend, weights[r]), dshard = upload(backend, shards[r]);
        DeviceTensor dout = poisoned(backend, dtype, {c.tokens, kShard * kTp});
        DeviceTensor before = upload(backend, x);
        backend.synchronize();
        // A collective right before, on the same stream and without a host sync, as tier 0's collective
        // comes before its up-projection: the push reads the slot the collective's epoch names.
        group[r]->all_reduce_sum(before.view, backend.stream());
        backend.up_projection_all_gather(*group[r], dx.view, dw.view, dshard.view, dout.view);
        backend.synchronize();
        group[r]->check();
        outs[r] = download(backend, dout.view);
        shards_after[r] = download(backend, dshard.view);
      });
      HostTensor expected(dtype, {c.tokens, kShard * kTp});
      for (int r = 0; r < kTp; ++r) {
        for (int64_t t = 0; t < c.tokens; ++t) {
          for (int64_t n = 0; n < kShard; ++n) {
            double sum = value_at(shards[r], t * kShard + n);
            for (int64_t k = 0; k < kLatent; ++k)
              sum += static_cast<double>(value_at(x, t * kLatent + k)) * value_at(weights[r], n * kLatent + k);
            store_from_float(expected.data(), dtype, t * kShard * kTp + r * kShard + n, static_cast<float>(sum));
          }
        }
      }
      EXPECT_LT(relative_error(outs[0], expected), tolerance(dtype));
      EXPECT_EQ(count_non_finite(outs[0]), 0);
      for (int r = 0; r < kTp; ++r) {
        EXPECT_TRUE(bitwise_equal(outs[r].view(), outs[0].view())) << "rank " << r << " differs";
        EXPECT_EQ(bitwise_equal(shards_after[r].view(), shards[r].view()), fused)
            << "rank " << r << ": the shard shows which path ran";
      }
    }
  }
}

TEST(GpuGroup, tier0_up_projection_pushes_into_the_peers_and_matches_the_composed_path) {
  LATENTMOE_REQUIRE_GPU();
  expect_tier0_up_projection_matches(4, 264);        // the rules: the skinny push up to 8 tokens
  expect_tier0_up_projection_matches(4, 264, 4096);  // past the rules: the tensor-core push above 8
}

// The same with one rank (the GEMM pushes into its own region): what compute-sanitizer runs. And a
// latent of 2056, where the rules keep the composed path, and where a latent bound of 4096 replaces them
// (the skinny push up to 8 tokens, the tensor-core push above, with split-K: 33 k-tiles, one n-tile), or
// one of 256 excludes the push (composed).
TEST(GpuGroup, a_one_rank_tier0_up_projection_pushes_into_its_own_region) {
  LATENTMOE_REQUIRE_GPU();
  expect_tier0_up_projection_matches(1, 264);
  expect_tier0_up_projection_matches(1, 2056);
  expect_tier0_up_projection_matches(1, 2056, 4096);
  expect_tier0_up_projection_matches(1, 264, 256);
  Rank rank;
  auto& backend = dynamic_cast<CudaBackend&>(*rank.device);
  EXPECT_THROW(backend.set_fused_up_projection_max_latent(-2), Error);
  EXPECT_THROW(backend.set_fused_up_projection_max_tokens(kDensePushMaxRows + 1), Error);
  EXPECT_THROW(backend.set_fused_up_projection_max_tokens(-1), Error);
}

// The pushing GEMM refuses what it cannot take, before it launches anything: f32, more rows than its
// largest tile, n or k not a multiple of 8, a missing addend, a block larger than the receive region.
TEST(GpuGroup, the_pushing_gemm_refuses_what_it_cannot_take) {
  LATENTMOE_REQUIRE_GPU();
  Rank rank;
  DeviceTensor x = device_empty(*rank.device, DType::bf16, {130, 64});
  DeviceTensor w = device_empty(*rank.device, DType::bf16, {48, 64});
  DeviceTensor shard = device_empty(*rank.device, DType::bf16, {130, 48});
  LamportPeers peers;
  peers.capacity_bytes = 4 * 48 * 2;  // four rows of the block
  const DensePushProblem good{DType::bf16, x.view.data(), 4, w.view.data(), 48, 64, shard.view.data(), 48};
  EXPECT_TRUE(dense_push_supported(good));
  auto refused = [&](DensePushProblem p, const std::string& what) {
    EXPECT_FALSE(dense_push_supported(p)) << what;
    try {
      dense_push_gemm(p, peers, nullptr, 0, rank.stream);
      ADD_FAILURE() << what << ": no Error";
    } catch (const Error& error) {
      EXPECT_NE(std::string(error.what()).find("is not supported"), std::string::npos) << error.what();
    }
  };
  DensePushProblem p = good;
  p.dtype = DType::f32;
  refused(p, "f32");
  p = good;
  p.rows = kDensePushMaxRows + 1;
  refused(p, "rows");
  p = good;
  p.n = 44;
  refused(p, "n");
  p = good;
  p.k = 60;
  refused(p, "k");
  p = good;
  p.addend = nullptr;
  refused(p, "addend");
  p = good;
  p.rows = 5;  // supported, but five rows do not fit the region
  try {
    dense_push_gemm(p, peers, nullptr, 0, rank.stream);
    ADD_FAILURE() << "a block past the region: no Error";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("does not fit the group's receive region"), std::string::npos)
        << error.what();
  }
  EXPECT_EQ(cudaStreamSynchronize(rank.stream), cudaSuccess);
}

// One rank exercises every op and the fused norm without waiting for a peer: the case that runs under
// compute-sanitizer, which serialises kernels (simulated peers would then wait for each other).
TEST(GpuGroup, a_one_rank_group_runs_every_op_and_the_fused_norm) {
  LATENTMOE_REQUIRE_GPU();
  GpuGroupOptions options;
  options.dtype = DType::bf16;
  options.capacity_elements = 5 * 200;
  auto group = make_simulated_gpu_group(1, options);
  Rank rank;
  const HostTensor input = random_tensor(DType::bf16, {5, 200}, 3);
  const HostTensor gamma = random_tensor(DType::f32, {200}, 4, 0.5f, 1.5f);
  DeviceTensor in = upload(*rank.device, input);
  DeviceTensor a = device_empty(*rank.device, DType::bf16, {5, 200}),
               b = device_empty(*rank.device, DType::bf16, {5, 200});
  for (int call = 0; call < 4; ++call) {  // more calls than slots
    group[0]->reduce_scatter_sum(in.view, a.view, rank.stream);
    group[0]->all_gather(a.view, b.view, rank.stream);
    group[0]->all_reduce_sum(b.view, rank.stream);
    group[0]->barrier(rank.stream);
  }
  ASSERT_EQ(cudaStreamSynchronize(rank.stream), cudaSuccess);
  group[0]->check();
  EXPECT_TRUE(bitwise_equal(download(*rank.device, b.view).view(), input.view()));
  expect_one_rank_fused_norm(*group[0], *rank.device, rank.stream, input, gamma);
}

// A small group for the timeout and abort tests: 1024 elements, `timeout_ms`.
GpuGroupOptions timeout_test_options(DType dtype, int timeout_ms) {
  GpuGroupOptions options;
  options.dtype = dtype;
  options.capacity_elements = 1024;
  options.timeout = std::chrono::milliseconds(timeout_ms);
  return options;
}

// The status word's three failures read back as three different Errors (no GPU needed): a rank's own
// deadline, a peer's timeout seen through the abort flag, and the host's abort.
TEST(GpuGroup, the_status_word_names_the_failure_the_op_the_peer_and_the_call) {
  auto message = [](LamportFailure failure) {
    try {
      throw_lamport_failure(lamport_status(failure, LamportOp::all_gather, 5, 70003), 2, 250);
    } catch (const Error& error) {
      return std::string(error.what());
    }
    return std::string("no Error");
  };
  const std::string own = message(LamportFailure::timeout);
  EXPECT_NE(own.find("rank 2: the GPU all-gather timed out after 250 ms waiting for rank 5's message of call 4467 "),
            std::string::npos)
      << own;  // 70003 mod 65536
  const std::string peer = message(LamportFailure::peer_timeout);
  EXPECT_NE(peer.find("rank 2: the GPU all-gather timed out: another rank of the group waited 250 ms"),
            std::string::npos)
      << peer;
  EXPECT_NE(peer.find("waiting for rank 5's message of call 4467 "), std::string::npos) << peer;
  const std::string host = message(LamportFailure::aborted);
  EXPECT_NE(host.find("rank 2: the GPU all-gather was aborted: another rank of the group failed (call 4467"),
            std::string::npos)
      << host;
  EXPECT_EQ(host.find("timed out"), std::string::npos) << host;
  EXPECT_NO_THROW(throw_lamport_failure(0, 2, 250));
}

TEST(GpuGroup, a_rank_that_never_arrives_times_out_its_peers_within_a_second) {
  LATENTMOE_REQUIRE_GPU();
  GpuGroupOptions options = timeout_test_options(DType::bf16, 200);
  options.host_rendezvous = false;  // the device-side deadline alone; one thread drives three ranks
  auto group = make_simulated_gpu_group(4, options);
  Rank ranks[3];
  std::vector<DeviceTensor> buffers;
  for (Rank& rank : ranks) buffers.push_back(device_empty(*rank.device, DType::bf16, {2, 64}));
  const auto start = std::chrono::steady_clock::now();
  // Ranks 0-2 arrive, each on its own stream; rank 3 never does.
  for (int r = 0; r < 3; ++r) group[r]->all_reduce_sum(buffers[r].view, ranks[r].stream);
  for (Rank& rank : ranks) ASSERT_EQ(cudaStreamSynchronize(rank.stream), cudaSuccess);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 1.0);
  // The first rank past its deadline reports the timeout and raises the group's abort flag; a rank
  // that looked at the flag before its own deadline reports the same timeout, seen through that flag.
  // Every waiting rank names the missing peer and the call.
  int own_deadline = 0;
  for (int r = 0; r < 3; ++r) {
    try {
      group[r]->check();
      ADD_FAILURE() << "rank " << r << " did not report the timeout";
    } catch (const Error& error) {
      const std::string text = error.what();
      EXPECT_NE(text.find("rank " + std::to_string(r) + ": the GPU all-reduce timed out"), std::string::npos) << text;
      EXPECT_NE(text.find("waiting for rank 3's message of call 0 "), std::string::npos) << text;
      EXPECT_EQ(text.find("aborted"), std::string::npos) << text;
      if (text.find("another rank of the group waited 200 ms") == std::string::npos) ++own_deadline;
    }
  }
  EXPECT_GE(own_deadline, 1);
  EXPECT_NO_THROW(group[3]->check());
}

// A timeout raises the group's abort flag, so the calls enqueued after the failed one give up at once
// instead of each waiting out the timeout: four calls behind a lost message end in about one timeout.
TEST(GpuGroup, a_timeout_releases_the_later_calls_of_the_group) {
  LATENTMOE_REQUIRE_GPU();
  GpuGroupOptions options = timeout_test_options(DType::bf16, 300);
  options.host_rendezvous = false;  // rank 1 never arrives
  auto group = make_simulated_gpu_group(2, options);
  EXPECT_EQ(group[0]->timeout(), std::chrono::milliseconds(300));  // what a host's bounded waits go by
  Rank rank;
  DeviceTensor buffer = device_empty(*rank.device, DType::bf16, {2, 64});
  const auto start = std::chrono::steady_clock::now();
  for (int call = 0; call < 4; ++call) group[0]->all_reduce_sum(buffer.view, rank.stream);
  ASSERT_EQ(cudaStreamSynchronize(rank.stream), cudaSuccess);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 0.9) << "four calls took " << seconds << " s: each waited out the 300 ms timeout";
  try {
    group[0]->check();
    ADD_FAILURE() << "no failure reported";
  } catch (const Error& error) {
    // The first failure wins: the timeout of call 0.
    EXPECT_NE(std::string(error.what()).find("timed out after 300 ms waiting for rank 1's message of call 0 "),
              std::string::npos)
        << error.what();
  }
}

TEST(GpuGroup, abort_releases_a_waiting_rank) {
  LATENTMOE_REQUIRE_GPU();
  GpuGroupOptions options = timeout_test_options(DType::f32, 20000);
  options.host_rendezvous = false;  // the device-side abort; rank 1 never launches
  auto group = make_simulated_gpu_group(2, options);
  Rank rank;
  DeviceTensor buffer = device_empty(*rank.device, DType::f32, {1, 32});
  group[0]->all_reduce_sum(buffer.view, rank.stream);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const auto start = std::chrono::steady_clock::now();
  group[1]->abort();
  ASSERT_EQ(cudaStreamSynchronize(rank.stream), cudaSuccess);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 2.0);
  try {
    group[0]->check();
    ADD_FAILURE() << "no failure reported";
  } catch (const Error& error) {
    // The host's abort, not a timeout: the flag says which.
    EXPECT_NE(
        std::string(error.what()).find("rank 0: the GPU all-reduce was aborted: another rank of the group failed"),
        std::string::npos)
        << error.what();
  }
}

// The host rendezvous (GpuGroupOptions::host_rendezvous): ranks 0 and 1 reach an all-reduce on
// threads of their own, rank 2 never does; both get the host-side timeout Error from the call itself
// within a second, nothing is enqueued, and the group stays failed. Then, in a second group, a rank
// waiting at the rendezvous is released by a peer's abort().
TEST(GpuGroup, the_host_rendezvous_times_out_and_is_released_by_abort) {
  LATENTMOE_REQUIRE_GPU();
  GpuGroupOptions options = timeout_test_options(DType::bf16, 200);
  auto group = make_simulated_gpu_group(3, options);
  Rank ranks[2];
  std::vector<DeviceTensor> buffers;
  for (Rank& rank : ranks) buffers.push_back(device_empty(*rank.device, DType::bf16, {2, 64}));
  std::string errors[2];
  const auto start = std::chrono::steady_clock::now();
  on_rank_threads(2, [&](int r) {
    try {
      group[r]->all_reduce_sum(buffers[r].view, ranks[r].stream);
    } catch (const Error& error) {
      errors[r] = error.what();
    }
  });
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 1.0);
  // The first rank past its deadline reports the timeout and breaks the group; the other reports
  // either the timeout too or, if it looked after that, the broken group.
  int timed_out = 0;
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("rank " + std::to_string(r) + ": the GPU group's all-reduce "), std::string::npos)
        << errors[r];
    const bool timeout = errors[r].find("timed out after 200 ms on the host") != std::string::npos;
    timed_out += timeout ? 1 : 0;
    EXPECT_TRUE(timeout || errors[r].find("an earlier collective of the group timed out") != std::string::npos)
        << errors[r];
    ASSERT_EQ(cudaStreamSynchronize(ranks[r].stream), cudaSuccess);
    EXPECT_NO_THROW(group[r]->check());  // nothing reached the device
  }
  EXPECT_GE(timed_out, 1);
  try {  // broken for good
    group[2]->all_reduce_sum(buffers[0].view, ranks[0].stream);
    ADD_FAILURE() << "a failed group ran a collective";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("an earlier collective of the group timed out"), std::string::npos)
        << error.what();
  }

  options.timeout = std::chrono::milliseconds(20000);
  auto second = make_simulated_gpu_group(2, options);
  std::string aborted;
  std::thread waiter([&] {
    try {
      second[0]->all_reduce_sum(buffers[0].view, ranks[0].stream);
    } catch (const Error& error) {
      aborted = error.what();
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const auto abort_start = std::chrono::steady_clock::now();
  second[1]->abort();
  waiter.join();
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - abort_start).count(), 1.0);
  EXPECT_NE(aborted.find("rank 0: the GPU group's all-reduce was aborted"), std::string::npos) << aborted;
}

TEST(GpuGroup, rejects_what_it_cannot_carry) {
  LATENTMOE_REQUIRE_GPU();
  GpuGroupOptions options;
  options.dtype = DType::bf16;
  options.capacity_elements = 64;
  auto group = make_simulated_gpu_group(2, options);
  Rank rank;
  DeviceTensor big = device_empty(*rank.device, DType::bf16, {2, 64});
  DeviceTensor f32 = device_empty(*rank.device, DType::f32, {1, 8});
  EXPECT_THROW(group[0]->all_reduce_sum(big.view, rank.stream), Error);  // over capacity
  EXPECT_THROW(group[0]->all_reduce_sum(f32.view, rank.stream), Error);  // not the group's dtype
  HostTensor host(DType::bf16, {1, 8});
  EXPECT_THROW(group[0]->all_reduce_sum(host.view(), rank.stream), Error);  // not on the device
  EXPECT_THROW(make_simulated_gpu_group(17, options), Error);
}

// The whole layer on simulated ranks, every tier, against the CPU runner at the same tp: both
// reference families at T 1, 3, 17, 64, 133, 300, and a Nemotron-shaped layer with the odd sizes of
// the real model (d 2688, l 1024, Is/tp not a multiple of 64) at T 1 and 17.
class GpuGroupLayer : public ::testing::TestWithParam<std::tuple<int, DType>> {};

void expect_every_tier_matches_the_cpu_runner(const LayerConfig& config, int tp, DType dtype,
                                              const std::vector<int64_t>& token_counts, uint64_t seed) {
  const LayerWeights weights = make_random_layer_weights(config, dtype, seed);
  for (int64_t tokens : token_counts) {
    LocalGroupInputs inputs = latentmoe::testing::random_inputs(config, tokens, dtype, seed + tokens);
    for (TailTier tier :
         {TailTier::native, TailTier::tail_fusion, TailTier::allreduce_overlap, TailTier::column_parallel}) {
      SCOPED_TRACE(std::string(to_string(config.activation)) + " d " + std::to_string(config.hidden_size) + ", tp " +
                   std::to_string(tp) + ", " + name_of(dtype) + ", T " + std::to_string(tokens) + ", " +
                   std::string(to_string(tier)));
      LocalGroupOptions options;
      options.tp_size = tp;
      options.tier = tier;
      auto shard = [&](const ParallelConfig& parallel) { return shard_layer_weights(weights, config, parallel); };
      options.backend = BackendKind::cpu;
      const auto ref = run_local_group(config, shard, inputs, options);
      options.backend = BackendKind::cuda;
      options.placement = GpuPlacement::simulated;  // this file tests simulated ranks, also on several GPUs
      std::vector<RankResult> got;
      try {
        got = run_local_group(config, shard, inputs, options);
      } catch (const Error& error) {  // reported with the trace: which tier and token count
        FAIL() << error.what();
      }
      ASSERT_EQ(got.size(), static_cast<size_t>(tp));
      for (int r = 0; r < tp; ++r) {
        EXPECT_TRUE(bitwise_equal(got[r].output.view(), got[0].output.view())) << "rank " << r << " differs";
        EXPECT_EQ(got[r].tier, tier);
      }
      EXPECT_EQ(count_non_finite(got[0].output), 0);
      EXPECT_LT(relative_error(got[0].output, ref[0].output), tolerance(dtype));
    }
  }
}

TEST_P(GpuGroupLayer, every_tier_matches_the_cpu_runner_and_ranks_agree) {
  LATENTMOE_REQUIRE_GPU();
  const auto [tp, dtype] = GetParam();
  uint64_t seed = 10 * tp;
  for (const LayerConfig& config :
       {latentmoe::testing::kimi_like_config(), latentmoe::testing::nemotron_like_config()}) {
    expect_every_tier_matches_the_cpu_runner(config, tp, dtype, {1, 3, 17, 64, 133, 300}, seed += 1000);
  }
}

INSTANTIATE_TEST_SUITE_P(TpAndDtype, GpuGroupLayer,
                         ::testing::Combine(::testing::Values(2, 4, 8),
                                            ::testing::Values(DType::bf16, DType::f16, DType::f32)),
                         [](const auto& info) {
                           return "tp" + std::to_string(std::get<0>(info.param)) + "_" +
                                  name_of(std::get<1>(info.param));
                         });

TEST(GpuGroupOddShapes, nemotron_sizes_d2688_l1024_match_the_cpu_runner_at_tp8) {
  LATENTMOE_REQUIRE_GPU();
  // d 2688 and l 1024 as in Nemotron; I 8 * 40 and Is 8 * 72: 40 and 72 per rank, not multiples of 64.
  const LayerConfig config = resized(nemotron3_super_config(), {2688, 1024, 16, 4, 320, 576});
  expect_every_tier_matches_the_cpu_runner(config, 8, DType::bf16, {1, 17}, 4242);
}

// tp 16, the largest group the Lamport kernels take (kMaxLamportRanks): 16 ranks on one GPU, one CTA
// each per collective at most SMs / 32, sizes 16 divides.
TEST(GpuGroupOddShapes, every_tier_matches_the_cpu_runner_at_tp16) {
  LATENTMOE_REQUIRE_GPU();
  const LayerConfig config = resized(kimi_k3_config(), {64, 32, 16, 4, 32, 64});
  expect_every_tier_matches_the_cpu_runner(config, 16, DType::bf16, {1, 17}, 1616);
}

// The public forward of every rank captured into a CUDA graph per tier (each rank on its own
// stream, thread-local capture), then replayed many times on the ranks' threads with new inputs
// written into the captured input buffers: every replay's output must equal the eager forward of
// the same input and tier bit for bit on every rank. The collectives' epochs live on the device, so
// a replayed graph keeps the slot rotation going.
TEST(GpuGroupGraph, tp8_forward_captured_per_tier_replays_with_new_inputs_without_a_wrong_element) {
  LATENTMOE_REQUIRE_GPU();
  constexpr int kTp = 8;
  constexpr int64_t kTokens = 5;
  constexpr int kInputs = 3;
  const int replays = [] {
    const char* value = std::getenv("LATENTMOE_TEST_GRAPH_REPLAYS");
    return value != nullptr ? std::atoi(value) : 10000;
  }();
  const DType dtype = DType::bf16;
  const LayerConfig config = latentmoe::testing::kimi_like_config();
  const LayerWeights weights = make_random_layer_weights(config, dtype, 99);
  const std::vector<TailTier> tiers = {TailTier::native, TailTier::tail_fusion, TailTier::allreduce_overlap,
                                       TailTier::column_parallel};
  const int num_tiers = static_cast<int>(tiers.size());
  const int64_t d = config.hidden_size;
  const size_t x_bytes = kTokens * d * dtype_size(dtype), out_bytes = x_bytes;

  GpuGroupOptions group_options;
  group_options.dtype = dtype;
  group_options.capacity_elements = kTokens * (config.hidden_size + config.latent_size);
  group_options.timeout = std::chrono::milliseconds(5000);
  auto group = make_simulated_gpu_group(kTp, group_options);
  // Everything device-side is made here, before any rank runs (no allocation while peers wait).
  std::vector<std::unique_ptr<Rank>> ranks;
  std::vector<std::unique_ptr<Runner>> runners;
  std::vector<DeviceTensor> xs, outs;
  for (int r = 0; r < kTp; ++r) {
    ranks.push_back(std::make_unique<Rank>());
    RunnerOptions options;
    options.backend = BackendKind::cuda;
    options.max_tokens = kTokens;
    options.device_ordinal = 0;
    runners.push_back(std::make_unique<Runner>(config, ParallelConfig{kTp, r, false},
                                               shard_layer_weights(weights, config, ParallelConfig{kTp, r, false}),
                                               *group[r], options));
    xs.push_back(device_empty(*ranks[r]->device, dtype, {kTokens, d}));
    outs.push_back(device_empty(*ranks[r]->device, dtype, {kTokens, d}));
  }
  std::vector<HostTensor> inputs;
  std::vector<std::unique_ptr<PinnedBuffer>> pinned_inputs;
  for (int i = 0; i < kInputs; ++i) {
    inputs.push_back(latentmoe::testing::random_host_tensor(dtype, {kTokens, d}, 500 + i));
    pinned_inputs.push_back(std::make_unique<PinnedBuffer>(x_bytes));
    std::memcpy(pinned_inputs.back()->data, inputs.back().data(), x_bytes);
  }
  const HostTensor logits =
      latentmoe::testing::random_host_tensor(DType::f32, {kTokens, config.num_router_outputs()}, 7, 3.0f);
  std::vector<DeviceTensor> device_logits;
  for (int r = 0; r < kTp; ++r) device_logits.push_back(upload(*ranks[r]->device, logits));
  auto forward = [&](int r, TailTier tier) {
    ForwardInputs in;
    in.hidden_states = xs[r].view;
    in.router_logits = device_logits[r].view;
    in.tier = tier;
    runners[r]->forward(in, ForwardOutputs{outs[r].view, {}, {}}, ranks[r]->stream);
  };

  // Eager references: [input][tier] on rank 0 (ranks are checked equal to it).
  std::vector<std::unique_ptr<PinnedBuffer>> eager;
  for (int i = 0; i < kInputs * num_tiers; ++i) eager.push_back(std::make_unique<PinnedBuffer>(out_bytes));
  std::vector<std::unique_ptr<PinnedBuffer>> results;
  for (int r = 0; r < kTp; ++r) results.push_back(std::make_unique<PinnedBuffer>(out_bytes));
  on_rank_threads(kTp, [&](int r) {
    for (int i = 0; i < kInputs; ++i) {
      for (int t = 0; t < num_tiers; ++t) {
        cudaStream_t stream = ranks[r]->stream;
        ASSERT_EQ(cudaMemcpyAsync(xs[r].view.data(), pinned_inputs[i]->data, x_bytes, cudaMemcpyHostToDevice, stream),
                  cudaSuccess);
        forward(r, tiers[t]);
        void* target = r == 0 ? eager[i * num_tiers + t]->data : results[r]->data;
        ASSERT_EQ(cudaMemcpyAsync(target, outs[r].view.data(), out_bytes, cudaMemcpyDeviceToHost, stream), cudaSuccess);
        ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
        group[r]->check();
      }
    }
  });
  for (int i = 0; i < kInputs * num_tiers; ++i) {
    HostTensor view(dtype, {kTokens, d});
    std::memcpy(view.data(), eager[i]->data, out_bytes);
    EXPECT_EQ(count_non_finite(view), 0);
  }

  // Capture: one graph per rank and tier (capture runs nothing, so the ranks are captured one by one).
  std::vector<std::vector<cudaGraphExec_t>> graphs(kTp, std::vector<cudaGraphExec_t>(num_tiers, nullptr));
  for (int r = 0; r < kTp; ++r) {
    for (int t = 0; t < num_tiers; ++t) {
      cudaGraph_t graph = nullptr;
      ASSERT_EQ(cudaStreamBeginCapture(ranks[r]->stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
      forward(r, tiers[t]);
      ASSERT_EQ(cudaStreamEndCapture(ranks[r]->stream, &graph), cudaSuccess);
      ASSERT_EQ(cudaGraphInstantiate(&graphs[r][t], graph, 0), cudaSuccess);
      ASSERT_EQ(cudaGraphDestroy(graph), cudaSuccess);
    }
  }

  std::vector<int> wrong(kTp, 0);
  on_rank_threads(kTp, [&](int r) {
    wrong[r] = wrong_replays(
        ranks[r]->stream, graphs[r], xs[r].view.data(), outs[r].view.data(), out_bytes, pinned_inputs, *results[r],
        [&](int i, int t) { return eager[i * num_tiers + t]->data; }, replays);
    group[r]->check();
  });
  for (int r = 0; r < kTp; ++r) EXPECT_EQ(wrong[r], 0) << "rank " << r << ": replays with a wrong element";
  for (auto& per_rank : graphs)
    for (cudaGraphExec_t exec : per_rank) EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
}

}  // namespace
}  // namespace latentmoe::cuda::testing

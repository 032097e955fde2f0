// The in-process communicator: exact results on self-describing data, bit-identical ranks, shape
// mismatches, and failures and timeouts that end in errors rather than hangs.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <system_error>
#include <thread>

#include "core/thread_start.h"
#include "latentmoe/error.h"
#include "latentmoe/in_process_group.h"
#include "latentmoe/local_group.h"
#include "latentmoe/weights.h"
#include "layer_test_util.h"

namespace latentmoe {
namespace {

// x[rank][row, col] = rank * 1000 + row * 10 + col: every sum is an exact small integer in f32.
HostTensor rank_tensor(int rank, int64_t rows, int64_t cols, DType dtype = DType::f32) {
  HostTensor tensor(dtype, {rows, cols});
  for (int64_t row = 0; row < rows; ++row) {
    for (int64_t col = 0; col < cols; ++col) {
      store_from_float(tensor.data(), dtype, row * cols + col, static_cast<float>(rank * 1000 + row * 10 + col));
    }
  }
  return tensor;
}

double expected_sum(int tp, int64_t row, int64_t col) {
  double sum = 0;
  for (int rank = 0; rank < tp; ++rank) sum += rank * 1000 + row * 10 + col;
  return sum;
}

TEST(InProcessGroup, all_reduce_reduce_scatter_all_gather_are_exact) {
  for (int tp : {1, 2, 3, 4, 8}) {
    auto group = make_in_process_group(tp);
    const int64_t rows = 3, cols = 2 * tp;
    std::vector<HostTensor> reduced(tp), scattered(tp), gathered(tp);
    run_ranks(group, [&](int rank) {
      reduced[rank] = rank_tensor(rank, rows, cols);
      group[rank]->all_reduce_sum(reduced[rank].view());
      const HostTensor input = rank_tensor(rank, rows, cols);
      scattered[rank] = HostTensor(DType::f32, {rows, 2});
      group[rank]->reduce_scatter_sum(input.view(), scattered[rank].view());
      const HostTensor shard = rank_tensor(rank, rows, 2);
      gathered[rank] = HostTensor(DType::f32, {rows, cols});
      group[rank]->all_gather(shard.view(), gathered[rank].view());
      group[rank]->barrier();
    });
    for (int rank = 0; rank < tp; ++rank) {
      for (int64_t row = 0; row < rows; ++row) {
        for (int64_t col = 0; col < cols; ++col) {
          EXPECT_EQ(reduced[rank].data_as<float>()[row * cols + col], expected_sum(tp, row, col));
          // all_gather: columns [2p, 2p+2) come from rank p's shard.
          const int peer = static_cast<int>(col / 2);
          EXPECT_EQ(gathered[rank].data_as<float>()[row * cols + col], peer * 1000 + row * 10 + col % 2);
        }
        for (int64_t col = 0; col < 2; ++col) {
          EXPECT_EQ(scattered[rank].data_as<float>()[row * 2 + col], expected_sum(tp, row, rank * 2 + col));
        }
      }
    }
  }
}

TEST(InProcessGroup, bf16_sums_round_once_and_ranks_agree_bitwise) {
  const int tp = 4;
  auto group = make_in_process_group(tp);
  std::vector<HostTensor> buffers(tp);
  run_ranks(group, [&](int rank) {
    buffers[rank] = HostTensor(DType::bf16, {1, 1});
    // 1 + 3 * 2^-9: each addend is exact in bf16 and rank 0 holds 1; rounding after every add
    // would lose the small terms (1 + 2^-9 rounds to 1), rounding once keeps them: 1 + 3*2^-9
    // rounds to 1 + 2^-7 (the nearest bf16).
    const float value = rank == 0 ? 1.0f : 0x1.0p-9f;
    store_from_float(buffers[rank].data(), DType::bf16, 0, value);
    group[rank]->all_reduce_sum(buffers[rank].view());
  });
  for (int rank = 0; rank < tp; ++rank) {
    EXPECT_EQ(bf16_to_float(buffers[rank].data_as<uint16_t>()[0]), 1.0f + 0x1.0p-7f) << rank;
  }
}

TEST(InProcessGroup, mismatched_shapes_are_errors_on_every_rank) {
  auto group = make_in_process_group(2);
  std::atomic<int> num_errors{0};
  EXPECT_THROW(run_ranks(group,
                         [&](int rank) {
                           HostTensor buffer(DType::f32, {2, rank == 0 ? 4 : 6});
                           try {
                             group[rank]->all_reduce_sum(buffer.view());
                           } catch (const Error&) {
                             ++num_errors;
                             throw;
                           }
                         }),
               Error);
  EXPECT_EQ(num_errors.load(), 2);
}

TEST(InProcessGroup, a_failing_rank_aborts_its_peers_instead_of_hanging) {
  auto group = make_in_process_group(4, {std::chrono::milliseconds(20000)});
  const auto start = std::chrono::steady_clock::now();
  try {
    run_ranks(group, [&](int rank) {
      if (rank == 2) throw Error("rank 2 failed on purpose");
      HostTensor buffer(DType::f32, {1, 4});
      group[rank]->all_reduce_sum(buffer.view());
    });
    FAIL() << "expected rank 2's error";
  } catch (const Error& error) {
    EXPECT_STREQ(error.what(), "rank 2 failed on purpose");
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  // The group stays aborted: later collectives fail at once.
  HostTensor buffer(DType::f32, {1, 4});
  EXPECT_THROW(group[0]->all_reduce_sum(buffer.view()), Error);
}

TEST(InProcessGroup, a_missing_rank_times_out_with_a_clear_error) {
  auto group = make_in_process_group(2, {std::chrono::milliseconds(100)});
  EXPECT_EQ(group[0]->timeout(), std::chrono::milliseconds(100));  // what a host's bounded waits go by
  EXPECT_EQ(group[1]->timeout(), std::chrono::milliseconds(100));
  HostTensor buffer(DType::f32, {1, 2});
  try {
    group[0]->all_reduce_sum(buffer.view());  // rank 1 never arrives
    FAIL() << "expected a timeout";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("timed out"), std::string::npos) << error.what();
  }
}

TEST(InProcessGroup, a_rank_thread_that_cannot_start_is_an_error_and_no_rank_runs) {
  // The system refuses the third thread (as at its thread limit): one clear Error, no rank runs, no
  // abort by std::terminate.
  detail::ThreadStarter previous =
      detail::set_thread_starter_for_tests([](int rank, std::function<void()> body) -> std::thread {
        if (rank == 2) throw std::system_error(std::make_error_code(std::errc::resource_unavailable_try_again));
        return std::thread(std::move(body));
      });
  auto group = make_in_process_group(4);
  std::atomic<int> ran{0};
  try {
    run_ranks(group, [&](int) { ++ran; });
    ADD_FAILURE() << "no error";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("cannot start the thread of rank 2 of 4"), std::string::npos)
        << error.what();
  }
  EXPECT_EQ(ran.load(), 0);
  // A whole layer run reports it the same way instead of hanging at its rendezvous.
  const LayerConfig config = testing::kimi_like_config();
  const LayerWeights weights = make_random_layer_weights(config, DType::f32, 3);
  LocalGroupOptions options;
  options.tp_size = 4;
  EXPECT_THROW(run_local_group(
                   config, [&](const ParallelConfig& p) { return shard_layer_weights(weights, config, p); },
                   testing::random_inputs(config, 3, DType::f32, 4), options),
               Error);
  detail::set_thread_starter_for_tests(std::move(previous));
}

TEST(InProcessGroup, invalid_arguments) {
  EXPECT_THROW(make_in_process_group(0), Error);
  auto group = make_in_process_group(2);
  HostTensor odd(DType::f32, {2, 3});
  HostTensor out(DType::f32, {2, 1});
  EXPECT_THROW(group[0]->reduce_scatter_sum(odd.view(), out.view()), Error);  // 3 columns over 2 ranks
  HostTensor ids(DType::i32, {2, 2});
  EXPECT_THROW(group[0]->all_reduce_sum(ids.view()), Error);
}

}  // namespace
}  // namespace latentmoe

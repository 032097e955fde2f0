// In-process communicator: tp ranks are threads sharing one GroupState.
//
// Protocol of every collective (all ranks call it with equal shapes):
//   1. each rank publishes a pointer to its tensor in slots[rank];
//   2. rendezvous: after it, every slot of this call is published;
//   3. each rank reads the peers' tensors it needs and computes its result into private scratch,
//      summing contributions in rank order 0..tp-1 in double (so all ranks get identical bits);
//   4. rendezvous: after it, nobody reads the published tensors any more;
//   5. each rank writes its result into its own output and returns.
// The two rendezvous make in-place all-reduce safe (nobody writes a tensor a peer still reads).
// Every rendezvous waits at most `timeout`, and abort() (called by run_ranks when a rank fails)
// wakes every waiter with an Error, so a failing rank never leaves its peers hanging.
#include "latentmoe/in_process_group.h"

#include <condition_variable>
#include <exception>
#include <mutex>
#include <string>
#include <thread>

#include "core/thread_start.h"
#include "latentmoe/error.h"

namespace latentmoe {
namespace {

struct GroupState {
  GroupState(int size, std::chrono::milliseconds timeout) : size(size), timeout(timeout), slots(size) {}

  const int size;
  const std::chrono::milliseconds timeout;
  std::mutex mutex;
  std::condition_variable arrived;
  int64_t generation = 0;
  int num_waiting = 0;
  bool aborted = false;
  std::vector<TensorView> slots;

  // Blocks until all `size` ranks have arrived at this rendezvous; throws on abort or timeout.
  void rendezvous(int rank, const char* what) {
    std::unique_lock lock(mutex);
    LATENTMOE_CHECK(!aborted, "rank ", rank, ": ", what, " aborted: another rank of the group failed");
    const int64_t my_generation = generation;
    if (++num_waiting == size) {
      num_waiting = 0;
      ++generation;
      arrived.notify_all();
      return;
    }
    const bool released = arrived.wait_for(lock, timeout, [&] { return generation != my_generation || aborted; });
    if (aborted) detail::throw_error("rank ", rank, ": ", what, " aborted: another rank of the group failed");
    if (!released) {
      aborted = true;  // the group is broken: later calls fail fast instead of waiting again
      arrived.notify_all();
      detail::throw_error("rank ", rank, ": ", what, " timed out after ", timeout.count(), " ms waiting for ",
                          size - num_waiting, " of ", size, " ranks");
    }
  }

  void abort() {
    std::lock_guard lock(mutex);
    aborted = true;
    arrived.notify_all();
  }
};

void check_host_matrix(const TensorView& tensor, const char* what) {
  LATENTMOE_CHECK(tensor.defined() && tensor.device() == Device::cpu, what, ": needs a host tensor");
  LATENTMOE_CHECK(is_compute_dtype(tensor.dtype()), what, ": unsupported dtype ", dtype_name(tensor.dtype()));
  LATENTMOE_CHECK(tensor.rank() == 2 && tensor.stride(1) == 1, what,
                  ": needs a rank-2 tensor with contiguous rows, got ", tensor.shape_string());
}

class InProcessCommunicator final : public Communicator {
 public:
  InProcessCommunicator(std::shared_ptr<GroupState> state, int rank) : state_(std::move(state)), rank_(rank) {}

  int size() const override { return state_->size; }
  int rank() const override { return rank_; }
  std::chrono::milliseconds timeout() const override { return state_->timeout; }

  void all_reduce_sum(const TensorView& buffer, StreamHandle) override {
    check_host_matrix(buffer, "all_reduce_sum");
    const int64_t cols = buffer.size(1);
    reduce_columns(buffer, 0, cols, "all_reduce_sum");
    write_scratch(buffer, cols);
  }

  void reduce_scatter_sum(const TensorView& input, const TensorView& output, StreamHandle) override {
    check_host_matrix(input, "reduce_scatter_sum input");
    check_host_matrix(output, "reduce_scatter_sum output");
    const int64_t shard = input.size(1) / size();
    LATENTMOE_CHECK(input.size(1) % size() == 0 && output.size(0) == input.size(0) && output.size(1) == shard,
                    "reduce_scatter_sum: input ", input.shape_string(), " and output ", output.shape_string(),
                    " do not match a group of ", size());
    reduce_columns(input, rank_ * shard, shard, "reduce_scatter_sum");
    write_scratch(output, shard);
  }

  void all_gather(const TensorView& input, const TensorView& output, StreamHandle) override {
    check_host_matrix(input, "all_gather input");
    check_host_matrix(output, "all_gather output");
    const int64_t shard = input.size(1);
    LATENTMOE_CHECK(
        output.size(0) == input.size(0) && output.size(1) == shard * size() && input.dtype() == output.dtype(),
        "all_gather: input ", input.shape_string(), " and output ", output.shape_string(), " do not match a group of ",
        size());
    publish(input, "all_gather");
    for (int peer = 0; peer < size(); ++peer) {
      copy_convert(state_->slots[peer], output.slice_cols(peer * shard, (peer + 1) * shard));
    }
    state_->rendezvous(rank_, "all_gather");
  }

  void barrier(StreamHandle) override { state_->rendezvous(rank_, "barrier"); }

  void abort() override { state_->abort(); }

 private:
  void publish(const TensorView& tensor, const char* what) {
    {
      std::lock_guard lock(state_->mutex);
      state_->slots[rank_] = tensor;
    }
    state_->rendezvous(rank_, what);
    for (int peer = 0; peer < size(); ++peer) {
      const TensorView& other = state_->slots[peer];
      LATENTMOE_CHECK(other.shape() == tensor.shape() && other.dtype() == tensor.dtype(), what, ": rank ", peer,
                      " passed ", other.shape_string(), " ", dtype_name(other.dtype()), " but rank ", rank_, " passed ",
                      tensor.shape_string(), " ", dtype_name(tensor.dtype()));
    }
  }

  // scratch_[row * num_cols + c] = sum over ranks (in rank order) of slot[row, first_col + c].
  void reduce_columns(const TensorView& tensor, int64_t first_col, int64_t num_cols, const char* what) {
    publish(tensor, what);
    const int64_t rows = tensor.size(0);
    scratch_.assign(static_cast<size_t>(rows * num_cols), 0.0);
    for (int peer = 0; peer < size(); ++peer) {
      const TensorView& source = state_->slots[peer];
      for (int64_t row = 0; row < rows; ++row) {
        const int64_t base = row * source.stride(0) + first_col;
        double* sum = scratch_.data() + row * num_cols;
        for (int64_t col = 0; col < num_cols; ++col)
          sum[col] += load_as_float(source.data(), source.dtype(), base + col);
      }
    }
    // Peers may overwrite their tensors only after everybody has read them.
    state_->rendezvous(rank_, what);
  }

  void write_scratch(const TensorView& target, int64_t num_cols) {
    for (int64_t row = 0; row < target.size(0); ++row) {
      for (int64_t col = 0; col < num_cols; ++col) {
        store_from_float(target.data(), target.dtype(), row * target.stride(0) + col,
                         static_cast<float>(scratch_[row * num_cols + col]));
      }
    }
  }

  std::shared_ptr<GroupState> state_;
  int rank_;
  std::vector<double> scratch_;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_in_process_group(int tp_size, InProcessGroupOptions options) {
  LATENTMOE_CHECK(tp_size >= 1, "tp size must be at least 1, got ", tp_size);
  LATENTMOE_CHECK(options.timeout.count() > 0, "collective timeout must be positive");
  auto state = std::make_shared<GroupState>(tp_size, options.timeout);
  std::vector<std::unique_ptr<Communicator>> group;
  for (int rank = 0; rank < tp_size; ++rank) group.push_back(std::make_unique<InProcessCommunicator>(state, rank));
  return group;
}

namespace detail {
namespace {
ThreadStarter& thread_starter() {
  static ThreadStarter starter;
  return starter;
}
}  // namespace

ThreadStarter set_thread_starter_for_tests(ThreadStarter starter) {
  ThreadStarter previous = std::move(thread_starter());
  thread_starter() = std::move(starter);
  return previous;
}
}  // namespace detail

void run_ranks(std::vector<std::unique_ptr<Communicator>>& group, const std::function<void(int rank)>& body) {
  const int size = static_cast<int>(group.size());
  std::vector<std::exception_ptr> failures(size);
  std::mutex first_failure_mutex;
  int first_failure = -1;
  auto run_one = [&](int rank) {
    try {
      body(rank);
    } catch (...) {
      failures[rank] = std::current_exception();
      {
        std::lock_guard lock(first_failure_mutex);
        if (first_failure < 0) first_failure = rank;
      }
      group[rank]->abort();
    }
  };
  if (size == 1) {
    run_one(0);
  } else {
    // Every rank's thread exists before any rank runs: a rank whose thread cannot be created (the
    // system's thread limit) must not leave its peers waiting for it in a collective or at a
    // rendezvous. The started threads wait for `go`; on a failure they return without running.
    std::mutex start_mutex;
    std::condition_variable start_signal;
    bool go = false, cancelled = false;
    auto wait_then_run = [&](int rank) {
      {
        std::unique_lock lock(start_mutex);
        start_signal.wait(lock, [&] { return go || cancelled; });
        if (cancelled) return;
      }
      run_one(rank);
    };
    std::vector<std::thread> threads;
    threads.reserve(size);
    std::string start_failure;
    for (int rank = 0; rank < size && start_failure.empty(); ++rank) {
      try {
        const detail::ThreadStarter& starter = detail::thread_starter();
        threads.push_back(starter ? starter(rank, [&wait_then_run, rank] { wait_then_run(rank); })
                                  : std::thread(wait_then_run, rank));
      } catch (const std::exception& error) {
        start_failure = "cannot start the thread of rank " + std::to_string(rank) + " of " + std::to_string(size) +
                        ": " + error.what();
      }
    }
    {
      std::lock_guard lock(start_mutex);
      (start_failure.empty() ? go : cancelled) = true;
    }
    start_signal.notify_all();
    for (auto& thread : threads) thread.join();
    if (!start_failure.empty()) throw Error(start_failure);
  }
  if (first_failure >= 0) std::rethrow_exception(failures[first_failure]);
}

}  // namespace latentmoe

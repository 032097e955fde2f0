// make_simulated_gpu_group (latentmoe/gpu_group.h): tp ranks on one GPU exchanging through the
// Lamport kernels of lamport.cu. The group's memory (receive areas, per-rank device words, the
// host-mapped abort flag and error words) is owned by one shared object that lives as long as any of
// the ranks' communicators.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include "core/settings.h"
#include "cuda/comm/lamport.h"
#include "cuda/comm/lamport_call.h"
#include "cuda/comm/lamport_communicator.h"
#include "cuda/common/cuda_check.h"
#include "cuda/common/device.h"
#include "latentmoe/error.h"
#include "latentmoe/gpu_group.h"

namespace latentmoe {
namespace {

using cuda::LamportCall;
using cuda::LamportOp;
using cuda::LamportPeers;

constexpr int kStateWords = 8;

// The host side of keeping simulated ranks in step (GpuGroupOptions::host_rendezvous): a reusable
// spinning barrier with a deadline. The last rank to arrive resets the count and then advances the
// generation (release); a waiter leaves once it sees the generation change (acquire), so its next
// arrival counts towards the next round. A timeout breaks it for good: the group is not reused.
class HostRendezvous {
 public:
  // Returns once all `size` ranks have arrived; throws Error naming `rank` and `what` after `timeout`,
  // when the group was aborted (*abort_flag) or broken by an earlier timeout.
  void arrive_and_wait(int size, int rank, std::chrono::milliseconds timeout, const volatile int* abort_flag,
                       const char* what) {
    check_usable(rank, abort_flag, what);
    const uint64_t generation = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == size) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
      return;
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (uint32_t spin = 1; generation_.load(std::memory_order_acquire) == generation; ++spin) {
      if (spin % 64 != 0) continue;
      check_usable(rank, abort_flag, what);
      if (std::chrono::steady_clock::now() > deadline) {
        broken_.store(true, std::memory_order_release);
        latentmoe::detail::throw_error("rank ", rank, ": the GPU group's ", what, " timed out after ", timeout.count(),
                                       " ms on the host waiting for its peers (a rank never arrived)");
      }
      std::this_thread::yield();
    }
  }

 private:
  void check_usable(int rank, const volatile int* abort_flag, const char* what) const {
    LATENTMOE_CHECK(*abort_flag == 0, "rank ", rank, ": the GPU group's ", what, " was aborted (a peer failed)");
    LATENTMOE_CHECK(!broken_.load(std::memory_order_acquire), "rank ", rank, ": the GPU group's ", what,
                    " cannot run: an earlier collective of the group timed out");
  }

  std::atomic<int> arrived_{0};
  std::atomic<uint64_t> generation_{0};
  std::atomic<bool> broken_{false};
};

struct GroupMemory {
  int device = 0;
  int size = 0;
  DType dtype = DType::bf16;
  int64_t capacity_bytes = 0;
  uint64_t timeout_ns = 0;
  std::array<void*, cuda::kMaxLamportRanks> recv{};
  uint32_t* state = nullptr;     // [size][kStateWords]
  void* barrier_data = nullptr;  // [size][16 bytes]: the payload of barrier()
  int* host_flags = nullptr;     // host-mapped: [0] abort, [1 + r] rank r's status
  int* device_flags = nullptr;   // the same memory as the device sees it
  bool host_rendezvous = true;
  HostRendezvous rendezvous;

  ~GroupMemory() {
    cuda::DeviceGuard guard(device);
    (void)cudaDeviceSynchronize();  // no kernel of the group may still run
    for (void* area : recv)
      if (area != nullptr) (void)cudaFree(area);
    if (state != nullptr) (void)cudaFree(state);
    if (barrier_data != nullptr) (void)cudaFree(barrier_data);
    if (host_flags != nullptr) (void)cudaFreeHost(host_flags);
  }
};

class SimulatedGpuCommunicator final : public cuda::LamportCommunicator {
 public:
  SimulatedGpuCommunicator(std::shared_ptr<GroupMemory> memory, int rank) : memory_(std::move(memory)), rank_(rank) {
    const GroupMemory& m = *memory_;
    peers_.rank = rank;
    peers_.size = m.size;
    for (int r = 0; r < m.size; ++r) peers_.recv[r] = m.recv[r];
    peers_.capacity_bytes = m.capacity_bytes;
    peers_.state = m.state + rank * kStateWords;
    peers_.abort = m.device_flags;
    peers_.status = m.device_flags + 1 + rank;
    peers_.timeout_ns = m.timeout_ns;
    peers_.ranks_per_gpu = m.size;
  }

  int size() const override { return memory_->size; }
  int rank() const override { return rank_; }

  void all_reduce_sum(const TensorView& buffer, StreamHandle stream) override {
    check_whole(LamportOp::all_reduce, buffer, "all-reduce buffer");
    enqueue(cuda::make_lamport_call(LamportOp::all_reduce, buffer, buffer), stream);
  }

  void reduce_scatter_sum(const TensorView& input, const TensorView& output, StreamHandle stream) override {
    check_whole(LamportOp::reduce_scatter, input, "reduce-scatter input");
    check_shard(output, input, "reduce-scatter output");
    enqueue(cuda::make_lamport_call(LamportOp::reduce_scatter, input, output), stream);
  }

  void all_gather(const TensorView& input, const TensorView& output, StreamHandle stream) override {
    check_whole(LamportOp::all_gather, output, "all-gather output");
    check_shard(input, output, "all-gather input");
    enqueue(cuda::make_lamport_call(LamportOp::all_gather, input, output), stream);
  }

  void barrier(StreamHandle stream) override {
    LamportCall call;
    call.op = LamportOp::barrier;
    call.dtype = memory_->dtype;
    call.in = static_cast<char*>(memory_->barrier_data) + 16 * rank_;
    call.rows = 1;
    call.cols = 16 / static_cast<int64_t>(dtype_size(memory_->dtype));
    call.ld_in = call.cols;
    enqueue(call, stream);
  }

  void abort() override {
    // Host-mapped: every spinning kernel of the group sees it without any stream operation.
    reinterpret_cast<volatile int*>(memory_->host_flags)[0] = cuda::kAbortByHost;
  }

  void check() override {
    const int status = reinterpret_cast<volatile int*>(memory_->host_flags)[1 + rank_];
    cuda::throw_lamport_failure(status, rank_, memory_->timeout_ns / 1000000);
  }

  const LamportPeers& lamport_peers() const override { return peers_; }
  DType lamport_dtype() const override { return memory_->dtype; }

 private:
  static int64_t rows_of(const TensorView& view) { return view.rank() == 2 ? view.size(0) : 1; }
  static int64_t cols_of(const TensorView& view) { return view.rank() == 2 ? view.size(1) : view.numel(); }

  // The collective's whole side: a rank-1 or rank-2 device tensor of the group's dtype with a contiguous
  // last dimension, whose columns split into the ranks' blocks (but for an all-reduce).
  void check_whole(LamportOp op, const TensorView& view, const char* what) const {
    check_view(view, what);
    LATENTMOE_CHECK(op == LamportOp::all_reduce || cols_of(view) % memory_->size == 0, "rank ", rank_, ": ", what, " ",
                    view.shape_string(), " does not split into ", memory_->size, " column blocks");
  }

  void check_view(const TensorView& view, const char* what) const {
    LATENTMOE_CHECK(view.defined() && view.device() == Device::cuda, "rank ", rank_, ": the GPU group's ", what,
                    " must be a device tensor");
    LATENTMOE_CHECK(view.dtype() == memory_->dtype, "rank ", rank_, ": the GPU group's ", what, " has dtype ",
                    dtype_name(view.dtype()), " but the group was built for ", dtype_name(memory_->dtype));
    LATENTMOE_CHECK(view.rank() <= 2 && (view.rank() == 1 || view.stride(1) == 1), "rank ", rank_, ": the GPU group's ",
                    what, " must be rank 1 or 2 with a contiguous last dimension");
  }

  void check_shard(const TensorView& shard, const TensorView& whole, const char* what) const {
    check_view(shard, what);
    const int64_t rows = rows_of(whole), cols = cols_of(whole);
    LATENTMOE_CHECK(rows_of(shard) == rows && cols_of(shard) * memory_->size == cols, "rank ", rank_,
                    ": the GPU group's ", what, " ", shard.shape_string(), " is not a 1/", memory_->size,
                    " column block of [", rows, ", ", cols, "]");
  }

  void enqueue(const LamportCall& call, StreamHandle stream) {
    cuda::DeviceGuard guard(memory_->device);
    launch(call, static_cast<cudaStream_t>(stream));
  }

 public:
  // Every rank enqueues its kernel between two rendezvous: when any rank's kernel starts spinning,
  // every rank has finished the host work before it (no driver call of a peer can wait for it), and
  // no rank goes on to such work before every rank's kernel is enqueued (so each will complete).
  void launch(const LamportCall& call, cudaStream_t stream) override {
    cuda::check_lamport_call(peers_, call);  // a call that cannot run fails here, not at the rendezvous
    const bool rendezvous = memory_->host_rendezvous && memory_->size > 1 && !capturing(stream);
    const char* what = cuda::lamport_op_name(call.op);
    const auto timeout = std::chrono::milliseconds(memory_->timeout_ns / 1000000);
    const volatile int* abort_flag = memory_->host_flags;
    if (rendezvous) memory_->rendezvous.arrive_and_wait(memory_->size, rank_, timeout, abort_flag, what);
    cuda::launch_lamport(peers_, call, stream);
    if (rendezvous) memory_->rendezvous.arrive_and_wait(memory_->size, rank_, timeout, abort_flag, what);
  }

 private:
  static bool capturing(cudaStream_t stream) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    LATENTMOE_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
    return status != cudaStreamCaptureStatusNone;
  }

  std::shared_ptr<GroupMemory> memory_;
  int rank_;
  LamportPeers peers_;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_simulated_gpu_group(int tp_size, const GpuGroupOptions& options) {
  LATENTMOE_CHECK(tp_size >= 1 && tp_size <= cuda::kMaxLamportRanks, "GPU group: tp ", tp_size, " is outside 1..",
                  cuda::kMaxLamportRanks);
  LATENTMOE_CHECK(options.capacity_elements >= 1, "GPU group: capacity_elements must be at least 1, got ",
                  options.capacity_elements);
  LATENTMOE_CHECK(is_compute_dtype(options.dtype), "GPU group: dtype ", dtype_name(options.dtype),
                  " is not F32, BF16 or F16");
  LATENTMOE_CHECK(options.timeout.count() > 0, "GPU group: the timeout must be positive");
  const int num_devices = cuda::cuda_device_count();
  LATENTMOE_CHECK(options.device >= 0 && options.device < num_devices, "GPU group: CUDA device ", options.device,
                  " does not exist (", num_devices, " found)");

  // Streams share CUDA_DEVICE_MAX_CONNECTIONS hardware queues (8 by default, 32 at most); two streams
  // on one queue run in order. A rank's spinning collective would then hold back a peer's kernel
  // queued behind it (seen on the H200: tp 8 with the default 8 hung until the timeout). Each rank
  // has two streams; ask for twice that many queues, all 32 from tp 8 on.
  if (tp_size > 1) {
    const int64_t connections = detail::integer_setting(detail::Setting::cuda_device_max_connections);
    const int needed = std::min(32, 4 * tp_size);
    LATENTMOE_CHECK(connections >= needed, "GPU group: ", tp_size, " ranks simulated on one GPU need ",
                    "CUDA_DEVICE_MAX_CONNECTIONS >= ", needed, " (it is ", connections,
                    "): each rank's streams need hardware queues of their own, or a rank's waiting collective "
                    "blocks a peer's kernels; set it before the process first calls CUDA (the latentmoe tool does)");
  }
  auto memory = std::make_shared<GroupMemory>();
  GroupMemory& m = *memory;
  m.device = options.device;
  m.size = tp_size;
  m.dtype = options.dtype;
  m.capacity_bytes = (options.capacity_elements * static_cast<int64_t>(dtype_size(options.dtype)) + 15) / 16 * 16;
  m.timeout_ns = static_cast<uint64_t>(options.timeout.count()) * 1000000ull;
  m.host_rendezvous = options.host_rendezvous;
  cuda::DeviceGuard guard(options.device);
  const size_t area_bytes = static_cast<size_t>(cuda::kLamportSlots) * tp_size * m.capacity_bytes;
  for (int r = 0; r < tp_size; ++r) {
    LATENTMOE_CUDA_CHECK(cudaMalloc(&m.recv[r], area_bytes));
    cuda::lamport_fill_sentinel(m.recv[r], area_bytes, options.dtype, nullptr);
  }
  LATENTMOE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&m.state), sizeof(uint32_t) * kStateWords * tp_size));
  LATENTMOE_CUDA_CHECK(cudaMemset(m.state, 0, sizeof(uint32_t) * kStateWords * tp_size));
  LATENTMOE_CUDA_CHECK(cudaMalloc(&m.barrier_data, 16 * static_cast<size_t>(tp_size)));
  LATENTMOE_CUDA_CHECK(cudaMemset(m.barrier_data, 0, 16 * static_cast<size_t>(tp_size)));
  LATENTMOE_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&m.host_flags), sizeof(int) * (1 + tp_size),
                                     cudaHostAllocMapped | cudaHostAllocPortable));
  std::memset(m.host_flags, 0, sizeof(int) * (1 + tp_size));
  LATENTMOE_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&m.device_flags), m.host_flags, 0));
  LATENTMOE_CUDA_CHECK(cudaDeviceSynchronize());

  std::vector<std::unique_ptr<Communicator>> group;
  for (int r = 0; r < tp_size; ++r) group.push_back(std::make_unique<SimulatedGpuCommunicator>(memory, r));
  return group;
}

}  // namespace latentmoe

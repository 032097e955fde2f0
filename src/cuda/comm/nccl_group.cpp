// GPU groups on real GPUs through NCCL (latentmoe/gpu_group.h, latentmoe/nccl_group.h): one thread per GPU
// (make_nccl_gpu_group, the library creates the communicators) and one process per GPU
// (make_nccl_communicator, the caller's ncclComm_t), built by the same code.
//
// Building a rank, in collective phases that every rank runs in the same order (from one thread over all
// local ranks inside ncclGroupStart/End, or one rank per process):
//   1. agree on the one-shot path: every rank's LSA team must hold the whole group (ncclAllReduce, min);
//   2. one-shot: allocate the receive area with ncclMemAlloc, fill it with the sentinel, register it as a
//      symmetric window (ncclCommWindowRegister, NCCL_WIN_COLL_SYMMETRIC) and read every peer's pointer
//      once through NCCL's device API (nccl_window.cu) into LamportPeers; all before any capture, alive as
//      long as the communicator;
//   3. the NCCL path's staging buffer when a message may exceed the one-shot capacity (or every message
//      goes through NCCL).
// Each collective then runs one-shot when one_shot() and its message fits, else through NCCL, with
// latentmoe's column-block shards packed into NCCL's contiguous chunks around reduce-scatter and
// all-gather (core/shard_layout.h). Every rank takes the same decision (same shapes), so the ranks'
// sequences of NCCL calls match.
#include "core/nccl_checks.h"
#include "latentmoe/error.h"
#include "latentmoe/gpu_group.h"

#if defined(LATENTMOE_WITH_NCCL)
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <nccl.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <thread>

#include "core/nccl_checks.h"
#include "cuda/comm/lamport.h"
#include "cuda/comm/lamport_call.h"
#include "cuda/comm/lamport_communicator.h"
#include "cuda/comm/nccl_check.h"
#include "cuda/comm/nccl_window.h"
#include "cuda/comm/shard_pack.h"
#include "cuda/common/cuda_check.h"
#include "cuda/common/device.h"
#include "latentmoe/error.h"
#include "latentmoe/nccl_group.h"

namespace latentmoe {
namespace {

using cuda::LamportCall;
using cuda::LamportOp;
using cuda::LamportPeers;

constexpr int kStateWords = 8;  // LamportPeers::state: epoch, arrivals (the rest spare)

ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return ncclFloat32;
    case DType::bf16:
      return ncclBfloat16;
    case DType::f16:
      return ncclFloat16;
    default:
      detail::throw_error("NCCL group: dtype ", dtype_name(dtype), " is not F32, BF16 or F16");
  }
}

// The start-up checks every NCCL group makes before its first NCCL call that could start NCCL.
void check_environment() {
  detail::require_nvls_off();
  int loaded = 0;
  LATENTMOE_NCCL_CHECK(nullptr, ncclGetVersion(&loaded));
  if (auto mismatch = detail::nccl_version_mismatch(loaded, NCCL_VERSION_CODE))
    throw Error(*mismatch);  // the library's own message, whole
}

void check_options(int tp_size, const GpuGroupOptions& options) {
  LATENTMOE_CHECK(tp_size >= 1 && tp_size <= cuda::kMaxLamportRanks, "NCCL group: tp ", tp_size, " is outside 1..",
                  cuda::kMaxLamportRanks);
  LATENTMOE_CHECK(options.capacity_elements >= 1, "NCCL group: capacity_elements must be at least 1, got ",
                  options.capacity_elements);
  LATENTMOE_CHECK(options.max_elements >= 0, "NCCL group: max_elements must not be negative, got ",
                  options.max_elements);
  LATENTMOE_CHECK(is_compute_dtype(options.dtype), "NCCL group: dtype ", dtype_name(options.dtype),
                  " is not F32, BF16 or F16");
  LATENTMOE_CHECK(options.timeout.count() > 0, "NCCL group: the timeout must be positive");
}

// One rank's NCCL resources.
struct RankResources {
  int rank = 0;
  int device = 0;
  ncclComm_t comm = nullptr;
  bool owns_comm = false;
  cudaStream_t setup_stream = nullptr;  // construction and teardown only
  void* window_memory = nullptr;        // ncclMemAlloc: the receive area (kLamportSlots x size x capacity)
  size_t window_bytes = 0;
  ncclWindow_t window = nullptr;
  std::vector<void*> peer_recv;  // every rank's receive area as this rank reaches it
  uint32_t* state = nullptr;     // kStateWords device words
  void* scratch = nullptr;       // 16 device bytes: the barrier's payload
  void* staging = nullptr;       // fallback_elements elements (the NCCL path), or nullptr
};

// The memory of a group: its ranks in this process, the host-mapped abort flag and error words.
struct GroupState {
  int size = 0;
  DType dtype = DType::bf16;
  int64_t capacity_bytes = 0;
  int64_t fallback_elements = 0;
  uint64_t timeout_ns = 0;
  bool one_shot = false;
  std::vector<RankResources> ranks;  // the ranks in this process
  int* host_flags = nullptr;         // host-mapped: [0] abort, [1 + i] local rank i's error word
  int* device_flags = nullptr;
  std::atomic<bool> revoked{false};

  ~GroupState() { tear_down(); }

  // Every local rank on a thread of its own: deregistering a window and finalising a communicator are
  // collective, so the ranks of one process must do them concurrently.
  void tear_down() noexcept {
    const bool aborted = revoked.load();
    auto release = [aborted](RankResources& r) {
      if (cudaSetDevice(r.device) != cudaSuccess) return;
      if (aborted) {
        // No collective after a failure: abort an owned communicator first (it stops NCCL's kernels that
        // still wait for a peer, so that the synchronisation below ends, and drops its windows), then
        // free the memory; a caller's communicator (revoked by abort()) keeps its window registered.
        if (r.owns_comm && r.comm != nullptr) (void)ncclCommAbort(r.comm);
        (void)cudaDeviceSynchronize();  // no kernel of the group may still run
        if (r.window_memory != nullptr && r.owns_comm) (void)ncclMemFree(r.window_memory);
      } else {
        (void)cudaDeviceSynchronize();  // no kernel of the group may still run
        if (r.window != nullptr) (void)ncclCommWindowDeregister(r.comm, r.window);
        if (r.window_memory != nullptr) (void)ncclMemFree(r.window_memory);
        if (r.owns_comm && r.comm != nullptr) {
          (void)ncclCommFinalize(r.comm);
          (void)ncclCommDestroy(r.comm);
        }
      }
      if (r.state != nullptr) (void)cudaFree(r.state);
      if (r.scratch != nullptr) (void)cudaFree(r.scratch);
      if (r.staging != nullptr) (void)cudaFree(r.staging);
      if (r.setup_stream != nullptr) (void)cudaStreamDestroy(r.setup_stream);
    };
    if (ranks.size() == 1) {
      release(ranks[0]);
    } else {
      std::vector<std::thread> threads;
      for (RankResources& r : ranks) {
        try {
          threads.emplace_back(release, std::ref(r));
        } catch (...) {
          release(r);
        }
      }
      for (std::thread& thread : threads) thread.join();
    }
    ranks.clear();
    if (host_flags != nullptr) (void)cudaFreeHost(host_flags);
    host_flags = nullptr;
  }

  // Releases every wait: the one-shot kernels see the host-mapped flag; NCCL's own collectives are
  // stopped by ncclCommRevoke. It is looked up at run time so that the library still loads against an
  // older libnccl (without it); a group exists only when the loaded libnccl is the release latentmoe was
  // built against (the version check), which CMake requires to be 2.28.7 or newer, so it is found. Should
  // a revoke fail, one line on stderr says that NCCL's collectives may keep waiting.
  void abort() noexcept {
    if (host_flags != nullptr) reinterpret_cast<volatile int*>(host_flags)[0] = cuda::kAbortByHost;
    if (revoked.exchange(true)) return;
    using Revoke = ncclResult_t (*)(ncclComm_t, int);
    auto revoke = reinterpret_cast<Revoke>(dlsym(RTLD_DEFAULT, "ncclCommRevoke"));
    for (RankResources& r : ranks) {
      if (r.comm == nullptr) continue;
      const ncclResult_t result = revoke != nullptr ? revoke(r.comm, 0) : ncclInvalidUsage;
      if (result != ncclSuccess && result != ncclInProgress) {
        std::fprintf(stderr,
                     "latentmoe: rank %d: could not revoke its NCCL communicator (%s); NCCL collectives in flight "
                     "may keep waiting\n",
                     r.rank, revoke != nullptr ? ncclGetErrorString(result) : "ncclCommRevoke not found");
      }
    }
  }
};

// Runs `step(i)` for every local rank i with rank i's device current; the NCCL calls of all local ranks
// inside one ncclGroupStart/End when `grouped` (collectives of several ranks from one thread).
template <class Step>
void for_each_rank(GroupState& g, bool grouped, Step&& step) {
  if (grouped) LATENTMOE_NCCL_CHECK(nullptr, ncclGroupStart());
  try {
    for (size_t i = 0; i < g.ranks.size(); ++i) {
      cuda::DeviceGuard guard(g.ranks[i].device);
      step(g.ranks[i]);
    }
  } catch (...) {
    if (grouped) (void)ncclGroupEnd();
    throw;
  }
  if (grouped) LATENTMOE_NCCL_CHECK(g.ranks.front().comm, ncclGroupEnd());
}

// The collective phases of building the group (see the top of this file); every rank of the group runs
// them in the same order. On an exception the caller marks the group failed (teardown without
// collectives).
void build(GroupState& g, const GpuGroupOptions& options) {
  const bool grouped = g.ranks.size() > 1;
  const int size = g.size;
  g.dtype = options.dtype;
  g.capacity_bytes = (options.capacity_elements * static_cast<int64_t>(dtype_size(options.dtype)) + 15) / 16 * 16;
  g.timeout_ns = static_cast<uint64_t>(options.timeout.count()) * 1000000ull;
  {
    cuda::DeviceGuard guard(g.ranks.front().device);
    const size_t flag_bytes = sizeof(int) * (1 + g.ranks.size());
    LATENTMOE_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&g.host_flags), flag_bytes,
                                       cudaHostAllocMapped | cudaHostAllocPortable));
    std::memset(g.host_flags, 0, flag_bytes);
    LATENTMOE_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&g.device_flags), g.host_flags, 0));
  }
  for_each_rank(g, false, [&](RankResources& r) {
    LATENTMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&r.setup_stream, cudaStreamNonBlocking));
    LATENTMOE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&r.state), sizeof(uint32_t) * kStateWords));
    LATENTMOE_CUDA_CHECK(cudaMemset(r.state, 0, sizeof(uint32_t) * kStateWords));
    LATENTMOE_CUDA_CHECK(cudaMalloc(&r.scratch, 16));
  });

  // 1. The one-shot path only if every rank can load and store every peer's memory, agreed by all ranks
  // (a window is registered by all ranks or by none).
  std::vector<int> reachable(g.ranks.size(), 0);
  int lsa_size = size;
  for (size_t i = 0; i < g.ranks.size(); ++i) {
    RankResources& r = g.ranks[i];
    cuda::DeviceGuard guard(r.device);
    const int team = cuda::lsa_team_size(r.comm);
    lsa_size = std::min(lsa_size, team);
    reachable[i] = options.one_shot && team == size ? 1 : 0;
    LATENTMOE_CUDA_CHECK(cudaMemcpy(r.scratch, &reachable[i], sizeof(int), cudaMemcpyHostToDevice));
  }
  for_each_rank(g, grouped, [&](RankResources& r) {
    LATENTMOE_NCCL_CHECK(r.comm, ncclAllReduce(r.scratch, r.scratch, 1, ncclInt32, ncclMin, r.comm, r.setup_stream));
  });
  for (size_t i = 0; i < g.ranks.size(); ++i) {
    RankResources& r = g.ranks[i];
    cuda::DeviceGuard guard(r.device);
    LATENTMOE_CUDA_CHECK(cudaStreamSynchronize(r.setup_stream));
    LATENTMOE_CUDA_CHECK(cudaMemcpy(&reachable[i], r.scratch, sizeof(int), cudaMemcpyDeviceToHost));
    LATENTMOE_CUDA_CHECK(cudaMemset(r.scratch, 0, 16));
  }
  g.one_shot = reachable.front() == 1;
  if (options.one_shot && !g.one_shot && g.ranks.front().rank == 0) {
    std::fprintf(stderr,
                 "latentmoe: NCCL group of %d ranks: not every rank can load and store its peers' memory (load/store "
                 "team of %d here); collectives go through NCCL, the fused tail tiers are not offered\n",
                 size, lsa_size);
  }

  // 2. The receive areas: NCCL memory registered as one symmetric window; each peer's pointer read once.
  if (g.one_shot) {
    const size_t area = static_cast<size_t>(cuda::kLamportSlots) * size * static_cast<size_t>(g.capacity_bytes);
    const size_t align = NCCL_WIN_REQUIRED_ALIGNMENT;
    for_each_rank(g, false, [&](RankResources& r) {
      r.window_bytes = (area + align - 1) / align * align;
      LATENTMOE_NCCL_CHECK(r.comm, ncclMemAlloc(&r.window_memory, r.window_bytes));
      cuda::lamport_fill_sentinel(r.window_memory, r.window_bytes, g.dtype, r.setup_stream);
      LATENTMOE_CUDA_CHECK(cudaStreamSynchronize(r.setup_stream));
    });
    for_each_rank(g, grouped, [&](RankResources& r) {
      LATENTMOE_NCCL_CHECK(
          r.comm, ncclCommWindowRegister(r.comm, r.window_memory, r.window_bytes, &r.window, NCCL_WIN_COLL_SYMMETRIC));
    });
    for_each_rank(g, false, [&](RankResources& r) {
      LATENTMOE_CHECK(r.window != nullptr, "rank ", r.rank, ": NCCL registered no window for the receive area");
      std::vector<void*> pointers = cuda::read_window_peer_pointers(r.window, size, r.setup_stream);
      for (int peer = 0; peer < size; ++peer)
        LATENTMOE_CHECK(pointers[peer] != nullptr, "rank ", r.rank, ": NCCL gave no load/store pointer to rank ", peer,
                        "'s window");
      LATENTMOE_CHECK(pointers[r.rank] == pointers[size], "rank ", r.rank,
                      ": NCCL's pointer to this rank's own window differs from its local pointer");
      pointers.resize(size);
      r.peer_recv = std::move(pointers);
    });
  }

  // 3. The NCCL path's staging buffer (above the one-shot capacity, or every message without it).
  if (!g.one_shot || options.max_elements > options.capacity_elements) {
    g.fallback_elements = std::max(options.max_elements, options.capacity_elements);
    for_each_rank(g, false, [&](RankResources& r) {
      LATENTMOE_CUDA_CHECK(
          cudaMalloc(&r.staging, static_cast<size_t>(g.fallback_elements) * dtype_size(options.dtype)));
    });
  }
  for_each_rank(g, false, [&](RankResources&) { LATENTMOE_CUDA_CHECK(cudaDeviceSynchronize()); });
}

// rows x cols and the row stride of a rank-1 or rank-2 tensor with a contiguous last dimension.
struct Shape2 {
  int64_t rows = 0, cols = 0, ld = 0;
};

class NcclCommunicator final : public cuda::LamportCommunicator {
 public:
  NcclCommunicator(std::shared_ptr<GroupState> group, size_t index) : group_(std::move(group)), index_(index) {
    const GroupState& g = *group_;
    const RankResources& r = g.ranks[index_];
    peers_.rank = r.rank;
    peers_.size = g.size;
    for (int p = 0; p < static_cast<int>(r.peer_recv.size()); ++p) peers_.recv[p] = r.peer_recv[p];
    peers_.capacity_bytes = g.one_shot ? g.capacity_bytes : 0;
    peers_.state = r.state;
    peers_.abort = g.device_flags;
    peers_.status = g.device_flags + 1 + index_;
    peers_.timeout_ns = g.timeout_ns;
  }

  int size() const override { return group_->size; }
  int rank() const override { return peers_.rank; }

  void all_reduce_sum(const TensorView& buffer, StreamHandle stream) override {
    const Shape2 s = shape_of(buffer, "all-reduce buffer");
    const LamportCall call = cuda::make_lamport_call(LamportOp::all_reduce, buffer, buffer);
    one_shot_or_nccl(call, stream, [&](const RankResources& r, cudaStream_t st, ncclDataType_t type) {
      if (s.ld == s.cols || s.rows == 1) {
        LATENTMOE_NCCL_CHECK(r.comm, ncclAllReduce(buffer.data(), buffer.data(), static_cast<size_t>(s.rows * s.cols),
                                                   type, ncclSum, r.comm, st));
        return;
      }
      // A strided view: through the contiguous staging buffer.
      require_staging(s.rows * s.cols, "all-reduce");
      const size_t e = dtype_size(buffer.dtype());
      LATENTMOE_CUDA_CHECK(cudaMemcpy2DAsync(r.staging, s.cols * e, buffer.data(), s.ld * e, s.cols * e, s.rows,
                                             cudaMemcpyDeviceToDevice, st));
      LATENTMOE_NCCL_CHECK(
          r.comm, ncclAllReduce(r.staging, r.staging, static_cast<size_t>(s.rows * s.cols), type, ncclSum, r.comm, st));
      LATENTMOE_CUDA_CHECK(cudaMemcpy2DAsync(buffer.data(), s.ld * e, r.staging, s.cols * e, s.cols * e, s.rows,
                                             cudaMemcpyDeviceToDevice, st));
    });
  }

  void reduce_scatter_sum(const TensorView& input, const TensorView& output, StreamHandle stream) override {
    const Shape2 s = shape_of(input, "reduce-scatter input");
    const Shape2 o = shard_of(output, s, "reduce-scatter output");
    const LamportCall call = cuda::make_lamport_call(LamportOp::reduce_scatter, input, output);
    one_shot_or_nccl(call, stream, [&](const RankResources& r, cudaStream_t st, ncclDataType_t type) {
      const int64_t chunk = s.cols / size();
      if (s.rows == 1) {  // one row: the column blocks are NCCL's contiguous chunks
        LATENTMOE_NCCL_CHECK(r.comm, ncclReduceScatter(input.data(), output.data(), static_cast<size_t>(chunk), type,
                                                       ncclSum, r.comm, st));
        return;
      }
      // Column blocks packed into consecutive chunks [size][rows][chunk]; the reduce-scatter in place leaves
      // this rank's block of the sum at chunk `rank`, which is copied out into the (strided) output.
      require_staging(s.rows * s.cols, "reduce-scatter");
      const size_t e = dtype_size(input.dtype());
      cuda::launch_pack_column_blocks(input.data(), s.ld, s.rows, s.cols, size(), e, r.staging, st);
      char* mine = static_cast<char*>(r.staging) + static_cast<size_t>(rank()) * s.rows * chunk * e;
      LATENTMOE_NCCL_CHECK(
          r.comm, ncclReduceScatter(r.staging, mine, static_cast<size_t>(s.rows * chunk), type, ncclSum, r.comm, st));
      LATENTMOE_CUDA_CHECK(
          cudaMemcpy2DAsync(output.data(), o.ld * e, mine, chunk * e, chunk * e, s.rows, cudaMemcpyDeviceToDevice, st));
    });
  }

  void all_gather(const TensorView& input, const TensorView& output, StreamHandle stream) override {
    const Shape2 s = shape_of(output, "all-gather output");
    const Shape2 i = shard_of(input, s, "all-gather input");
    const LamportCall call = cuda::make_lamport_call(LamportOp::all_gather, input, output);
    one_shot_or_nccl(call, stream, [&](const RankResources& r, cudaStream_t st, ncclDataType_t type) {
      const int64_t chunk = s.cols / size();
      if (s.rows == 1) {
        LATENTMOE_NCCL_CHECK(r.comm,
                             ncclAllGather(input.data(), output.data(), static_cast<size_t>(chunk), type, r.comm, st));
        return;
      }
      // This rank's block into its chunk of the staging buffer, the all-gather in place, then every chunk
      // unpacked into its column block of the output.
      require_staging(s.rows * s.cols, "all-gather");
      const size_t e = dtype_size(output.dtype());
      char* mine = static_cast<char*>(r.staging) + static_cast<size_t>(rank()) * s.rows * chunk * e;
      LATENTMOE_CUDA_CHECK(
          cudaMemcpy2DAsync(mine, chunk * e, input.data(), i.ld * e, chunk * e, s.rows, cudaMemcpyDeviceToDevice, st));
      LATENTMOE_NCCL_CHECK(r.comm,
                           ncclAllGather(mine, r.staging, static_cast<size_t>(s.rows * chunk), type, r.comm, st));
      cuda::launch_unpack_column_blocks(r.staging, s.rows, s.cols, size(), e, output.data(), s.ld, st);
    });
  }

  void barrier(StreamHandle stream) override {
    const RankResources& r = resources();
    if (group_->one_shot) {
      LamportCall call;
      call.op = LamportOp::barrier;
      call.dtype = group_->dtype;
      call.in = r.scratch;
      call.rows = 1;
      call.cols = 16 / static_cast<int64_t>(dtype_size(group_->dtype));
      call.ld_in = call.cols;
      return launch(call, static_cast<cudaStream_t>(stream));
    }
    LamportCall call;
    call.op = LamportOp::barrier;
    call.rows = call.cols = 1;
    note(call, /*one_shot=*/false);
    cuda::DeviceGuard guard(r.device);
    LATENTMOE_NCCL_CHECK(
        r.comm, ncclAllReduce(r.scratch, r.scratch, 1, ncclInt32, ncclSum, r.comm, static_cast<cudaStream_t>(stream)));
  }

  void abort() override { group_->abort(); }

  void check() override {
    const GroupState& g = *group_;
    const RankResources& r = resources();
    const int status = reinterpret_cast<volatile int*>(g.host_flags)[1 + index_];
    cuda::throw_lamport_failure(status, r.rank, g.timeout_ns / 1000000);
    if (g.revoked.load()) {
      detail::throw_error("rank ", r.rank,
                          ": the NCCL group was aborted (another rank failed); its collectives' "
                          "results are undefined");
    }
    ncclResult_t async = ncclSuccess;
    LATENTMOE_NCCL_CHECK(r.comm, ncclCommGetAsyncError(r.comm, &async));
    if (async != ncclSuccess && async != ncclInProgress) {
      const char* last = ncclGetLastError(r.comm);
      detail::throw_error("rank ", r.rank, ": NCCL reported an asynchronous error: ", ncclGetErrorString(async),
                          last != nullptr && *last != '\0' ? std::string(" (") + last + ")" : std::string());
    }
  }

  std::string recent_collectives() const override {
    std::string text;
    const uint64_t first = enqueued_ > recent_.size() ? enqueued_ - recent_.size() : 0;
    for (uint64_t n = first; n < enqueued_; ++n) {
      const Enqueued& e = recent_[n % recent_.size()];
      if (!text.empty()) text += ", ";
      text += "#" + std::to_string(n) + " " + cuda::lamport_op_name(e.op) + " [" + std::to_string(e.rows) + ", " +
              std::to_string(e.cols) + "] " + (e.one_shot ? "one-shot" : "NCCL");
    }
    return text;
  }

  // Every one-shot kernel of this rank, the group's collectives' and the backend's fused steps'.
  void launch(const LamportCall& call, cudaStream_t stream) override {
    note(call, /*one_shot=*/true);
    cuda::DeviceGuard guard(resources().device);
    cuda::launch_lamport(peers_, call, stream);
  }

  const LamportPeers& lamport_peers() const override { return peers_; }
  DType lamport_dtype() const override { return group_->dtype; }
  bool one_shot() const override { return group_->one_shot; }
  int64_t fallback_elements() const override { return group_->fallback_elements; }

 private:
  const RankResources& resources() const { return group_->ranks[index_]; }

  void check_view(const TensorView& view, const char* what) const {
    LATENTMOE_CHECK(view.defined() && view.device() == Device::cuda, "rank ", rank(), ": the NCCL group's ", what,
                    " must be a device tensor");
    LATENTMOE_CHECK(view.dtype() == group_->dtype, "rank ", rank(), ": the NCCL group's ", what, " has dtype ",
                    dtype_name(view.dtype()), " but the group was built for ", dtype_name(group_->dtype));
    LATENTMOE_CHECK(view.rank() >= 1 && view.rank() <= 2 && (view.rank() == 1 || view.stride(1) == 1), "rank ", rank(),
                    ": the NCCL group's ", what, " must be rank 1 or 2 with a contiguous last dimension");
  }

  Shape2 shape_of(const TensorView& view, const char* what) const {
    check_view(view, what);
    Shape2 s;
    s.rows = view.rank() == 2 ? view.size(0) : 1;
    s.cols = view.rank() == 2 ? view.size(1) : view.numel();
    s.ld = view.rank() == 2 ? view.stride(0) : s.cols;
    return s;
  }

  // The 1/size column block of `whole`, checked.
  Shape2 shard_of(const TensorView& view, const Shape2& whole, const char* what) const {
    const Shape2 s = shape_of(view, what);
    LATENTMOE_CHECK(whole.cols % size() == 0, "rank ", rank(), ": the NCCL group's ", what, " side [", whole.rows, ", ",
                    whole.cols, "] does not split into ", size(), " column blocks");
    LATENTMOE_CHECK(s.rows == whole.rows && s.cols * size() == whole.cols, "rank ", rank(), ": the NCCL group's ", what,
                    " ", view.shape_string(), " is not a 1/", size(), " column block of [", whole.rows, ", ",
                    whole.cols, "]");
    return s;
  }

  // One-shot when every rank is reachable and the message fits; every rank decides alike (same shapes).
  bool fits(const LamportCall& call) const {
    return group_->one_shot && cuda::lamport_message_bytes(call, size()) <= group_->capacity_bytes;
  }

  // What every collective does first: `call` one-shot when it fits; nothing for an empty message (every
  // rank skips it alike); otherwise noted as NCCL's and `nccl(resources, stream, NCCL's type)` run on this
  // rank's device: the NCCL path, which only differs between the collectives.
  template <typename NcclPath>
  void one_shot_or_nccl(const LamportCall& call, StreamHandle stream, NcclPath&& nccl) {
    const auto st = static_cast<cudaStream_t>(stream);
    if (fits(call)) return launch(call, st);
    if (call.rows == 0 || call.cols == 0) return;
    note(call, /*one_shot=*/false);
    const RankResources& r = resources();
    cuda::DeviceGuard guard(r.device);
    nccl(r, st, nccl_type(call.dtype));
  }

  void require_staging(int64_t elements, const char* what) const {
    LATENTMOE_CHECK(elements <= group_->fallback_elements, "rank ", rank(), ": the NCCL group's ", what, " of ",
                    elements, " elements exceeds ", group_->one_shot ? "the one-shot capacity and " : "",
                    "the group's largest message of ", group_->fallback_elements,
                    " elements (GpuGroupOptions::max_elements)");
  }

  // Diagnostics only (recent_collectives): the collectives this rank enqueued last, a ring.
  struct Enqueued {
    LamportOp op = LamportOp::barrier;
    int64_t rows = 0, cols = 0;
    bool one_shot = false;
  };
  void note(const LamportCall& call, bool one_shot) {
    recent_[enqueued_++ % recent_.size()] = Enqueued{call.op, call.rows, call.cols, one_shot};
  }

  std::shared_ptr<GroupState> group_;
  size_t index_;
  LamportPeers peers_;
  std::array<Enqueued, 8> recent_{};
  uint64_t enqueued_ = 0;
};

// Builds the group's memory; a failure tears it down without collectives.
void build_or_fail(GroupState& g, const GpuGroupOptions& options) {
  try {
    build(g, options);
  } catch (...) {
    g.revoked = true;
    throw;
  }
}

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_nccl_gpu_group(int tp_size, const GpuGroupOptions& options) {
  check_options(tp_size, options);
  check_environment();
  const int num_devices = cuda::cuda_device_count();
  LATENTMOE_CHECK(num_devices >= tp_size, "NCCL group: tp ", tp_size, " needs ", tp_size, " GPUs, ", num_devices,
                  " found");
  auto group = std::make_shared<GroupState>();
  group->size = tp_size;
  group->ranks.resize(tp_size);
  std::vector<ncclComm_t> comms(tp_size, nullptr);
  std::vector<int> devices(tp_size);
  for (int r = 0; r < tp_size; ++r) devices[r] = r;
  {
    cuda::DeviceGuard guard(0);  // ncclCommInitAll switches devices
    LATENTMOE_NCCL_CHECK(nullptr, ncclCommInitAll(comms.data(), tp_size, devices.data()));
  }
  for (int r = 0; r < tp_size; ++r) {
    RankResources& resources = group->ranks[r];
    resources.rank = r;
    resources.device = r;
    resources.comm = comms[r];
    resources.owns_comm = true;
  }
  build_or_fail(*group, options);
  std::vector<std::unique_ptr<Communicator>> communicators;
  for (int r = 0; r < tp_size; ++r) communicators.push_back(std::make_unique<NcclCommunicator>(group, r));
  return communicators;
}

std::unique_ptr<Communicator> make_nccl_communicator(ncclComm_t comm, const GpuGroupOptions& options) {
  LATENTMOE_CHECK(comm != nullptr, "make_nccl_communicator: the NCCL communicator is null");
  check_environment();
  int size = 0, rank = 0, device = 0;
  LATENTMOE_NCCL_CHECK(comm, ncclCommCount(comm, &size));
  LATENTMOE_NCCL_CHECK(comm, ncclCommUserRank(comm, &rank));
  LATENTMOE_NCCL_CHECK(comm, ncclCommCuDevice(comm, &device));
  check_options(size, options);
  auto group = std::make_shared<GroupState>();
  group->size = size;
  group->ranks.resize(1);
  group->ranks[0].rank = rank;
  group->ranks[0].device = device;
  group->ranks[0].comm = comm;
  group->ranks[0].owns_comm = false;
  build_or_fail(*group, options);
  return std::make_unique<NcclCommunicator>(group, 0);
}

namespace detail {
std::string nccl_problem() {
  int loaded = 0;
  if (ncclGetVersion(&loaded) != ncclSuccess) return "ncclGetVersion failed";
  return nccl_version_mismatch(loaded, NCCL_VERSION_CODE).value_or(std::string());
}
}  // namespace detail

}  // namespace latentmoe

#else  // no NCCL: the factories report it

namespace latentmoe {

std::vector<std::unique_ptr<Communicator>> make_nccl_gpu_group(int, const GpuGroupOptions&) {
  detail::throw_error("an NCCL GPU group needs NCCL 2.28 or newer: latentmoe was built without it");
}

namespace detail {
std::string nccl_problem() { return "latentmoe was built without NCCL"; }
}  // namespace detail

}  // namespace latentmoe

#endif  // LATENTMOE_WITH_NCCL

// One-shot Lamport collectives between the ranks of a tensor-parallel group whose buffers every
// rank can load and store (ranks simulated on one GPU today; GPUs with peer access next). Host
// interface; includable from C++. The protocol and its invariants open src/cuda/comm/lamport.cu.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "latentmoe/dtype.h"

namespace latentmoe::cuda {

inline constexpr int kMaxLamportRanks = 16;
// Receive slots in rotation (DESIGN section 2): a rank reads and re-arms its regions of this call's slot
// while peers may already write the next one.
inline constexpr int kLamportSlots = 3;

// The plain parameter struct a collective kernel reaches its peers through, bound once when the
// group is built: kernels depend on no communication library.
struct LamportPeers {
  int rank = 0;
  int size = 1;
  // Each rank's receive area: kLamportSlots slots x size source regions x capacity_bytes.
  void* recv[kMaxLamportRanks] = {};
  int64_t capacity_bytes = 0;  // one source region; a multiple of 16
  // This rank's device words: [0] epoch (calls completed), [1] CTAs arrived in the current call (the
  // groups allocate a few more, unused).
  uint32_t* state = nullptr;
  const volatile int* abort = nullptr;  // the group's abort flag (host-mapped): non-zero releases every wait;
                                        // kAbortByHost from the host (abort()), kAbortByTimeout from a call that
                                        // timed out
  int* status = nullptr;                // this rank's error word (host-mapped): 0, or lamport_status()
  uint64_t timeout_ns = 0;              // the longest a wait may spin before the call fails
  // How many ranks of the group share this rank's GPU (a simulated group: all of them): a spinning
  // kernel takes at most 1 / (2 x this) of the SMs, so a peer's kernel on the same GPU can always start.
  int ranks_per_gpu = 1;
};

enum class LamportOp : int { all_reduce = 1, reduce_scatter = 2, all_gather = 3, barrier = 4 };

// "all-reduce", "reduce-scatter", "all-gather" or "barrier" (lamport_status.cpp).
const char* lamport_op_name(LamportOp op);

// The values of the abort flag: raised by the host's abort(), or by a wait of the group that timed out.
inline constexpr int kAbortByHost = 1;
inline constexpr int kAbortByTimeout = 2;

// Why a call failed: its own wait passed the deadline (timeout); the group was aborted by the host
// (aborted); another rank's wait timed out and released this one before its own deadline
// (peer_timeout: the same missing message seen from a rank that looked at the flag first).
enum class LamportFailure : int { timeout = 1, aborted = 2, peer_timeout = 3 };

// The error word a failed call leaves in LamportPeers::status: bits 0-7 the failure, 8-11 the op,
// 12-15 the lowest source rank whose message had not arrived, 16-31 the call's epoch (mod 2^16).
__host__ __device__ inline constexpr int lamport_status(LamportFailure failure, LamportOp op, int source,
                                                        uint32_t epoch) {
  return static_cast<int>((epoch & 0xffffu) << 16 | (static_cast<uint32_t>(source) & 0xfu) << 12 |
                          (static_cast<uint32_t>(op) & 0xfu) << 8 | static_cast<uint32_t>(failure));
}

// Throws the Error a rank's status word reports (nothing when 0), naming the rank, the collective, the
// call and the peer whose message was missing, and for a timeout how long it waited (lamport_status.cpp).
void throw_lamport_failure(int status, int rank, int64_t timeout_ms);

struct LamportCall {
  LamportOp op = LamportOp::all_reduce;
  DType dtype = DType::bf16;
  // all_reduce: in, out [rows, cols] (out may alias in);
  // reduce_scatter: in [rows, cols], out [rows, cols/size] = this rank's column block of the sum;
  // all_gather: in [rows, cols/size] = this rank's block, out [rows, cols].
  const void* in = nullptr;
  int64_t ld_in = 0;
  void* out = nullptr;
  int64_t ld_out = 0;
  int64_t rows = 0;
  int64_t cols = 0;
  // all_reduce only: out = RMSNorm(sum) · gamma when gamma is set (the fused AR + RMSNorm). gamma is a
  // weight: the kernel may read it before the previous kernel of the stream has completed (pdl.cuh),
  // so the kernel just before on the stream must not write it.
  const void* gamma = nullptr;
  DType gamma_dtype = DType::f32;
  float eps = 1e-5f;
  // all_reduce only, optional: a reduce-scatter carried by the same messages (tier 0's collective:
  // the latent all-reduce + norm and the shared partial's reduce-scatter in one kernel).
  // scatter_in [rows, scatter_cols], scatter_out [rows, scatter_cols/size] = this rank's column block.
  const void* scatter_in = nullptr;
  int64_t ld_scatter_in = 0;
  void* scatter_out = nullptr;
  int64_t ld_scatter_out = 0;
  int64_t scatter_cols = 0;
  // all_gather only: every rank's block was already stored into every rank's region of this call's
  // slot by a producer kernel earlier on each rank's stream (lamport::push_all_gather in a GEMM
  // epilogue); the kernel only receives, re-arms what it read and advances the epoch. `in` unused.
  bool presend = false;
};

// Bytes one source region must hold for `call` (the message a rank sends to one peer).
int64_t lamport_message_bytes(const LamportCall& call, int size);

// Throws Error for a group size outside 1..kMaxLamportRanks, a message larger than capacity_bytes, or
// shapes the op cannot take (what launch_lamport checks before it enqueues anything).
void check_lamport_call(const LamportPeers& peers, const LamportCall& call);

// Enqueues `call` on `stream`; every rank of the group must enqueue the same sequence of calls.
// Throws Error as check_lamport_call does, and for a dtype other than f32/bf16/f16; device failures
// (timeout, abort) surface in *status.
void launch_lamport(const LamportPeers& peers, const LamportCall& call, cudaStream_t stream);

// Fills a receive area with the sentinel of `dtype` (-0.0), enqueued on `stream`.
void lamport_fill_sentinel(void* recv, size_t bytes, DType dtype, cudaStream_t stream);

}  // namespace latentmoe::cuda

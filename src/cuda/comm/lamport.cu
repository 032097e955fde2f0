// One-shot Lamport collectives (all-reduce, optionally fused with RMSNorm and with a second tensor's
// reduce-scatter, which is tier 0's collective; reduce-scatter; all-gather; barrier) between ranks that can all load
// and store each other's receive areas.
//
// Protocol (after DESIGN section 2; public references TensorRT-LLM's allReduceFusionKernels and
// vLLM's custom all-reduce, read for the idea, written here anew):
//   - Every rank owns a receive area of kLamportSlots slots; a slot holds one region per source rank.
//     Every element of an idle region holds the sentinel -0.0 of the group's dtype.
//   - Call number e (the rank's device epoch, state[0]) uses slot e % 3. A sender stores its message
//     for peer p into p's region for the sender, with plain stores, rewriting -0.0 to +0.0 so that
//     no payload looks like the sentinel. No flag, no fence: each element announces itself.
//   - A receiver polls its own regions (volatile loads, which bypass L1) until no element is the
//     sentinel, then combines: sums in fp32 in rank order 0..size-1, so every rank's result is
//     bit-identical; or copies (all-gather).
//   - During call e a rank clears (back to the sentinel) the slot of call e-1. Safe because a peer
//     writes that slot again only in call e+2, which it reaches only after it has received this
//     rank's message of call e+1, which this rank sends after call e has completed (the calls of one
//     rank are stream-ordered kernels, launched without programmatic overlap). Likewise a peer can be
//     at most one call ahead, so it never writes the slot being read or cleared.
//   - The epoch lives on the device: the last CTA of a call to arrive (state[1]) advances it and
//     records how many bytes per region the call used (state[2 + slot]), so a captured CUDA graph
//     replays correctly and the host keeps no per-call state.
//   - An all-gather's send step may run in the kernel that produces the block instead (presend: a
//     GEMM epilogue stores each element into every peer's region of the slot its own epoch names,
//     lamport_device.cuh); the same argument holds, because that kernel runs after the rank's
//     previous call has completed, and the all-gather kernel that follows it on the stream receives,
//     clears and advances the epoch as usual.
//   - Every wait is bounded: past timeout_ns on the global timer, or when the host sets the group's
//     abort flag, the waiting thread gives up, the call records its failure in *status (first error
//     wins) and the kernel completes; the host reads the word at its check point. A group that
//     failed is not reused.
//   - Co-residency: a rank's kernel uses few CTAs (launch_lamport), so the ranks' spinning kernels
//     never take every SM of a GPU they share and a peer's kernel can always start.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "cuda/comm/lamport.h"
#include "cuda/comm/lamport_device.cuh"
#include "cuda/common/convert.cuh"
#include "cuda/common/cuda_check.h"
#include "cuda/common/device.h"
#include "cuda/common/dtype_dispatch.cuh"
#include "latentmoe/error.h"

namespace latentmoe::cuda {
namespace {

constexpr int kThreads = 256;

using lamport::as_payload;
using lamport::Bits;
using lamport::from_bits;
using lamport::region_of;

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t now;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(now));
  return now;
}

// Per-thread wait state: the deadline, and whether this call has already failed.
struct Waiter {
  const LamportPeers* peers;
  uint64_t deadline;
  int op;
  bool failed;

  __device__ void fail(LamportFailure failure) {
    if (!failed) atomicCAS(peers->status, 0, (op << 8) | static_cast<int>(failure));
    failed = true;
  }
};

// Element `index` of a region, once it is no longer the sentinel (or 0 after a failure).
template <class T>
__device__ __forceinline__ T wait_for(const T* region, int64_t index, Waiter& waiter) {
  using U = typename Bits<T>::type;
  const volatile U* word = reinterpret_cast<const volatile U*>(region) + index;
  for (uint32_t spin = 0;; ++spin) {
    const U bits = *word;
    if (bits != Bits<T>::sentinel) return from_bits<T>(bits);
    if (waiter.failed) return from_float<T>(0.0f);
    if ((spin & 31u) == 31u) {
      if (global_timer_ns() > waiter.deadline) waiter.fail(LamportFailure::timeout);
      if ((spin & 1023u) == 1023u && *waiter.peers->abort != 0) waiter.fail(LamportFailure::aborted);
    }
  }
}

template <class T>
__device__ float block_sum(float value, float* scratch) {
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // scratch may still be read by the previous call
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < kThreads / 32; ++w) total += scratch[w];  // fixed order: every thread the same bits
  return total;
}

// One kernel for every op. CTA b handles rows b, b + gridDim.x, ...: it sends them to every peer,
// then receives and combines them, then clears its share of the previous slot.
template <class T>
__global__ void __launch_bounds__(kThreads)
    lamport_kernel(LamportPeers peers, LamportCall call, int64_t message_bytes) {
  extern __shared__ float row_sums[];  // [cols] with a fused norm
  __shared__ float scratch[kThreads / 32];
  const int op = static_cast<int>(call.op);
  const uint32_t epoch = peers.state[0];
  const int slot = static_cast<int>(epoch % kLamportSlots);
  const int previous = static_cast<int>((epoch + kLamportSlots - 1) % kLamportSlots);
  const int64_t previous_bytes = peers.state[2 + previous];
  Waiter waiter{&peers, global_timer_ns() + peers.timeout_ns, op, false};
  const int size = peers.size, rank = peers.rank;
  const auto* in = static_cast<const T*>(call.in);
  auto* out = static_cast<T*>(call.out);
  const int64_t chunk =
      call.op == LamportOp::all_reduce || call.op == LamportOp::barrier ? call.cols : call.cols / size;

  // The fused reduce-scatter's part of each region follows the main part: [rows, chunk], then
  // [rows, scatter_chunk].
  const int64_t scatter_chunk = call.scatter_in != nullptr ? call.scatter_cols / size : 0;
  const int64_t scatter_offset = call.rows * chunk;
  const auto* scatter_in = static_cast<const T*>(call.scatter_in);
  auto* scatter_out = static_cast<T*>(call.scatter_out);

  // 1. Send every row of this CTA to every peer (each peer's region for this rank is [rows, chunk],
  // then [rows, scatter_chunk]).
  for (int64_t row = blockIdx.x; row < call.rows && !call.presend; row += gridDim.x) {
    for (int peer = 0; peer < size; ++peer) {
      T* region = region_of<T>(peers, peer, slot, rank) + row * chunk;
      const T* source = in + row * call.ld_in + (call.op == LamportOp::reduce_scatter ? peer * chunk : 0);
      for (int64_t c = threadIdx.x; c < chunk; c += kThreads) region[c] = as_payload(source[c]);
      if (scatter_chunk > 0) {
        T* scatter_region = region_of<T>(peers, peer, slot, rank) + scatter_offset + row * scatter_chunk;
        const T* scatter_source = scatter_in + row * call.ld_scatter_in + peer * scatter_chunk;
        for (int64_t c = threadIdx.x; c < scatter_chunk; c += kThreads)
          scatter_region[c] = as_payload(scatter_source[c]);
      }
    }
  }

  // 2. Receive and combine.
  for (int64_t row = blockIdx.x; row < call.rows; row += gridDim.x) {
    __syncthreads();  // in place: every thread has sent this row before any overwrites it
    if (call.op == LamportOp::all_gather) {
      for (int source = 0; source < size; ++source) {
        const T* region = region_of<T>(peers, rank, slot, source) + row * chunk;
        for (int64_t c = threadIdx.x; c < chunk; c += kThreads)
          out[row * call.ld_out + source * chunk + c] = wait_for(region, c, waiter);
      }
      continue;
    }
    float squares = 0.0f;
    for (int64_t c = threadIdx.x; c < chunk; c += kThreads) {
      float sum = 0.0f;
      for (int source = 0; source < size; ++source)
        sum += to_float(wait_for(region_of<T>(peers, rank, slot, source) + row * chunk, c, waiter));
      if (call.gamma != nullptr) {
        row_sums[c] = sum;
        squares += sum * sum;
      } else if (call.op != LamportOp::barrier) {
        out[row * call.ld_out + c] = from_float<T>(sum);
      }
    }
    if (call.gamma != nullptr) {
      const float total = block_sum<T>(squares, scratch);
      const float inverse = rsqrtf(total / static_cast<float>(chunk) + call.eps);
      for (int64_t c = threadIdx.x; c < chunk; c += kThreads) {
        const float g = load_as_float_dev(call.gamma, call.gamma_dtype, c);
        out[row * call.ld_out + c] = from_float<T>(row_sums[c] * inverse * g);
      }
    }
    for (int64_t c = threadIdx.x; c < scatter_chunk; c += kThreads) {
      float sum = 0.0f;
      for (int source = 0; source < size; ++source)
        sum += to_float(
            wait_for(region_of<T>(peers, rank, slot, source) + scatter_offset + row * scatter_chunk, c, waiter));
      scatter_out[row * call.ld_scatter_out + c] = from_float<T>(sum);
    }
  }

  // 3. Clear this rank's regions of the previous call's slot (grid-stride over all sources).
  {
    using U = typename Bits<T>::type;
    const int64_t per_region = previous_bytes / static_cast<int64_t>(sizeof(T));
    const int64_t total = per_region * size;
    for (int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; i < total;
         i += static_cast<int64_t>(gridDim.x) * kThreads) {
      U* region = reinterpret_cast<U*>(region_of<T>(peers, rank, previous, static_cast<int>(i / per_region)));
      region[i % per_region] = Bits<T>::sentinel;
    }
  }

  // 4. The last CTA to arrive advances the epoch and records what this slot holds.
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const uint32_t arrived = atomicAdd(&peers.state[1], 1u);
    if (arrived == gridDim.x - 1) {
      peers.state[1] = 0;
      peers.state[2 + slot] = static_cast<uint32_t>(message_bytes);
      peers.state[2 + previous] = 0;
      __threadfence();
      peers.state[0] = epoch + 1;
    }
  }
}

template <class T>
__global__ void fill_sentinel_kernel(typename Bits<T>::type* words, int64_t count) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    words[i] = Bits<T>::sentinel;
}

}  // namespace

int64_t lamport_message_bytes(const LamportCall& call, int size) {
  const bool whole = call.op == LamportOp::all_reduce || call.op == LamportOp::barrier;
  const int64_t chunk = whole ? call.cols : call.cols / size;
  const int64_t scatter_chunk = call.scatter_in != nullptr ? call.scatter_cols / size : 0;
  const int64_t bytes = call.rows * (chunk + scatter_chunk) * static_cast<int64_t>(dtype_size(call.dtype));
  return (bytes + 15) / 16 * 16;
}

void check_lamport_call(const LamportPeers& peers, const LamportCall& call) {
  LATENTMOE_CHECK(peers.size >= 1 && peers.size <= kMaxLamportRanks, "Lamport collective: group size ", peers.size,
                  " is outside 1..", kMaxLamportRanks);
  const bool whole = call.op == LamportOp::all_reduce || call.op == LamportOp::barrier;
  LATENTMOE_CHECK(whole || call.cols % peers.size == 0, "Lamport collective: ", call.cols,
                  " columns do not split over ", peers.size, " ranks");
  LATENTMOE_CHECK(call.gamma == nullptr || call.op == LamportOp::all_reduce,
                  "Lamport collective: only the all-reduce fuses RMSNorm");
  LATENTMOE_CHECK(
      call.scatter_in == nullptr ||
          (call.op == LamportOp::all_reduce && call.scatter_out != nullptr && call.scatter_cols % peers.size == 0),
      "Lamport collective: a fused reduce-scatter rides on an all-reduce and needs columns that split over ",
      peers.size, " ranks");
  LATENTMOE_CHECK(!call.presend || call.op == LamportOp::all_gather,
                  "Lamport collective: only an all-gather's message can be pushed by its producer");
  const int64_t message = lamport_message_bytes(call, peers.size);
  LATENTMOE_CHECK(message <= peers.capacity_bytes, "Lamport collective: a message of ", message,
                  " bytes per rank exceeds the group's capacity of ", peers.capacity_bytes,
                  " bytes (build the group for more tokens)");
}

void launch_lamport(const LamportPeers& peers, const LamportCall& call, cudaStream_t stream) {
  check_lamport_call(peers, call);
  const int64_t message = lamport_message_bytes(call, peers.size);
  if (call.rows == 0 || call.cols == 0) return;
  // Few CTAs per rank (co-residency with the peers' kernels on a shared GPU), at least one per row
  // up to that bound.
  const int sms = current_sm_count();
  const int max_ctas = std::max(1, sms / (2 * peers.size));
  const int grid = static_cast<int>(std::min<int64_t>(call.rows, max_ctas));
  const size_t shared = call.gamma != nullptr ? static_cast<size_t>(call.cols) * sizeof(float) : 0;
  dispatch_compute_dtype(call.dtype, "Lamport collective", [&](auto tag) {
    using T = decltype(tag);
    if (shared > 48 * 1024) {
      LATENTMOE_CUDA_CHECK(cudaFuncSetAttribute(lamport_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                static_cast<int>(shared)));
    }
    lamport_kernel<T><<<grid, kThreads, shared, stream>>>(peers, call, message);
  });
  LATENTMOE_CUDA_CHECK_LAUNCH("lamport_kernel");
}

void lamport_fill_sentinel(void* recv, size_t bytes, DType dtype, cudaStream_t stream) {
  dispatch_compute_dtype(dtype, "Lamport collective", [&](auto tag) {
    using T = decltype(tag);
    using U = typename Bits<T>::type;
    const int64_t count = static_cast<int64_t>(bytes / sizeof(U));
    fill_sentinel_kernel<T><<<256, 256, 0, stream>>>(static_cast<U*>(recv), count);
  });
  LATENTMOE_CUDA_CHECK_LAUNCH("fill_sentinel_kernel");
}

}  // namespace latentmoe::cuda

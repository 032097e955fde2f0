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
//   - Where a call's rows are 16-byte aligned (sixteen_byte_packs) every store and poll moves 16 bytes
//     (a Pack), and a thread issues the polls of all sources of one pack before it checks any, so it
//     waits about one round trip per pack instead of one per element and source. A pack may be seen
//     in parts; a part still holding the sentinel is polled again. The sums are the same, in the same
//     order, as with one element per access.
//   - A receiver clears each pack of its regions (back to the sentinel) as soon as it has read it in
//     full, in the same call: the clearing costs what the call's own message does, whatever size the
//     call before it had (clearing the previous call's slot instead made a one-row call after a
//     64-token one clear megabytes with one CTA). Safe because a pack is cleared only once every part
//     of it has arrived, and no peer writes that slot again before call e+3 (three in rotation), which
//     it reaches only after receiving this rank's message of call e+2, which this rank sends after call
//     e has completed (the calls of one rank are stream-ordered kernels: each is a programmatic
//     dependent that waits for the previous kernel before it touches memory, and none triggers its
//     dependents early). Likewise a peer can be at most one call ahead, so it never writes a slot
//     being read or cleared. (tests/test_lamport_protocol_model.cpp runs this argument as a model under
//     random schedules: three slots and two hold, one loses messages.)
//   - The epoch lives on the device: the last CTA of a call to arrive (state[1]) advances it (a call
//     of one CTA stores it), so a captured CUDA graph replays correctly and the host keeps no
//     per-call state.
//   - An all-gather's send step may run in the kernel that produces the block instead (presend: a
//     GEMM epilogue stores each element into every peer's region of the slot its own epoch names,
//     lamport_device.cuh); the same argument holds, because that kernel runs after the rank's
//     previous call has completed, and the all-gather kernel that follows it on the stream receives,
//     clears what it read and advances the epoch as usual.
//   - Every wait is bounded: past timeout_ns on the global timer, or when the group's abort flag is
//     raised (kAbortByHost by the host's abort(), kAbortByTimeout by a wait of the group that timed out),
//     the waiting thread gives up, the call records its failure in *status (first error wins: its own
//     timeout, a peer's timeout seen through the flag, or the host's abort) and the kernel completes; the
//     host reads the word at its check point. A group that failed is not reused.
//   - Co-residency: a rank's kernel uses at most 1 / (2 x the ranks sharing its GPU) of the SMs
//     (launch_lamport), so the ranks' spinning kernels never take every SM of a GPU they share and a
//     peer's kernel can always start.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "cuda/comm/lamport.h"
#include "cuda/comm/lamport_device.cuh"
#include "cuda/common/convert.cuh"
#include "cuda/common/cuda_check.h"
#include "cuda/common/device.h"
#include "cuda/common/dtype_dispatch.cuh"
#include "cuda/common/pdl.cuh"
#include "latentmoe/error.h"

namespace latentmoe::cuda {
namespace {

using lamport::as_payload;
using lamport::Bits;
using lamport::bits_of;
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
  LamportOp op;
  uint32_t epoch;
  bool failed;

  // Records the failure (the first of the rank wins) with the call's epoch and the lowest source
  // still missing, so that the error names which peer's message of which call never came. A timeout
  // also raises the group's abort flag: a group that failed is not reused, so every other wait of it
  // (the peers', and this rank's later calls before the host's check point) gives up at its next look
  // instead of running to its own deadline, and the failure surfaces after one timeout, not one per call.
  __device__ void fail(LamportFailure failure, uint32_t pending) {
    if (!failed) {
      atomicCAS(peers->status, 0, lamport_status(failure, op, __ffs(pending) - 1, epoch));
      if (failure == LamportFailure::timeout) *const_cast<volatile int*>(peers->abort) = kAbortByTimeout;
    }
    failed = true;
  }
};

// kWidth consecutive elements moved as one access: 16 bytes (kWidth = 16 / sizeof(T)) where the
// call's rows and regions are 16-byte aligned, else one element (kWidth = 1).
template <class T, int kWidth>
struct Pack {
  T v[kWidth];
};

template <class T, int kWidth>
__device__ __forceinline__ Pack<T, kWidth> load_pack(const T* p) {
  Pack<T, kWidth> pack;
  if constexpr (kWidth * sizeof(T) == 16) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    memcpy(&pack, &raw, 16);
  } else {
    pack.v[0] = *p;
  }
  return pack;
}

// A load that bypasses L1 and is issued every time (the peers' stores arrive behind the compiler's back).
template <class T, int kWidth>
__device__ __forceinline__ Pack<T, kWidth> load_pack_volatile(const T* p) {
  Pack<T, kWidth> pack;
  if constexpr (kWidth * sizeof(T) == 16) {
    uint4 raw;
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(raw.x), "=r"(raw.y), "=r"(raw.z), "=r"(raw.w)
                 : "l"(p));
    memcpy(&pack, &raw, 16);
  } else {
    using U = typename Bits<T>::type;
    pack.v[0] = from_bits<T>(*reinterpret_cast<const volatile U*>(p));
  }
  return pack;
}

template <class T, int kWidth>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, kWidth>& pack) {
  if constexpr (kWidth * sizeof(T) == 16) {
    uint4 raw;
    memcpy(&raw, &pack, 16);
    *reinterpret_cast<uint4*>(p) = raw;
  } else {
    *p = pack.v[0];
  }
}

// Whether no element is the sentinel. A 16-byte store may be seen in parts; an element still holding
// the sentinel simply makes the receiver look again.
template <class T, int kWidth>
__device__ __forceinline__ bool arrived(const Pack<T, kWidth>& pack) {
  bool all = true;
#pragma unroll
  for (int i = 0; i < kWidth; ++i) all = all && bits_of(pack.v[i]) != Bits<T>::sentinel;
  return all;
}

template <class T, int kWidth>
__device__ __forceinline__ Pack<T, kWidth> payload_of(Pack<T, kWidth> pack) {
#pragma unroll
  for (int i = 0; i < kWidth; ++i) pack.v[i] = as_payload(pack.v[i]);
  return pack;
}

// Every source's pack at element `offset` of its region for this rank in `slot`, once it has
// arrived: the loads of all sources still missing are issued together, then checked, so a thread
// waits about one round trip per unit, not one per source. After a failure the missing packs are 0.
// kRanks: the group size rounded up to a power of two (the packs live in registers).
template <class T, int kWidth, int kRanks>
__device__ __forceinline__ void wait_for_all(const LamportPeers& peers, int slot, int64_t offset,
                                             Pack<T, kWidth> (&got)[kRanks], Waiter& waiter) {
  uint32_t pending = (1u << peers.size) - 1u;
  for (uint32_t spin = 0; pending != 0; ++spin) {
#pragma unroll
    for (int s = 0; s < kRanks; ++s) {
      if (pending & (1u << s))
        got[s] = load_pack_volatile<T, kWidth>(region_of<T>(peers, peers.rank, slot, s) + offset);
    }
#pragma unroll
    for (int s = 0; s < kRanks; ++s) {
      if ((pending & (1u << s)) && arrived(got[s])) pending &= ~(1u << s);
    }
    if (pending == 0) break;
    if (waiter.failed) {
#pragma unroll
      for (int s = 0; s < kRanks; ++s) {
        if (pending & (1u << s)) {
#pragma unroll
          for (int i = 0; i < kWidth; ++i) got[s].v[i] = from_float<T>(0.0f);
        }
      }
      break;
    }
    if ((spin & 31u) == 31u) {
      if (global_timer_ns() > waiter.deadline) waiter.fail(LamportFailure::timeout, pending);
      if ((spin & 1023u) == 1023u) {
        const int flag = *waiter.peers->abort;
        if (flag != 0)
          waiter.fail(flag == kAbortByTimeout ? LamportFailure::peer_timeout : LamportFailure::aborted, pending);
      }
    }
  }
}

// Re-arms the pack at `offset` of every source's region for this rank in `slot` (read in full).
template <class T, int kWidth, int kRanks>
__device__ __forceinline__ void clear_all(const LamportPeers& peers, int slot, int64_t offset) {
  Pack<T, kWidth> idle;
#pragma unroll
  for (int i = 0; i < kWidth; ++i) idle.v[i] = from_bits<T>(Bits<T>::sentinel);
#pragma unroll
  for (int s = 0; s < kRanks; ++s) {
    if (s < peers.size) store_pack(region_of<T>(peers, peers.rank, slot, s) + offset, idle);
  }
}

// Element i of the rank-order fp32 sum of the sources' packs (every rank adds in the same order).
template <class T, int kWidth, int kRanks>
__device__ __forceinline__ float rank_order_sum(const Pack<T, kWidth> (&got)[kRanks], int size, int i) {
  float sum = 0.0f;
#pragma unroll
  for (int s = 0; s < kRanks; ++s) {
    if (s < size) sum += to_float(got[s].v[i]);
  }
  return sum;
}

// The sum over the CTA of every thread's `value`, the same bits in every thread (fixed order).
__device__ float block_sum(float value, float* scratch) {
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // scratch may still be read by the previous row
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) total += scratch[w];
  return total;
}

// The most threads a CTA of a group of up to kRanks ranks runs: its packs of every source live in
// registers, so the wider the group, the fewer threads fit the register file.
template <int kRanks>
constexpr int max_threads_for() {
  return kRanks <= 2 ? 1024 : (kRanks <= 8 ? 512 : 256);
}

// A reduce-scatter's send of one pack position: peer p gets the pack at `source + p * block` (its
// column block), stored at `offset` of its region for this rank. Loads go in groups of four before
// their stores, so a thread waits about one round trip per group, not one per peer, and holds few
// registers.
template <class T, int kWidth, int kRanks>
__device__ __forceinline__ void send_blocks(const LamportPeers& peers, int slot, const T* source, int64_t block,
                                            int64_t offset) {
  constexpr int kGroup = kRanks < 4 ? kRanks : 4;
#pragma unroll
  for (int first = 0; first < kRanks; first += kGroup) {
    Pack<T, kWidth> parts[kGroup];
#pragma unroll
    for (int j = 0; j < kGroup; ++j) {
      if (first + j < peers.size) parts[j] = load_pack<T, kWidth>(source + (first + j) * block);
    }
#pragma unroll
    for (int j = 0; j < kGroup; ++j) {
      if (first + j < peers.size)
        store_pack(region_of<T>(peers, first + j, slot, peers.rank) + offset, payload_of(parts[j]));
    }
  }
}

// One kernel for every op. CTA b handles rows b, b + gridDim.x, ...: it sends them to every peer,
// then receives and combines them, re-arming each pack it has read. Every access moves a Pack of
// kWidth elements (launch_lamport picks 16 bytes where the call's alignment allows); the launcher
// sizes the CTA so that a row is usually one pack per thread.
//
// Latency is the point at decode (one row: one CTA): the critical path is a chain of round trips
// to memory, so the kernel keeps it short. The norm's weight is read before pdl_wait (a weight, not
// an output of an earlier kernel); the epoch and the first input pack are loaded together; each
// input pack is loaded once and stored to every peer; a thread usually polls one pack; and a CTA
// alone in its grid advances the epoch with one store (no counter, no fence: the next kernel of the
// stream reads it only once this one has completed).
template <class T, int kWidth, int kRanks>
__global__ void __launch_bounds__(max_threads_for<kRanks>()) lamport_kernel(LamportPeers peers, LamportCall call) {
  using P = Pack<T, kWidth>;
  extern __shared__ float row_sums[];  // [cols] with a fused norm
  __shared__ float scratch[32];
  const int threads = static_cast<int>(blockDim.x);
  const int64_t chunk =
      call.op == LamportOp::all_reduce || call.op == LamportOp::barrier ? call.cols : call.cols / peers.size;
  const int64_t units = chunk / kWidth;

  // The norm's weight for this thread's first pack, before pdl_wait (it is a weight).
  float first_gamma[kWidth];
  const bool norm = call.gamma != nullptr;
  if (norm && threadIdx.x < units) {
#pragma unroll
    for (int i = 0; i < kWidth; ++i)
      first_gamma[i] = load_as_float_dev(call.gamma, call.gamma_dtype, threadIdx.x * kWidth + i);
  }
  // Launched as a programmatic dependent: the CTAs may become resident while the previous kernel of
  // the stream finishes, but nothing else is read or written before it has (its outputs are this
  // call's inputs, and the previous collective's epoch must be final). The kernel never triggers its
  // own dependents early, so the next kernel starts only when this call has completed.
  pdl_wait();
  const uint32_t epoch = peers.state[0];
  const int slot = static_cast<int>(epoch % kLamportSlots);
  Waiter waiter{&peers, global_timer_ns() + peers.timeout_ns, call.op, epoch, false};
  const int size = peers.size, rank = peers.rank;
  const auto* in = static_cast<const T*>(call.in);
  auto* out = static_cast<T*>(call.out);
  const bool scatter = call.op == LamportOp::reduce_scatter;

  // The fused reduce-scatter's part of each region follows the main part: [rows, chunk], then
  // [rows, scatter_chunk].
  const int64_t scatter_chunk = call.scatter_in != nullptr ? call.scatter_cols / size : 0;
  const int64_t scatter_units = scatter_chunk / kWidth;
  const int64_t scatter_offset = call.rows * chunk;
  const auto* scatter_in = static_cast<const T*>(call.scatter_in);
  auto* scatter_out = static_cast<T*>(call.scatter_out);

  // 1. Send every row of this CTA to every peer (each peer's region for this rank is [rows, chunk],
  // then [rows, scatter_chunk]): each pack loaded once (a reduce-scatter: each peer's block), then
  // stored to every peer.
  for (int64_t row = blockIdx.x; row < call.rows && !call.presend; row += gridDim.x) {
    for (int64_t u = threadIdx.x; u < units; u += threads) {
      if (scatter) {
        send_blocks<T, kWidth, kRanks>(peers, slot, in + row * call.ld_in + u * kWidth, chunk,
                                       row * chunk + u * kWidth);
      } else {
        const P payload = payload_of(load_pack<T, kWidth>(in + row * call.ld_in + u * kWidth));
#pragma unroll
        for (int peer = 0; peer < kRanks; ++peer) {
          if (peer < size) store_pack(region_of<T>(peers, peer, slot, rank) + row * chunk + u * kWidth, payload);
        }
      }
    }
    for (int64_t u = threadIdx.x; u < scatter_units; u += threads) {
      send_blocks<T, kWidth, kRanks>(peers, slot, scatter_in + row * call.ld_scatter_in + u * kWidth, scatter_chunk,
                                     scatter_offset + row * scatter_chunk + u * kWidth);
    }
  }

  // 2. Receive and combine.
  P got[kRanks];
  for (int64_t row = blockIdx.x; row < call.rows; row += gridDim.x) {
    __syncthreads();  // in place: every thread has sent this row before any overwrites it
    if (call.op == LamportOp::all_gather) {
      for (int64_t u = threadIdx.x; u < units; u += threads) {
        wait_for_all<T, kWidth, kRanks>(peers, slot, row * chunk + u * kWidth, got, waiter);
        clear_all<T, kWidth, kRanks>(peers, slot, row * chunk + u * kWidth);
#pragma unroll
        for (int source = 0; source < kRanks; ++source) {  // constant indices: got stays in registers
          if (source < size) store_pack(out + row * call.ld_out + source * chunk + u * kWidth, got[source]);
        }
      }
      continue;
    }
    float squares = 0.0f;
    for (int64_t u = threadIdx.x; u < units; u += threads) {
      wait_for_all<T, kWidth, kRanks>(peers, slot, row * chunk + u * kWidth, got, waiter);
      clear_all<T, kWidth, kRanks>(peers, slot, row * chunk + u * kWidth);
      P sums;
#pragma unroll
      for (int i = 0; i < kWidth; ++i) {
        const float sum = rank_order_sum<T, kWidth, kRanks>(got, size, i);
        if (norm) {
          row_sums[u * kWidth + i] = sum;
          squares += sum * sum;
        }
        sums.v[i] = from_float<T>(sum);
      }
      if (!norm && call.op != LamportOp::barrier) store_pack(out + row * call.ld_out + u * kWidth, sums);
    }
    if (norm) {
      const float total = block_sum(squares, scratch);
      const float inverse = rsqrtf(total / static_cast<float>(chunk) + call.eps);
      for (int64_t u = threadIdx.x; u < units; u += threads) {
        P normed;
#pragma unroll
        for (int i = 0; i < kWidth; ++i) {
          const int64_t c = u * kWidth + i;
          const float g = u == threadIdx.x ? first_gamma[i] : load_as_float_dev(call.gamma, call.gamma_dtype, c);
          normed.v[i] = from_float<T>(row_sums[c] * inverse * g);
        }
        store_pack(out + row * call.ld_out + u * kWidth, normed);
      }
    }
    for (int64_t u = threadIdx.x; u < scatter_units; u += threads) {
      wait_for_all<T, kWidth, kRanks>(peers, slot, scatter_offset + row * scatter_chunk + u * kWidth, got, waiter);
      clear_all<T, kWidth, kRanks>(peers, slot, scatter_offset + row * scatter_chunk + u * kWidth);
      P sums;
#pragma unroll
      for (int i = 0; i < kWidth; ++i) sums.v[i] = from_float<T>(rank_order_sum<T, kWidth, kRanks>(got, size, i));
      store_pack(scatter_out + row * call.ld_scatter_out + u * kWidth, sums);
    }
  }

  // 3. Advance the epoch once every CTA has read it (each read it right after pdl_wait, before it
  // counts itself here). No fence: nothing in this grid reads the words afterwards, and the next
  // kernel of the stream reads them only after this grid has completed.
  __syncthreads();
  if (threadIdx.x == 0) {
    if (gridDim.x == 1) {
      peers.state[0] = epoch + 1;
    } else if (atomicAdd(&peers.state[1], 1u) == gridDim.x - 1) {
      peers.state[1] = 0;
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

// Whether every access of `call` can move 16 bytes: each region's rows (chunk), the fused scatter's
// rows, and every row of `in`, `out` and the scatter tensors start on a 16-byte boundary.
bool sixteen_byte_packs(const LamportCall& call, int size, size_t element_size) {
  const int64_t width = static_cast<int64_t>(16 / element_size);
  const bool whole = call.op == LamportOp::all_reduce || call.op == LamportOp::barrier;
  const int64_t chunk = whole ? call.cols : call.cols / size;
  const int64_t scatter_chunk = call.scatter_in != nullptr ? call.scatter_cols / size : 0;
  auto aligned = [&](const void* pointer, int64_t ld) {
    return reinterpret_cast<uintptr_t>(pointer) % 16 == 0 && (call.rows <= 1 || ld % width == 0);
  };
  return chunk % width == 0 && scatter_chunk % width == 0 && aligned(call.in, call.ld_in) &&
         aligned(call.out, call.ld_out) && aligned(call.scatter_in, call.ld_scatter_in) &&
         aligned(call.scatter_out, call.ld_scatter_out);
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
  if (call.rows == 0 || call.cols == 0) return;
  // At most half the SMs per rank on its own GPU (the other half for what runs beside the collective,
  // such as tier 1's up-projection beside its shared all-reduce), fewer when ranks share the GPU
  // (co-residency with the peers' kernels); one CTA per row up to that bound. On two H200s, 33 CTAs
  // (the bound of ranks sharing a GPU) made the AR+RMSNorm of 4096 x 3584 bf16 take 781 µs.
  const int sms = current_sm_count();
  const int max_ctas = std::max(1, sms / (2 * std::max(1, peers.ranks_per_gpu)));
  const int grid = static_cast<int>(std::min<int64_t>(call.rows, max_ctas));
  const size_t shared = call.gamma != nullptr ? static_cast<size_t>(call.cols) * sizeof(float) : 0;
  const bool whole = call.op == LamportOp::all_reduce || call.op == LamportOp::barrier;
  const int64_t chunk = whole ? call.cols : call.cols / peers.size;
  const int64_t scatter_chunk = call.scatter_in != nullptr ? call.scatter_cols / peers.size : 0;
  dispatch_compute_dtype(call.dtype, "Lamport collective", [&](auto tag) {
    using T = decltype(tag);
    const bool wide = sixteen_byte_packs(call, peers.size, sizeof(T));
    const int width = wide ? static_cast<int>(16 / sizeof(T)) : 1;
    // One pack per thread where the row allows (a warp at least, the register bound at most).
    const int64_t packs = std::max((chunk + width - 1) / width, (scatter_chunk + width - 1) / width);
    auto launch = [&](auto kernel, int max_threads) {
      const int threads = static_cast<int>(std::clamp<int64_t>((packs + 31) / 32 * 32, 64, max_threads));
      if (shared > 48 * 1024) {
        LATENTMOE_CUDA_CHECK(
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared)));
      }
      launch_kernel("lamport_kernel", pdl_supported(), kernel, dim3(grid), dim3(threads), shared, stream, peers, call);
    };
    auto with_width = [&]<int kRanks>() {
      if (wide) {
        launch(lamport_kernel<T, 16 / sizeof(T), kRanks>, max_threads_for<kRanks>());
      } else {
        launch(lamport_kernel<T, 1, kRanks>, max_threads_for<kRanks>());
      }
    };
    if (peers.size <= 2) {
      with_width.template operator()<2>();
    } else if (peers.size <= 4) {
      with_width.template operator()<4>();
    } else if (peers.size <= 8) {
      with_width.template operator()<8>();
    } else {
      with_width.template operator()<16>();
    }
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

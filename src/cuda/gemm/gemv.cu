// The decode GEMV of gemv.h: three kernels (long rows: warp rows, the default, or the ring; short rows)
// and their launcher. The warp-rows kernel's comment (below) has its split and protocol; what follows
// describes the ring and the short rows.
//
// Work split. W is read as 16-byte *vectors* of 8 elements; k is a multiple of 8, so a vector never
// straddles two rows: vector v is row v / kv, elements 8 (v % kv) .. 8 (v % kv) + 7, kv = k / 8.
//   - Long rows, ring (kv >= 32, k >= 256; gemv_rows_kernel, GemvKernel::ring). The grid is `clusters`
//     clusters of `split` CTAs of `warps` warps. Cluster c owns the whole rows [n c / clusters, n (c + 1) / clusters);
//     their vectors are cut into split * warps equal contiguous ranges, one per warp (a *worker*), so
//     every warp of a cluster streams the same bytes to within one vector, and clusters differ by at
//     most one row. A worker's range covers whole rows, plus at most a part of a row at each end that
//     it shares with its neighbours in the cluster (a *split row*).
//   - Short rows (kv < 32; gemv_short_kernel): every warp takes whole rows (n q / workers ..), a group
//     of g lanes (g the power of two >= kv) per row, 32 / g rows per step; no split rows.
// The launcher sizes the grid from the SM count: one CTA of 16 warps per SM (fewer CTAs when the
// matrix is small, fewer warps when x leaves too little shared memory for their rings), `split` 2 (or
// 4, 8 when rows are few) where a cluster's rows balance the SMs better than whole rows per CTA (sm_90;
// docs/CUDA_BACKEND.md, "Decode GEMV").
//
// Streaming. Each lane walks its worker's range 32 vectors (512 contiguous bytes per warp) a step.
// Long rows: every warp streams through its own ring of kRingSteps steps in shared memory (cp.async,
// one commit group per step, kRingSteps - 1 steps in flight; each lane reads back only the 16 bytes it
// copied, so the ring needs no barrier): 16 warps keep 152 KB per SM in flight. A first version kept
// 12 steps in registers (72 KB per SM at 12 warps) and streamed at 1.5 TB/s, its time proportional to
// 1 / warps (bench/micro/gemv_bench.cu, bench/results/gemv_bench_da4cfb7.json): latency-bound, and
// registers cannot hold more. Weight copies are evict-first in L2 with 256-byte fetches, so the weights
// stream past the caches without evicting x, y or the next kernel's data. Short rows keep the register
// ring (kBatch loads in flight per lane; their matrices are small).
//
// Reduction (long rows), all in fp32 and in a fixed order. Each lane adds the 8 products of its vector
// for each x row (in element order) into its accumulator of the worker's current row, or of the next
// row for the lanes past the row boundary (k >= 256: a step of 32 vectors meets at most one boundary).
// When the whole warp has left a row, the lanes' sums are added by a butterfly of shuffles; a row the
// worker holds whole is written at once (old y added in fp32 when accumulating, one rounding). A split
// row's partial sums go to shared memory, `partials[warp][slot][x row]` (slot 0: the worker's first row,
// 1: its last). After a barrier of the cluster (of the CTA when split == 1), the worker that holds a
// split row's first vector adds the partials of every worker of the row in worker order (over
// distributed shared memory on sm_90) and writes it. A second cluster barrier keeps every CTA's shared
// memory alive until then. So no atomics, no global workspace, and the same bits on every run.
//
// Programmatic dependent launch (src/cuda/common/pdl.cuh). Invariants of all three kernels:
//   1. Before pdl_wait() a thread only computes its range and issues its first weight copies (ring:
//      kRingSteps - 1 steps into its ring; short rows: kBatch loads into registers; warp rows: its first
//      batch): W is never written by any kernel of a forward (rule 1 of pdl.cuh).
//   2. x, the old y and y are read or written only after pdl_wait() (x staged into shared memory, y
//      written by whichever worker finishes a row). Every thread of every CTA calls pdl_wait(), also
//      those with an empty range, so the kernel never completes before its predecessor.
//   3. pdl_trigger() follows the thread's own pdl_wait(), so a dependent launched after this kernel
//      starts its prologue only once everything before this kernel has completed.
// y must not overlap x or W (as for cuBLASLt): another CTA may write y while one still stages x.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <sstream>
#include <string>
#include <type_traits>

#include "cuda/common/activation.cuh"
#include "cuda/common/cluster.cuh"
#include "cuda/common/convert.cuh"
#include "cuda/common/cuda_check.h"
#include "cuda/common/device.h"
#include "cuda/common/dtype_dispatch.cuh"
#include "cuda/common/pdl.cuh"
#include "cuda/common/reduce.cuh"
#include "cuda/gemm/gemv.h"
#include "cuda/gemm/grouped_gemm_mma.cuh"  // cp.async copies, the L2 policy
#include "latentmoe/error.h"

namespace latentmoe::cuda {
namespace {

constexpr int kMaxWarps = 16;        // warps per CTA (a forced shape may take up to 16)
constexpr int kDefaultWarps = 16;    // one 512-thread CTA per SM (fewer where x leaves too little room)
constexpr int kMaxSplit = 8;         // the portable cluster size
constexpr int kLongRowVectors = 32;  // kv from which the long-row kernel runs (a step meets <= 1 boundary)
constexpr int kStageUnroll = 4;      // x vectors each thread loads before it stores them to shared memory
constexpr unsigned kFullMask = 0xffffffffu;

// Short rows: steps (32 vectors per warp) in flight per lane, in registers.
constexpr int kBatch = 12;
// Long rows: steps in each warp's shared-memory ring (512 B each); kRingSteps - 1 are in flight.
constexpr int kRingSteps = 20;
constexpr size_t kRingBytesPerWarp = size_t{kRingSteps} * 32 * sizeof(uint4);
constexpr int kMinBatchSteps = 8;  // a CTA gets at least warps x 32 x this many vectors (grid sizing)

struct GemvParams {
  const void* x = nullptr;
  int64_t ldx = 0;  // elements
  const void* w = nullptr;
  int64_t ldw = 0;
  void* y = nullptr;
  int64_t ldy = 0;
  int64_t n = 0;
  int kv = 0;     // k / 8: vectors per row
  int split = 1;  // CTAs per cluster (long rows)
  int group = 1;  // lanes per row (short rows): the power of two >= kv
  bool accumulate = false;
  // Warp rows: warps per row (a power of two dividing the CTA's warps) and the vectors of each one's
  // segment of a row (a multiple of 32).
  int team = 1;
  int segment = 0;
  // Gate/up (warp rows): the gate matrix (row stride ldw, like w, the up matrix), and the gated activation.
  const void* gate = nullptr;
  bool situ = false;
  float situ_beta = 0.0f, situ_linear_beta = 0.0f;
  // Warp rows: x is RMS-normalised in shared memory before use when gamma is set (gemv_rms_norm).
  const void* gamma = nullptr;
  DType gamma_dtype = DType::f32;
  float eps = 0.0f;
};

// Two packed 16-bit values (low half first) as floats.
template <class T>
__device__ __forceinline__ float2 widen(uint32_t word) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return make_float2(__uint_as_float(word << 16), __uint_as_float(word & 0xffff0000u));
  } else {
    __half2 pair;
    static_assert(sizeof(pair) == sizeof(word));
    memcpy(&pair, &word, sizeof(word));
    return __half22float2(pair);
  }
}

template <class T>
__device__ __forceinline__ void widen8(const uint4& v, float (&out)[8]) {
  const float2 a = widen<T>(v.x), b = widen<T>(v.y), c = widen<T>(v.z), d = widen<T>(v.w);
  out[0] = a.x, out[1] = a.y, out[2] = b.x, out[3] = b.y, out[4] = c.x, out[5] = c.y, out[6] = d.x, out[7] = d.y;
}

// d[t] = the 8 products of one weight vector with x row t at vector column `column`, added in element
// order (fp32).
template <class T, int kRows>
__device__ __forceinline__ void dot8(float (&d)[kRows], const uint4& weights, const uint4* xs, int column, int kv) {
  float w[8];
  widen8<T>(weights, w);
#pragma unroll
  for (int t = 0; t < kRows; ++t) {
    float x[8];
    widen8<T>(xs[t * kv + column], x);
    float sum = w[0] * x[0];
#pragma unroll
    for (int e = 1; e < 8; ++e) sum = fmaf(w[e], x[e], sum);
    d[t] = sum;
  }
}

// The old y[t, column] (accumulate), read from L2. After pdl_wait() only. The kernels load it a row
// (a step) before they need it, so no warp waits for it in the middle of its stream.
template <class T>
__device__ __forceinline__ float load_y(const GemvParams& p, int t, int64_t column) {
  const unsigned short bits =
      __ldcg(reinterpret_cast<const unsigned short*>(static_cast<const T*>(p.y) + t * p.ldy) + column);
  T old;
  memcpy(&old, &bits, sizeof(old));
  return to_float(old);
}

// y[t, column] = sum (+ old, the old y[t, column], added in fp32 when accumulating), rounded once.
template <class T>
__device__ __forceinline__ void store_y(const GemvParams& p, int t, int64_t column, float sum, float old) {
  static_cast<T*>(p.y)[t * p.ldy + column] = from_float<T>(p.accumulate ? sum + old : sum);
}

// x [kRows, k] into shared memory as [kRows][kv] vectors, then a block barrier. After pdl_wait() only.
// Each thread loads kStageUnroll vectors before it stores them, so a CTA's x arrives in one round trip
// (k = 7168: 896 vectors a row, 1536 a round at 12 warps).
template <int kRows>
__device__ __forceinline__ void stage_x(const GemvParams& p, uint4* xs) {
  const int kv = p.kv, total = kRows * kv, threads = static_cast<int>(blockDim.x);
  const uint4* x = static_cast<const uint4*>(p.x);
  const int64_t ldx = p.ldx / 8;
  for (int base = 0; base < total; base += kStageUnroll * threads) {
    uint4 v[kStageUnroll];
#pragma unroll
    for (int j = 0; j < kStageUnroll; ++j) {
      const int i = base + j * threads + static_cast<int>(threadIdx.x);
      if (i < total) {
        const int t = (i >= kv) + (i >= 2 * kv) + (i >= 3 * kv);  // kRows <= 4
        v[j] = __ldcg(x + t * ldx + (i - t * kv));
      }
    }
#pragma unroll
    for (int j = 0; j < kStageUnroll; ++j) {
      const int i = base + j * threads + static_cast<int>(threadIdx.x);
      if (i < total) xs[i] = v[j];
    }
  }
  __syncthreads();
}

// The vectors of a cluster's whole rows, cut into `workers` equal contiguous ranges (long rows).
struct ClusterRange {
  int64_t first = 0;   // the cluster's first vector
  int64_t length = 0;  // its vectors
  int workers = 1;     // split x warps
  // Worker q's range is [begin(q), begin(q + 1)).
  __device__ __forceinline__ int64_t begin(int q) const { return first + length * q / workers; }
};

__device__ __forceinline__ ClusterRange cluster_range(const GemvParams& p, int warps) {
  const int cluster = static_cast<int>(blockIdx.x) / p.split, clusters = static_cast<int>(gridDim.x) / p.split;
  const int64_t row_begin = p.n * cluster / clusters, row_end = p.n * (cluster + 1) / clusters;
  return {row_begin * p.kv, (row_end - row_begin) * p.kv, p.split * warps};
}

// Long rows (kv >= 32). Shared memory: x [kRows][kv] vectors, then partials [warps][2][kRows] floats.
// The file comment has the split, the reduction and the launch protocol.
template <class T, int kRows>
__global__ void __launch_bounds__(kMaxWarps * 32, 1) gemv_rows_kernel(const GemvParams p) {
  extern __shared__ uint4 smem[];
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  const int warps = static_cast<int>(blockDim.x) >> 5;
  const int kv = p.kv;
  const int me = static_cast<int>(blockIdx.x) % p.split * warps + warp;  // worker: (cluster rank, warp)
  int64_t begin, end;
  {
    const ClusterRange range = cluster_range(p, warps);
    begin = range.begin(me);
    end = range.begin(me + 1);
  }
  const int len = static_cast<int>(end - begin);  // < 2^31 - 2^11 (checked by the launcher)

  // Issue cursor: this lane's next vector, kRingSteps - 1 steps ahead of the multiply. Shared memory:
  // the warps' rings [warps][kRingSteps][32 lanes] vectors, then x, then the partials.
  int issue_column = static_cast<int>((begin + lane) % kv);
  const uint4* source = static_cast<const uint4*>(p.w) + (begin + lane) / kv * (p.ldw / 8) + issue_column;
  const int64_t wrap = p.ldw / 8 - kv;                     // from past a row's end to the next row's start
  int to_issue = len > lane ? (len - lane + 31) / 32 : 0;  // valid steps of this lane not yet issued
  const uint64_t policy = gg::evict_first_policy();
  uint4* lane_ring = smem + warp * kRingSteps * 32 + lane;  // this lane's vector of ring step 0
  const uint32_t lane_ring_u32 = gg::smem_u32(lane_ring);
  // Copies this lane's next vector into ring slot `slot` (zeros past the range) as one commit group.
  auto issue = [&](int slot) {
    const bool ok = to_issue > 0;
    gg::cp_async_16_stream(lane_ring_u32 + slot * 32 * sizeof(uint4), ok ? source : p.w, ok, policy);
    gg::cp_async_commit();
    --to_issue;
    source += 32;
    issue_column += 32;
    if (issue_column >= kv) {  // kv >= 32: at most one row boundary per step
      issue_column -= kv;
      source += wrap;
    }
  };
  int column = issue_column;  // multiply cursor: the same column, kRingSteps - 1 steps behind
#pragma unroll
  for (int i = 0; i < kRingSteps - 1; ++i) issue(i);  // before the wait: W is never written in a forward

  pdl_wait();  // x and y: the previous kernel's
  pdl_trigger();
  uint4* xs = smem + static_cast<size_t>(warps) * kRingSteps * 32;
  float* partials = reinterpret_cast<float*>(xs + kRows * kv);
  stage_x<kRows>(p, xs);

  // Rows of the range (n < 2^31): the first may start before `begin`, the last may end after `end`;
  // such a row is split (shared with the neighbouring workers).
  const int first_row = static_cast<int>(begin / kv), last_row = len > 0 ? static_cast<int>((end - 1) / kv) : first_row;
  const bool first_split = len > 0 && (int64_t{first_row} * kv < begin || int64_t{first_row + 1} * kv > end);
  const bool last_split = len > 0 && (int64_t{last_row} * kv < begin || int64_t{last_row + 1} * kv > end);
  // The worker that holds the first vector of its split last row adds that row's partials up.
  const bool owner = last_split && int64_t{last_row} * kv >= begin;
  int row = first_row;  // the row `acc` holds
  // Lane t < kRows: the old y[t, row] when accumulating, loaded when the warp enters the row.
  float old = p.accumulate && lane < kRows && len > 0 ? load_y<T>(p, lane, row) : 0.0f;
  int boundary = static_cast<int>(int64_t{first_row + 1} * kv - begin);  // range offset where row + 1 starts
  float acc[kRows], next[kRows];
#pragma unroll
  for (int t = 0; t < kRows; ++t) acc[t] = next[t] = 0.0f;

  // The warp has left `row`: add the lanes' sums, write the row or leave its partial sums.
  auto finish_row = [&]() {
    float mine = 0.0f;
#pragma unroll
    for (int t = 0; t < kRows; ++t) {
      const float sum = warp_sum(acc[t]);
      if (lane == t) mine = sum;
    }
    const bool split_row = (row == first_row && first_split) || (row == last_row && last_split);
    if (lane < kRows) {
      if (!split_row) {
        store_y<T>(p, lane, row, mine, old);
      } else {
        partials[(warp * 2 + (row == first_row ? 0 : 1)) * kRows + lane] = mine;
      }
    }
  };

  const int steps = (len + 31) / 32;
  int slot = 0;  // step s's ring slot: s % kRingSteps; the refill goes one slot behind it
  for (int s0 = 0; s0 < steps; s0 += kBatch) {
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int s = s0 + i;
      if (s < steps) {  // warp-uniform
        // Step s's group is complete when at most kRingSteps - 2 later groups are pending; its slot is
        // read back by the lane that copied it. The next copy refills the slot step s - 1 read.
        gg::cp_async_wait<kRingSteps - 2>();
        const uint4 weights = lane_ring[slot * 32];
        issue(slot == 0 ? kRingSteps - 1 : slot - 1);
        slot = slot + 1 == kRingSteps ? 0 : slot + 1;
        float d[kRows];
        dot8<T, kRows>(d, weights, xs, column, kv);
        const int v = 32 * s + lane;
        const bool valid = v < len, in_next = v >= boundary;
#pragma unroll
        for (int t = 0; t < kRows; ++t) {
          const float value = valid ? d[t] : 0.0f;
          acc[t] += in_next ? 0.0f : value;
          next[t] += in_next ? value : 0.0f;
        }
        column += 32;
        if (column >= kv) column -= kv;
        if (32 * (s + 1) >= boundary && boundary < len) {  // every later vector is past `row`
          finish_row();
#pragma unroll
          for (int t = 0; t < kRows; ++t) {
            acc[t] = next[t];
            next[t] = 0.0f;
          }
          ++row;
          boundary += kv;
          if (p.accumulate && lane < kRows) old = load_y<T>(p, lane, row);
        }
      }
    }
  }
  if (len > 0) finish_row();  // the range's last row
  gg::cp_async_wait<0>();     // the ring's last (zero-filling) copies land before the CTA can exit

  // Split rows: the owner adds every worker's partials of the row in worker order, then writes it.
  cluster_barrier(p.split);
  if (owner && lane < kRows) {
    const ClusterRange range = cluster_range(p, warps);
    // The worker holding the row's last vector: the last q with begin(q) < the row's end.
    const int64_t row_end = int64_t{last_row + 1} * kv - range.first;
    const int last_worker = static_cast<int>((row_end * range.workers - 1) / range.length);
    float value = partials[(warp * 2 + (last_row == first_row ? 0 : 1)) * kRows + lane];
    for (int q = me + 1; q <= last_worker; ++q) {
      if (range.begin(q) == range.begin(q + 1)) continue;  // an empty range (more workers than vectors)
      const float* from = cluster_shared(partials, q / warps, p.split);
      value += from[((q % warps) * 2 + 0) * kRows + lane];  // the row is worker q's first
    }
    store_y<T>(p, lane, last_row, value, old);  // old: y[lane, last_row], the row `acc` held last
  }
  if (p.split > 1) cluster_barrier(p.split);  // every CTA's partials stay until they are read
}

// Short rows (kv < 32): whole rows per warp, a group of p.group lanes per row, 32 / group rows a step.
// Shared memory: x [kRows][kv] vectors. The launch protocol is the long-row kernel's.
template <class T, int kRows>
__global__ void __launch_bounds__(kMaxWarps * 32, 1) gemv_short_kernel(const GemvParams p) {
  extern __shared__ uint4 smem[];
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  const int warps = static_cast<int>(blockDim.x) >> 5;
  const int group = p.group, per_step = 32 / group, kv = p.kv;
  const int workers = static_cast<int>(gridDim.x) * warps, me = static_cast<int>(blockIdx.x) * warps + warp;
  const int64_t first = p.n * me / workers;
  const int rows = static_cast<int>(p.n * (me + 1) / workers - first);
  const int slot = lane / group, column = lane % group;
  const bool column_valid = column < kv;
  const int steps = (rows + per_step - 1) / per_step;
  const int lane_steps = column_valid && rows > slot ? (rows - slot + per_step - 1) / per_step : 0;
  const int64_t advance = per_step * (p.ldw / 8);
  const uint4* source = static_cast<const uint4*>(p.w) + (first + slot) * (p.ldw / 8) + column;
  const uint64_t policy = gg::evict_first_policy();
  int issued = 0;
  auto issue = [&](uint4& target) {
    target = issued < lane_steps ? gg::stream_load(source, policy) : make_uint4(0, 0, 0, 0);
    ++issued;
    source += advance;
  };
  uint4 ring[kBatch];
#pragma unroll
  for (int i = 0; i < kBatch; ++i) issue(ring[i]);  // before the wait: W is never written in a forward

  pdl_wait();  // x and y: the previous kernel's
  pdl_trigger();
  uint4* xs = smem;
  stage_x<kRows>(p, xs);

  // The writing lanes (column 0) load the old y of their row a step before they need it (accumulate).
  auto load_old = [&](int s, float(&old)[kRows]) {
    const int local = s * per_step + slot;
#pragma unroll
    for (int t = 0; t < kRows; ++t) {
      old[t] = p.accumulate && column == 0 && local < rows ? load_y<T>(p, t, first + local) : 0.0f;
    }
  };
  float old[kRows];
  load_old(0, old);
  for (int s0 = 0; s0 < steps; s0 += kBatch) {
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int s = s0 + i;
      if (s < steps) {  // warp-uniform
        const uint4 weights = ring[i];
        issue(ring[i]);
        float upcoming[kRows];
        load_old(s + 1, upcoming);
        float d[kRows];
        dot8<T, kRows>(d, weights, xs, column_valid ? column : 0, kv);
        const int local = s * per_step + slot;
        const bool valid = column_valid && local < rows;
#pragma unroll
        for (int t = 0; t < kRows; ++t) {
          float value = valid ? d[t] : 0.0f;
          for (int offset = group >> 1; offset > 0; offset >>= 1) value += __shfl_xor_sync(kFullMask, value, offset);
          d[t] = value;
        }
        if (column == 0 && local < rows) {
#pragma unroll
          for (int t = 0; t < kRows; ++t) store_y<T>(p, t, first + local, d[t], old[t]);
        }
#pragma unroll
        for (int t = 0; t < kRows; ++t) old[t] = upcoming[t];
      }
    }
  }
}

// Warp rows (GemvKernel::warp_rows, long rows; the only kernel of gemv_gate_up). The rows are dealt
// round-robin over the grid's *teams* of `team` consecutive warps of one CTA (team 1 unless rows are too
// few to fill the GPU: gemv_warp_rows_launch): row r is team r % teams's. A row is a run of `row vectors`
// (kv; 2 kv for gate/up, whose gate row comes first and up row second) cut into `team` segments of
// `segment` vectors (a multiple of 32), member m taking [m segment, (m + 1) segment). A warp walks its
// segment of each of its rows as a sequence of batches of kWarpRowsLoads steps (32 vectors a step, a
// lane's vectors of the batch in registers), with two batches in flight: the loads of batch i + 1 (of the
// same row or the warp's next) are issued before batch i is multiplied with x from shared memory, so a
// warp never waits for a whole round trip between batches, nor between rows. A lane adds its products in
// column order and the lanes' sums are added by the butterfly of warp_sum. Team 1: lane t finishes
// y[t, r] at once. Team > 1: lane 0 of each member writes its sums to `partials` (two slots, by the
// parity of the team's row count, so one barrier per row suffices: a member writes a slot again only
// after the next row's barrier, which the leader reaches after it has read the slot), the team meets at
// its named barrier, and lane t of member 0 adds the members' sums in member order and finishes y[t, r].
// The order of every sum is fixed by k and the team, so the bits do not depend on the grid. Finishing
// applies the epilogue to the fp32 sums (gate/up: act(gate, up); relu2; none: the old y added when
// accumulating) and rounds once. The launch protocol is the file comment's: a warp's first batch is
// issued before pdl_wait().
constexpr int kWarpRowsLoads = 4;                    // steps (16 bytes a lane each) per batch; two batches in flight
constexpr int kWarpRowsWarps = 16;                   // warps per CTA by default
constexpr int kWarpRowsBatch = 32 * kWarpRowsLoads;  // vectors per batch and warp
constexpr int kMaxTeam = 16;

// 512-thread CTAs per SM the kernel is compiled for: two (64 registers a thread) at one x row; from two
// rows 64 registers spilled (ptxas), so one with more registers.
constexpr int warp_rows_ctas_per_sm(int rows) { return rows == 1 ? 2 : 1; }

// What the warp-rows kernel does with a row's fp32 sums before it rounds them.
enum class Epilogue { none, relu2, gated };

// The sums a warp keeps per x row: gate and up for gate/up.
constexpr int sums_of(Epilogue epilogue) { return epilogue == Epilogue::gated ? 2 : 1; }

// Team > 1: the members' sums [parity][warp of the CTA][sum][x row], after x in shared memory.
size_t warp_rows_partial_bytes(int warps, int sums, int64_t rows) {
  return 2 * static_cast<size_t>(warps) * static_cast<size_t>(sums) * static_cast<size_t>(rows) * sizeof(float);
}

// The team's barrier: named barrier 1 + the team's index in the CTA (0 is __syncthreads'), team x 32 threads.
__device__ __forceinline__ void team_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// x in shared memory replaced by RMSNorm(x) (gemv_rms_norm), each value as the RMSNorm kernel
// (kernels/norm.cu) computes it: x · (1 / sqrt(mean(x²) + eps)) · gamma in fp32, rounded once to T.
// Every warp sums the squares of each x row itself, lane-strided over the row's vectors in a fixed
// order, so every warp and every grid gets the same bits without a reduction across warps; a barrier
// lets every warp finish reading x before any of it is overwritten, another ends the rewrite. After
// stage_x (and its barrier) only.
template <class T, int kRows>
__device__ __forceinline__ void normalise_x(const GemvParams& p, uint4* xs) {
  const int lane = static_cast<int>(threadIdx.x) & 31, kv = p.kv;
  float inverse_rms[kRows];
#pragma unroll
  for (int t = 0; t < kRows; ++t) {
    float squares = 0.0f;
    for (int v = lane; v < kv; v += 32) {
      float x[8];
      widen8<T>(xs[t * kv + v], x);
#pragma unroll
      for (int e = 0; e < 8; ++e) squares = fmaf(x[e], x[e], squares);
    }
    inverse_rms[t] = 1.0f / sqrtf(warp_sum(squares) / static_cast<float>(8 * kv) + p.eps);
  }
  __syncthreads();
  for (int i = static_cast<int>(threadIdx.x); i < kRows * kv; i += static_cast<int>(blockDim.x)) {
    const int t = (i >= kv) + (i >= 2 * kv) + (i >= 3 * kv), column = i - t * kv;  // kRows <= 4
    float scale = inverse_rms[0];
#pragma unroll
    for (int r = 1; r < kRows; ++r) scale = t == r ? inverse_rms[r] : scale;
    float x[8];
    widen8<T>(xs[i], x);
    alignas(16) T out[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      out[e] = from_float<T>(x[e] * scale * load_as_float_dev(p.gamma, p.gamma_dtype, int64_t{8} * column + e));
    }
    xs[i] = *reinterpret_cast<const uint4*>(out);
  }
  __syncthreads();
}

// A row's value before its rounding: the activation of gate/up's fp32 sums (the fast forms, as the
// skinny kernels), relu2 of the sum, or the sum (store_y adds the old y when accumulating).
template <Epilogue kEpilogue>
__device__ __forceinline__ float finish(const GemvParams& p, float sum, float up) {
  if constexpr (kEpilogue == Epilogue::gated) {
    return act::gated<true>(sum, up, p.situ, p.situ_beta, p.situ_linear_beta);
  } else if constexpr (kEpilogue == Epilogue::relu2) {
    return act::relu2(sum);
  } else {
    return sum;
  }
}

template <class T, int kRows, Epilogue kEpilogue>
__global__ void __launch_bounds__(kMaxWarps * 32, warp_rows_ctas_per_sm(kRows))
    gemv_warp_rows_kernel(const GemvParams p) {
  extern __shared__ uint4 smem[];  // x [kRows][kv] vectors, then (team > 1) the members' partial sums
  constexpr bool kGated = kEpilogue == Epilogue::gated;
  constexpr int kSums = sums_of(kEpilogue);
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  const int warps_per_cta = static_cast<int>(blockDim.x) >> 5;
  const int team = p.team, member = warp % team;  // the host makes team divide warps_per_cta
  const int64_t teams = int64_t{gridDim.x} * (warps_per_cta / team);
  const int kv = p.kv;
  const int begin = member * p.segment, end = min(kGated ? 2 * kv : kv, begin + p.segment);
  const int64_t ldw = p.ldw / 8;
  const uint4* w = static_cast<const uint4*>(p.w);
  const uint4* gate = static_cast<const uint4*>(p.gate);
  const uint64_t policy = gg::evict_first_policy();
  // A batch: this lane's vectors (start + lane + 32 j, j < kWarpRowsLoads) of a row's segment. `start`
  // is the batch's first column, the same in every lane, so every branch on it is warp-uniform but the
  // end of the segment and, for gate/up, the gate/up boundary.
  auto load = [&](uint4(&batch)[kWarpRowsLoads], int64_t row, int start) {
#pragma unroll
    for (int j = 0; j < kWarpRowsLoads; ++j) {
      const int column = start + lane + 32 * j;
      if (column < end) {
        const uint4* source =
            kGated && column < kv ? gate + row * ldw + column : w + row * ldw + (kGated ? column - kv : column);
        batch[j] = gg::stream_load(source, policy);
      }
    }
  };
  // The batch after (row, start) in this warp's walk.
  auto advance = [&](int64_t& row, int& start) {
    start += kWarpRowsBatch;
    if (start >= end) {
      start = begin;
      row += teams;
    }
  };
  int64_t row = int64_t{blockIdx.x} * (warps_per_cta / team) + warp / team;
  int start = begin;
  uint4 current[kWarpRowsLoads], upcoming[kWarpRowsLoads];
  if (row < p.n) load(current, row, start);  // before the wait: W is never written in a forward

  pdl_wait();  // x and y: the previous kernel's
  pdl_trigger();
  const uint4* xs = smem;
  stage_x<kRows>(p, smem);
  if (p.gamma != nullptr) normalise_x<T, kRows>(p, smem);
  float* partials = reinterpret_cast<float*>(smem + kRows * kv);
  int parity = 0;

  int64_t next_row = row;
  int next_start = start;
  advance(next_row, next_start);
  const bool leader = member == 0 && lane < kRows;
  float old = kEpilogue == Epilogue::none && p.accumulate && leader && row < p.n ? load_y<T>(p, lane, row) : 0.0f;
  float acc[kRows], acc_up[kRows];
#pragma unroll
  for (int t = 0; t < kRows; ++t) acc[t] = acc_up[t] = 0.0f;
  while (row < p.n) {
    if (next_row < p.n) load(upcoming, next_row, next_start);  // in flight while `current` is multiplied
#pragma unroll
    for (int j = 0; j < kWarpRowsLoads; ++j) {
      const int column = start + lane + 32 * j;
      if (column < end) {
        const bool second = kGated && column >= kv;  // an up vector of gate/up
        float d[kRows];
        dot8<T, kRows>(d, current[j], xs, second ? column - kv : column, kv);
#pragma unroll
        for (int t = 0; t < kRows; ++t) {
          if (second) {
            acc_up[t] += d[t];
          } else {
            acc[t] += d[t];
          }
        }
      }
    }
    if (next_row != row) {  // the segment's last batch: add the lanes' sums and finish the row
      float sum[kRows], sum_up[kRows];
#pragma unroll
      for (int t = 0; t < kRows; ++t) {
        sum[t] = warp_sum(acc[t]);
        sum_up[t] = kGated ? warp_sum(acc_up[t]) : 0.0f;
        acc[t] = acc_up[t] = 0.0f;
      }
      if (team > 1) {
        float* slot = partials + static_cast<size_t>(parity * warps_per_cta) * kSums * kRows;
        if (lane == 0) {
#pragma unroll
          for (int t = 0; t < kRows; ++t) {
            slot[(warp * kSums) * kRows + t] = sum[t];
            if (kGated) slot[(warp * kSums + 1) * kRows + t] = sum_up[t];
          }
        }
        team_barrier(1 + warp / team, team * 32);
        if (leader) {
          float total = 0.0f, total_up = 0.0f;
          for (int m = 0; m < team; ++m) {
            total += slot[((warp + m) * kSums) * kRows + lane];
            if (kGated) total_up += slot[((warp + m) * kSums + 1) * kRows + lane];
          }
#pragma unroll
          for (int t = 0; t < kRows; ++t) {
            if (lane == t) sum[t] = total, sum_up[t] = total_up;
          }
        }
        parity ^= 1;
      }
      float mine = 0.0f, mine_up = 0.0f;
#pragma unroll
      for (int t = 0; t < kRows; ++t) {
        if (lane == t) mine = sum[t], mine_up = sum_up[t];
      }
      if (leader) store_y<T>(p, lane, row, finish<kEpilogue>(p, mine, mine_up), old);  // old: 0 unless accumulating
      if (kEpilogue == Epilogue::none && p.accumulate && leader && next_row < p.n) old = load_y<T>(p, lane, next_row);
    }
    row = next_row;
    start = next_start;
#pragma unroll
    for (int j = 0; j < kWarpRowsLoads; ++j) current[j] = upcoming[j];
    advance(next_row, next_start);
  }
}

// --- launcher --------------------------------------------------------------------------------------

struct Plan {
  bool short_rows = false;
  bool warp_rows = false;  // GemvKernel::warp_rows (long rows only); clusters then counts CTAs
  int warps = kDefaultWarps;
  int split = 1;
  int clusters = 1;
  int team = 1;     // warp rows
  int segment = 0;  // warp rows
  size_t shared = 0;
  Epilogue epilogue = Epilogue::none;
};

bool aligned_rows(const void* data, int64_t ld, int64_t rows) {
  return reinterpret_cast<uintptr_t>(data) % 16 == 0 && (rows <= 1 || ld % 8 == 0);  // 8 x 2 bytes
}

// Why gemv() does not take these operands, or "" when it does.
std::string unsupported(DType dtype, int64_t rows, int64_t n, int64_t k, const void* x, int64_t ldx, const void* w,
                        int64_t ldw) {
  // The message is formatted only when a rule fails: linear() asks on every decode call, where all hold.
  auto why = [](const auto&... parts) {
    std::ostringstream message;
    (message << ... << parts);
    return message.str();
  };
  if (dtype != DType::bf16 && dtype != DType::f16) return why("dtype ", dtype_name(dtype), " (bf16 or f16 only)");
  if (rows < 1 || rows > kGemvMaxRows) return why(rows, " rows (1..", kGemvMaxRows, ", kGemvMaxRows)");
  if (n < 1 || n > INT_MAX) return why("n = ", n, " output columns (1..", INT_MAX, ")");
  if (k < 8 || k % 8 != 0) return why("k = ", k, " is not a positive multiple of 8");
  if (k > kGemvMaxK) {
    return why("k = ", k, " exceeds the limit kGemvMaxK = ", kGemvMaxK, " (x is staged in shared memory)");
  }
  if (x == nullptr || w == nullptr) return why(x == nullptr ? "x" : "W", " is null");
  if (ldx < k || ldw < k) {
    return why(ldx < k ? "x" : "W", " row stride ", ldx < k ? ldx : ldw, " is shorter than k = ", k);
  }
  if (!aligned_rows(x, ldx, rows)) {
    return why("x rows are not 16-byte aligned (address ", x, ", row stride ", ldx, " elements)");
  }
  if (!aligned_rows(w, ldw, n)) {
    return why("W rows are not 16-byte aligned (address ", w, ", row stride ", ldw, " elements)");
  }
  if (current_compute_capability() < 80) {
    return why("compute capability ", current_compute_capability(), " (8.0 or later)");
  }
  return {};
}

// Vectors of the most loaded CTA with `split` CTAs per cluster over `grid` CTAs (long rows).
int64_t most_vectors_per_cta(int64_t n, int64_t kv, int64_t grid, int split) {
  const int64_t clusters = std::max<int64_t>(1, grid / split);
  return ((n + clusters - 1) / clusters * kv + split - 1) / split;
}

// Not yet measured: split 2 where it lightens the most loaded CTA by 1 % or more (Kimi-K3's W_down on
// 132 SMs: 27.5 rows per CTA against 28), 4 or 8 only where that saves 10 % more (few long rows: a
// cluster of 4 or 8 may not find its SMs free in one GPC as readily).
int choose_split(int64_t n, int64_t kv, int64_t grid) {
  if (current_compute_capability() < 90) return 1;
  int best = 1;
  int64_t best_load = most_vectors_per_cta(n, kv, grid, 1);
  for (int split = 2; split <= kMaxSplit && split <= grid; split *= 2) {
    const int64_t load = most_vectors_per_cta(n, kv, grid, split);
    const double keep = split == 2 ? 0.99 : 0.9;
    if (static_cast<double>(load) < keep * static_cast<double>(best_load)) {
      best = split;
      best_load = load;
    }
  }
  return best;
}

// The warp-rows plan: gemv_warp_rows_launch (below) on this GPU.
Plan choose_warp_rows_plan(int64_t rows, int64_t n, int64_t k, Epilogue epilogue, const GemvShape& shape) {
  const GemvWarpRowsLaunch launch = gemv_warp_rows_launch(rows, n, k, epilogue == Epilogue::gated, current_sm_count(),
                                                          static_cast<size_t>(current_shared_memory_optin()), shape);
  Plan plan;
  plan.warp_rows = true;
  plan.warps = launch.warps;
  plan.split = 1;
  plan.shared = launch.shared_bytes;
  plan.clusters = launch.ctas;
  plan.team = launch.team;
  plan.segment = launch.segment;
  plan.epilogue = epilogue;
  return plan;
}

Plan choose_plan(int64_t rows, int64_t n, int64_t k, const GemvShape& shape) {
  check_cluster_shape("GEMV", shape.warps, kMaxWarps, shape.split, shape.clusters);
  const int64_t kv = k / 8;
  if (kv >= kLongRowVectors && shape.kernel != GemvKernel::ring) {
    LATENTMOE_CHECK(shape.split <= 1, "GEMV: split ", shape.split,
                    " applies to the ring kernel only (GemvKernel::ring); the warp-rows kernel splits no row");
    return choose_warp_rows_plan(rows, n, k, Epilogue::none, shape);
  }
  Plan plan;
  plan.short_rows = kv < kLongRowVectors;
  // Shared memory: x, and for long rows each warp's ring and two partial sums per x row.
  const size_t optin = static_cast<size_t>(current_shared_memory_optin());
  const size_t x_bytes = static_cast<size_t>(rows * kv) * sizeof(uint4);
  const size_t per_warp = plan.short_rows ? 0 : kRingBytesPerWarp + 2 * static_cast<size_t>(rows) * sizeof(float);
  if (shape.warps > 0) {
    plan.warps = shape.warps;
  } else {
    // As many warps as kDefaultWarps and the shared memory left by x allow (x of kGemvMaxK at four rows
    // leaves room for 12).
    const size_t fit = per_warp == 0 || x_bytes >= optin ? kDefaultWarps : (optin - x_bytes) / per_warp;
    plan.warps = static_cast<int>(std::clamp<size_t>(fit, 1, kDefaultWarps));
  }
  const int64_t per_cta = int64_t{plan.warps} * 32 * kMinBatchSteps;
  const int64_t grid = std::clamp<int64_t>((n * kv + per_cta - 1) / per_cta, 1, current_sm_count());
  // Short rows never split a row: their kernel takes no clusters, whatever the shape asks.
  plan.split = plan.short_rows ? 1 : (shape.split > 0 ? shape.split : choose_split(n, kv, grid));
  const int64_t clusters = shape.clusters > 0 ? shape.clusters : std::max<int64_t>(1, grid / plan.split);
  LATENTMOE_CHECK(clusters * plan.split <= INT_MAX, "GEMV: ", clusters, " clusters exceed the grid");
  plan.clusters = static_cast<int>(clusters);
  // The per-warp counters are 32-bit: the longest range (vectors, or rows for short rows) must fit.
  const int64_t cluster_rows = (n + clusters - 1) / clusters;
  const int64_t longest = plan.short_rows
                              ? cluster_rows
                              : (cluster_rows * kv + plan.split * plan.warps - 1) / (int64_t{plan.split} * plan.warps);
  LATENTMOE_CHECK(longest <= INT_MAX - 64 * 32, "GEMV: ", n, " x ", k, " is too large for ", plan.clusters,
                  " clusters of ", plan.split, " x ", plan.warps, " warps");
  plan.shared = x_bytes + static_cast<size_t>(plan.warps) * per_warp;
  LATENTMOE_CHECK(plan.shared <= optin, "GEMV: ", plan.shared, " bytes of shared memory (x and ", plan.warps,
                  " warps' copy rings) exceed the device's ", optin);
  return plan;
}

// Sets a kernel's dynamic shared-memory limit to the device's, once per device.
void open_shared_memory(const void* kernel, std::atomic<uint64_t>* devices_done) {
  int device = 0;
  LATENTMOE_CUDA_CHECK(cudaGetDevice(&device));
  const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
  if (bit != 0 && (devices_done->load(std::memory_order_acquire) & bit) != 0) return;
  LATENTMOE_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, current_shared_memory_optin()));
  devices_done->fetch_or(bit, std::memory_order_acq_rel);
}

template <class T, int kRows>
void launch(const GemvParams& params, const Plan& plan, cudaStream_t stream) {
  if (plan.warp_rows) {
    auto run = [&](auto* kernel, std::atomic<uint64_t>* done) {
      open_shared_memory(reinterpret_cast<const void*>(kernel), done);
      launch_kernel_clustered("gemv_warp_rows_kernel", pdl_supported(), 1, kernel,
                              dim3(static_cast<unsigned>(plan.clusters)), dim3(static_cast<unsigned>(plan.warps * 32)),
                              plan.shared, stream, params);
    };
    static std::atomic<uint64_t> plain_done{0}, relu2_done{0}, gated_done{0};
    switch (plan.epilogue) {
      case Epilogue::none:
        return run(gemv_warp_rows_kernel<T, kRows, Epilogue::none>, &plain_done);
      case Epilogue::relu2:
        return run(gemv_warp_rows_kernel<T, kRows, Epilogue::relu2>, &relu2_done);
      case Epilogue::gated:
        return run(gemv_warp_rows_kernel<T, kRows, Epilogue::gated>, &gated_done);
    }
    return;
  }
  static std::atomic<uint64_t> rows_done{0}, short_done{0};
  auto* kernel = plan.short_rows ? gemv_short_kernel<T, kRows> : gemv_rows_kernel<T, kRows>;
  open_shared_memory(reinterpret_cast<const void*>(kernel), plan.short_rows ? &short_done : &rows_done);
  const unsigned split = static_cast<unsigned>(plan.split);
  launch_kernel_clustered(plan.short_rows ? "gemv_short_kernel" : "gemv_rows_kernel", pdl_supported(), split, kernel,
                          dim3(static_cast<unsigned>(plan.clusters) * split),
                          dim3(static_cast<unsigned>(plan.warps * 32)), plan.shared, stream, params);
}

template <class T>
void launch_rows(int64_t rows, const GemvParams& params, const Plan& plan, cudaStream_t stream) {
  switch (rows) {
    case 1:
      return launch<T, 1>(params, plan, stream);
    case 2:
      return launch<T, 2>(params, plan, stream);
    case 3:
      return launch<T, 3>(params, plan, stream);
    default:
      return launch<T, 4>(params, plan, stream);
  }
}

}  // namespace

// The team: 1, or where the rows are too few to give every warp slot of the GPU a row, the largest power
// of two (up to 16) for which n x team warps still fit in the GPU's slots (SMs x CTAs per SM x 16) and
// each member's segment holds at least one batch: a row's round trips are then shared by `team` warps
// (Kimi-K3's shared expert at tp 8, 768 gate/up rows of 2 x 896 vectors: team 4 on 132 SMs). Warps per
// CTA: shape.warps, or 16, or fewer when n x team is too few to give every SM a CTA of 16 (Nemotron's
// W_down, 1024 rows: team 4, 16 warps), a multiple of the team; as many CTAs as the teams need, at most
// as many per SM as the kernel is compiled for (one when x leaves room for one), or shape.clusters.
// A forced shape.team applies as given (it must divide the CTA's warps); with shape.warps forced and the
// team not, the rule's team is also capped by the largest power of two dividing the warps.
// shape.ctas_per_sm caps the CTAs per SM (and with them the warp slots the team rule counts).
GemvWarpRowsLaunch gemv_warp_rows_launch(int64_t rows, int64_t n, int64_t k, bool gate_up, int64_t sms,
                                         size_t shared_optin, const GemvShape& shape) {
  LATENTMOE_CHECK(rows >= 1 && rows <= kGemvMaxRows && n >= 1 && k >= 8 && sms >= 1, "GEMV: no warp-rows launch for ",
                  rows, " rows of a [", n, ", ", k, "] W on ", sms, " SMs");
  LATENTMOE_CHECK(shape.team >= 0 && shape.team <= kMaxTeam && (shape.team & (shape.team - 1)) == 0, "GEMV: a team of ",
                  shape.team, " warps (a power of two up to ", kMaxTeam, ")");
  GemvWarpRowsLaunch launch;
  const int64_t row_vectors = (gate_up ? 2 : 1) * (k / 8);
  const size_t x_bytes = static_cast<size_t>(rows * (k / 8)) * sizeof(uint4);
  LATENTMOE_CHECK(x_bytes <= shared_optin, "GEMV: x takes ", x_bytes,
                  " bytes of shared memory, more than the device's ", shared_optin);
  // CTAs of one SM share its shared memory (optin is what one CTA may take, about the SM's whole).
  const int compiled_for = warp_rows_ctas_per_sm(static_cast<int>(rows));
  const size_t largest_partials = warp_rows_partial_bytes(kMaxWarps, gate_up ? 2 : 1, rows);
  const int fit_per_sm = (x_bytes + largest_partials) * compiled_for <= shared_optin ? compiled_for : 1;
  LATENTMOE_CHECK(shape.ctas_per_sm >= 0, "GEMV: ", shape.ctas_per_sm, " CTAs per SM");
  const int per_sm = shape.ctas_per_sm > 0 ? std::min(shape.ctas_per_sm, fit_per_sm) : fit_per_sm;
  int team = shape.team;
  if (team == 0) {
    team = 1;
    const int64_t slots = sms * per_sm * kWarpRowsWarps;
    while (team < kMaxTeam && n * 2 * team <= slots && row_vectors >= int64_t{2 * team} * kWarpRowsBatch &&
           (shape.warps <= 0 || shape.warps % (2 * team) == 0)) {
      team *= 2;
    }
  }
  launch.team = team;
  launch.segment = static_cast<int>(((row_vectors + team - 1) / team + 31) / 32 * 32);
  const int64_t team_warps = n * team;
  launch.warps =
      shape.warps > 0
          ? shape.warps
          : static_cast<int>((std::clamp<int64_t>((team_warps + sms - 1) / sms, team, kWarpRowsWarps) + team - 1) /
                             team * team);
  LATENTMOE_CHECK(launch.warps % team == 0, "GEMV: a team of ", team, " warps does not divide a CTA of ", launch.warps,
                  " warps");
  launch.shared_bytes = x_bytes + (team > 1 ? warp_rows_partial_bytes(launch.warps, gate_up ? 2 : 1, rows) : 0);
  LATENTMOE_CHECK(launch.shared_bytes <= shared_optin, "GEMV: x and the partial sums take ", launch.shared_bytes,
                  " bytes of shared memory, more than the device's ", shared_optin);
  const int64_t needed = (team_warps + launch.warps - 1) / launch.warps;
  const int64_t ctas = shape.clusters > 0 ? shape.clusters : std::clamp<int64_t>(needed, 1, sms * per_sm);
  LATENTMOE_CHECK(ctas <= INT_MAX, "GEMV: ", ctas, " CTAs exceed the grid");
  launch.ctas = static_cast<int>(ctas);
  return launch;
}

bool gemv_supported(DType dtype, int64_t rows, int64_t n, int64_t k, const void* x, int64_t ldx, const void* w,
                    int64_t ldw) {
  return unsupported(dtype, rows, n, k, x, ldx, w, ldw).empty();
}

namespace {

GemvParams make_params(const void* x, int64_t ldx, const void* w, int64_t ldw, int64_t n, int64_t k, void* y,
                       int64_t ldy, bool accumulate, const Plan& plan) {
  GemvParams params;
  params.x = x;
  params.ldx = ldx;
  params.w = w;
  params.ldw = ldw;
  params.y = y;
  params.ldy = ldy;
  params.n = n;
  params.kv = static_cast<int>(k / 8);
  params.split = plan.split;
  params.group = 1;
  while (params.group < params.kv) params.group *= 2;
  params.accumulate = accumulate;
  params.team = plan.team;
  params.segment = plan.segment;
  return params;
}

void launch_dtype(DType dtype, int64_t rows, const GemvParams& params, const Plan& plan, cudaStream_t stream) {
  static_assert(kGemvMaxRows == 4, "stage_x and launch_rows handle up to 4 rows");
  if (dtype == DType::bf16) {
    launch_rows<__nv_bfloat16>(rows, params, plan, stream);
  } else {
    launch_rows<__half>(rows, params, plan, stream);
  }
}

// The plan of a call that only the warp-rows kernel runs (gemv_gate_up, gemv_rms_norm), after the checks
// on y and on the shape that such a call adds to the operand rules; `what` names the call in messages.
Plan warp_rows_only_plan(const char* what, int64_t rows, int64_t n, int64_t k, const void* y, int64_t ldy,
                         Epilogue epilogue, const GemvShape& shape) {
  LATENTMOE_CHECK(y != nullptr, what, ": y is null");
  LATENTMOE_CHECK(ldy >= n, what, ": y row stride ", ldy, " is shorter than n = ", n);
  LATENTMOE_CHECK(shape.kernel != GemvKernel::ring && shape.split <= 1, what,
                  ": runs on the warp-rows kernel only (no ring, no split)");
  check_cluster_shape("GEMV", shape.warps, kMaxWarps, 1, shape.clusters);
  return choose_warp_rows_plan(rows, n, k, epilogue, shape);
}

// Why gemv_gate_up() does not take these operands, or "".
std::string gate_up_unsupported(DType dtype, Activation activation, int64_t rows, int64_t n, int64_t k, const void* x,
                                int64_t ldx, const void* gate, const void* up, int64_t ldw) {
  std::string why = unsupported(dtype, rows, n, k, x, ldx, up, ldw);
  if (!why.empty()) return why;
  const bool gated = activation != Activation::relu2;
  if (gated && gate == nullptr) {
    return std::string("the gate matrix is null (").append(to_string(activation)).append(" is gated)");
  }
  if (!gated && gate != nullptr) return "a gate matrix was given for relu2, which has none";
  if (gated && !aligned_rows(gate, ldw, n)) return "gate rows are not 16-byte aligned";
  return {};
}

}  // namespace

void gemv(DType dtype, const void* x, int64_t ldx, int64_t rows, const void* w, int64_t ldw, int64_t n, int64_t k,
          void* y, int64_t ldy, bool accumulate, cudaStream_t stream, const GemvShape& shape) {
  const std::string why = unsupported(dtype, rows, n, k, x, ldx, w, ldw);
  LATENTMOE_CHECK(why.empty(), "GEMV: not a GEMV problem: ", why);
  LATENTMOE_CHECK(y != nullptr, "GEMV: y is null");
  LATENTMOE_CHECK(ldy >= n, "GEMV: y row stride ", ldy, " is shorter than n = ", n);
  const Plan plan = choose_plan(rows, n, k, shape);
  launch_dtype(dtype, rows, make_params(x, ldx, w, ldw, n, k, y, ldy, accumulate, plan), plan, stream);
}

bool gemv_rms_norm_supported(DType dtype, int64_t rows, int64_t n, int64_t k, const void* x, int64_t ldx,
                             const void* gamma, DType gamma_dtype, const void* w, int64_t ldw) {
  return gamma != nullptr && is_compute_dtype(gamma_dtype) && gemv_supported(dtype, rows, n, k, x, ldx, w, ldw);
}

void gemv_rms_norm(DType dtype, const void* x, int64_t ldx, int64_t rows, const void* gamma, DType gamma_dtype,
                   float eps, const void* w, int64_t ldw, int64_t n, int64_t k, void* y, int64_t ldy, bool accumulate,
                   cudaStream_t stream, const GemvShape& shape) {
  const std::string why = unsupported(dtype, rows, n, k, x, ldx, w, ldw);
  LATENTMOE_CHECK(why.empty(), "GEMV RMSNorm: not a GEMV problem: ", why);
  LATENTMOE_CHECK(gamma != nullptr, "GEMV RMSNorm: gamma is null");
  LATENTMOE_CHECK(is_compute_dtype(gamma_dtype), "GEMV RMSNorm: gamma dtype ", dtype_name(gamma_dtype),
                  " (f32, bf16 or f16)");
  const Plan plan = warp_rows_only_plan("GEMV RMSNorm", rows, n, k, y, ldy, Epilogue::none, shape);
  GemvParams params = make_params(x, ldx, w, ldw, n, k, y, ldy, accumulate, plan);
  params.gamma = gamma;
  params.gamma_dtype = gamma_dtype;
  params.eps = eps;
  launch_dtype(dtype, rows, params, plan, stream);
}

bool gemv_gate_up_supported(DType dtype, Activation activation, int64_t rows, int64_t n, int64_t k, const void* x,
                            int64_t ldx, const void* gate, const void* up, int64_t ldw) {
  return gate_up_unsupported(dtype, activation, rows, n, k, x, ldx, gate, up, ldw).empty();
}

void gemv_gate_up(DType dtype, const ::latentmoe::detail::ActivationParams& activation, const void* x, int64_t ldx,
                  int64_t rows, const void* gate, const void* up, int64_t ldw, int64_t n, int64_t k, void* y,
                  int64_t ldy, cudaStream_t stream, const GemvShape& shape) {
  const std::string why = gate_up_unsupported(dtype, activation.activation, rows, n, k, x, ldx, gate, up, ldw);
  LATENTMOE_CHECK(why.empty(), "GEMV gate/up: not a GEMV problem: ", why);
  const bool gated = activation.activation != Activation::relu2;
  const Plan plan =
      warp_rows_only_plan("GEMV gate/up", rows, n, k, y, ldy, gated ? Epilogue::gated : Epilogue::relu2, shape);
  GemvParams params = make_params(x, ldx, up, ldw, n, k, y, ldy, false, plan);
  params.gate = gate;
  params.situ = activation.activation == Activation::situ;
  params.situ_beta = activation.situ_beta;
  params.situ_linear_beta = activation.situ_linear_beta;
  launch_dtype(dtype, rows, params, plan, stream);
}

}  // namespace latentmoe::cuda

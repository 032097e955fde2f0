// The skinny GEMM kernels of skinny_gemm.h and their launchers.
//
// Units. A *unit* is 16 consecutive weight rows (the MMA's M): skinny_gate_up's unit is 16 rows of
// one distinct expert (gate and up rows alike), reduced over k; skinny_down's is 16 output rows,
// reduced over k and summed over every expert the batch uses. A unit's reduction is a list of
// 64-element *steps* (skinny_down: expert-major, the experts' steps one after the other).
//
// Schedule (docs/SKINNY_GEMM.md). The grid is `clusters` clusters of `split` CTAs of `warps` warps.
// Cluster c takes the units c, c + clusters, c + 2 clusters, ... (the launcher gives every unit its
// own cluster; fewer clusters, which loop over units, are a shape tests force); the split * warps
// warps of a cluster cut every unit's step list into equal contiguous ranges, the same range in every
// unit. Each warp streams its ranges of all its units as one sequence through its copy ring, so the
// weight stream does not drain at a unit boundary. At the end of a unit each warp leaves its 16 x 8
// fp32 partial sums in shared memory (double-buffered by unit parity), the cluster meets at a
// barrier, and the first CTA's threads add the partials of every warp of the cluster, in (CTA, warp)
// order, and write the unit's outputs: deterministic, one rounding per output, no global workspace.
// split > 1 (Hopper clusters, the partials read over distributed shared memory) lets few units fill
// the GPU.
//
// Barrier protocol (per cluster, `split` CTAs): for unit i every thread of the cluster (1) writes its
// warp's partials of unit i into buffer i % 2, (2) arrives at and waits on the barrier of unit i,
// (3) if it is one of the first CTA's epilogue threads, reads buffer i % 2 of every CTA. Buffer i % 2
// is next written for unit i + 2, after the barrier of unit i + 1, which the readers of unit i reach
// only after their reads; a last barrier after the final unit keeps every CTA's shared memory alive
// until the first CTA has read it. Every CTA of a cluster has the same units, so the same barriers.
//
// Operands straight from global memory into MMA fragments. mma.m16n8k16 gives lane (g = lane / 4,
// c = lane % 4) the A elements of rows g and g + 8 at k in {2c, 2c+1, 2c+8, 2c+9} and the B elements
// of column g at the same k. Any permutation of k inside a chunk that A and B share leaves the dot
// products unchanged, so lane (g, c) loads 16 contiguous bytes (8 elements at 8c) of weight rows g and
// g + 8 and of the input row of token g, and feeds words {0, 1} to the first k16 step and {2, 3} to
// the second. Every weight byte is loaded once, 16 bytes per lane, fully used 32-byte sectors; weights
// go through the lane's cp.async ring (kStages - 1 steps in flight), inputs (L2-resident) are loaded
// into registers one step ahead.
//
// The table (routed calls). Each CTA reads the batch's pairs (<= kSkinnyMaxRows * top_k ids) into
// shared memory and finds, for each real pair, the first pair naming its expert; the leaders,
// numbered in pair order by a ballot scan, are the distinct experts. Per (expert, token column): the
// input row of the token's first pair naming the expert (-1 for none) and the summed weights of its
// pairs naming it, added in slot order.
//
// Programmatic dependent launch (src/cuda/common/pdl.cuh): skinny_gate_up waits before it reads topk_ids
// (routed) or x; skinny_down builds its table (topk_ids: written two kernels back) and issues its first
// weight loads before it waits, and reads `a` and `out` after. Both trigger right after their wait.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <type_traits>

#include "cuda/comm/lamport_device.cuh"
#include "cuda/common/activation.cuh"
#include "cuda/common/cluster.cuh"
#include "cuda/common/convert.cuh"
#include "cuda/common/cuda_check.h"
#include "cuda/common/device.h"
#include "cuda/common/matrix.h"
#include "cuda/common/mma.cuh"
#include "cuda/common/pdl.cuh"
#include "cuda/gemm/grouped_gemm_common.cuh"
#include "cuda/gemm/grouped_gemm_launch.cuh"
#include "cuda/gemm/skinny_gemm.h"
#include "latentmoe/error.h"

namespace latentmoe::cuda {
namespace {

constexpr int kUnitRows = 16;          // weight rows per unit: the MMA's M
constexpr int kCols = kSkinnyMaxRows;  // token columns: the MMA's N
constexpr int kChunk = 32;             // reduction elements of one MMA pair (4 lanes x 8)
constexpr int kStep = 2 * kChunk;      // reduction elements a warp copies and multiplies per step
constexpr int kAccPerWarp = kUnitRows * kCols;
constexpr int kMaxWarps = 16;
constexpr int kMaxSplit = 8;  // the portable cluster size
constexpr int kMinWarps = 4;
constexpr int kWarpsPerSm = 16;  // resident warps per SM the launcher aims for
// Depth of each lane's copy ring, in steps: kStages - 1 steps of weights are in flight per warp while
// it multiplies one: 8 KB (gated gate/up) or 6 KB (down) per warp, about 100 KB per SM at 16 warps,
// which measured enough to stream at the bandwidth (bench/micro/skinny_stream_bench.cu).
constexpr int kGateUpStages = 3;
constexpr int kDownStages = 4;
constexpr int kDownPieces = 4;  // {row g, row g + 8} x {chunk 0, chunk 1}

// Pieces of one gate/up step: {up, gate} x {row g, row g + 8} x {chunk 0, chunk 1}.
template <bool kGated>
constexpr int gate_up_pieces() {
  return kGated ? 8 : 4;
}

// The launch shape the kernels read (SkinnyShape once chosen).
struct Schedule {
  int split = 1;     // CTAs per cluster
  int clusters = 1;  // clusters in the grid
};

// Shared memory of the table, in 4-byte words, rounded up to 16 bytes: count and masks, the pairs' ids
// and first pairs, then expert [U], row [U][kCols], coef [U][kCols].
__host__ __device__ constexpr int table_words(int pairs, int max_unique) {
  return (16 + 2 * pairs + max_unique * (1 + 2 * kCols) + 3) / 4 * 4;
}

struct Table {
  int* count;       // U, the distinct experts
  int* expert;      // [U]
  int* row;         // [U][kCols]: the input row token column t reads for expert u, -1: none
  float* coef;      // [U][kCols]: the combine coefficient
  int* ids;         // [pairs] (routed)
  int* first;       // [pairs]
  unsigned* masks;  // [ceil(pairs / 32)] leader bits
};

__device__ __forceinline__ Table carve_table(int* smem, int pairs, int max_unique) {
  Table t;
  t.count = smem;
  t.masks = reinterpret_cast<unsigned*>(smem + 8);
  t.ids = smem + 16;
  t.first = t.ids + pairs;
  t.expert = t.first + pairs;
  t.row = t.expert + max_unique;
  t.coef = reinterpret_cast<float*>(t.row + max_unique * kCols);
  return t;
}

// Matrix 0, every row t < rows in column t with coefficient 1.
__device__ void build_dense_table(const Table& t, int rows) {
  if (threadIdx.x == 0) {
    *t.count = 1;
    t.expert[0] = 0;
  }
  if (threadIdx.x < kCols) {
    t.row[threadIdx.x] = static_cast<int>(threadIdx.x) < rows ? static_cast<int>(threadIdx.x) : -1;
    t.coef[threadIdx.x] = 1.0f;
  }
  __syncthreads();
}

// The distinct experts of the batch (see the file comment). Block-wide; ends with a barrier.
__device__ void build_routed_table(const Table& t, const int32_t* __restrict__ ids, const float* __restrict__ weights,
                                   int rows, int top_k, int num_experts) {
  const int pairs = rows * top_k;
  const int tid = threadIdx.x, threads = blockDim.x, lane = tid & 31;
  for (int p = tid; p < pairs; p += threads) t.ids[p] = __ldg(ids + p);
  __syncthreads();
  for (int p = tid; p < pairs; p += threads) {
    const int e = t.ids[p];
    int first = -1;
    if (e >= 0 && e < num_experts) {
      // The earliest q <= p naming e: independent compares (no early exit), so the loads pipeline.
      first = p;
#pragma unroll 8
      for (int q = p - 1; q >= 0; --q) first = t.ids[q] == e ? q : first;
    }
    t.first[p] = first;
  }
  __syncthreads();
  for (int base = 0; base < pairs; base += threads) {  // threads is a multiple of 32
    const int p = base + tid;
    const unsigned leaders = __ballot_sync(0xffffffffu, p < pairs && t.first[p] == p);
    if (lane == 0 && p < pairs) t.masks[p >> 5] = leaders;
  }
  __syncthreads();
  auto rank = [&](int p) {  // leaders before pair p
    int r = __popc(t.masks[p >> 5] & ((1u << (p & 31)) - 1u));
    for (int w = 0; w < (p >> 5); ++w) r += __popc(t.masks[w]);
    return r;
  };
  int unique = 0;
  for (int w = 0; w < (pairs + 31) >> 5; ++w) unique += __popc(t.masks[w]);
  for (int i = tid; i < unique * kCols; i += threads) {
    t.row[i] = -1;
    t.coef[i] = 0.0f;
  }
  if (tid == 0) *t.count = unique;
  for (int p = tid; p < pairs; p += threads) {
    if (t.first[p] == p) t.expert[rank(p)] = t.ids[p];
  }
  __syncthreads();
  for (int p = tid; p < pairs; p += threads) {
    const int first = t.first[p];
    if (first < 0) continue;
    const int token = p / top_k, slot = p - token * top_k, e = t.ids[p];
    const int* token_ids = t.ids + token * top_k;
    bool primary = true;  // the token's first slot naming e
    for (int j = 0; j < slot; ++j) primary = primary && token_ids[j] != e;
    if (!primary) continue;
    float coef = 0.0f;
    if (weights != nullptr) {
      for (int j = slot; j < top_k; ++j) {
        if (token_ids[j] == e) coef += __ldg(weights + token * top_k + j);
      }
    }
    const int u = rank(first);
    t.row[u * kCols + token] = p;
    t.coef[u * kCols + token] = coef;
  }
  __syncthreads();
}

// 16 bytes of weights, read once, copied into this lane's ring without passing through registers: not
// kept in L1, fetched from DRAM 256 bytes at a time; zeros where !valid (nothing is read). The zeros
// are a plain store, not cp.async's zero-filling form with a source size: the slot is this lane's own
// and has no copy in flight (it was read back before it is refilled).
__device__ __forceinline__ void copy_weights(uint4* destination, const void* source, bool valid) {
  if (valid) {
    const auto address = static_cast<uint32_t>(__cvta_generic_to_shared(destination));
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" ::"r"(address), "l"(source) : "memory");
  } else {
    *destination = make_uint4(0, 0, 0, 0);
  }
}
__device__ __forceinline__ void copy_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most `kPending` of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void copy_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

__device__ __forceinline__ uint4 load_input(const void* pointer) { return __ldg(static_cast<const uint4*>(pointer)); }

// One 32-element chunk: rows g (lo) and g + 8 (hi) against column g's input (x), two k16 steps.
template <class T>
__device__ __forceinline__ void mma_chunk(float (&d)[4], const uint4& lo, const uint4& hi, const uint4& x) {
  mma_16x8x16<T>(d, lo.x, hi.x, lo.y, hi.y, x.x, x.y);
  mma_16x8x16<T>(d, lo.z, hi.z, lo.w, hi.w, x.z, x.w);
}

// Accumulator element `index` (0..127, lane * 4 + i) of the C fragment: its weight row and token column.
__device__ __forceinline__ int acc_row(int index) { return ((index >> 2) >> 2) + ((index & 3) >= 2 ? 8 : 0); }
__device__ __forceinline__ int acc_col(int index) { return 2 * ((index >> 2) & 3) + (index & 1); }

// The lane's ring of weight pieces: [stage][piece] uint4, interleaved over the warp's 32 lanes so that
// a warp's 16-byte accesses to one piece are contiguous (no bank conflicts).
template <int kPieces>
struct LaneRing {
  uint4* base;  // this lane's element of stage 0, piece 0
  __device__ __forceinline__ uint4* at(int stage, int piece) const { return base + (stage * kPieces + piece) * 32; }
};

template <int kPieces, int kStages>
__device__ __forceinline__ LaneRing<kPieces> carve_ring(void* rings, int warp, int lane) {
  return {static_cast<uint4*>(rings) + warp * kStages * kPieces * 32 + lane};
}

__device__ __forceinline__ int next_stage(int stage, int stages) { return stage + 1 == stages ? 0 : stage + 1; }

// The lane's two input pieces of a step (chunks 0 and 1), zero where the step ends past k.
template <class T>
__device__ __forceinline__ void load_step_input(uint4 (&v)[2], const T* x, int offset, int k) {
  v[0] = x != nullptr && offset < k ? load_input(x) : make_uint4(0, 0, 0, 0);
  v[1] = x != nullptr && offset + kChunk < k ? load_input(x + kChunk) : make_uint4(0, 0, 0, 0);
}

// This warp's steps of every unit: [begin, end) of the unit's `steps`, the same in every unit.
struct WarpRange {
  int begin, end;
};
__device__ __forceinline__ WarpRange warp_range(int steps, int rank, int warp, int warps, int split) {
  const int64_t q = static_cast<int64_t>(rank) * warps + warp, all = static_cast<int64_t>(split) * warps;
  return {static_cast<int>(steps * q / all), static_cast<int>(steps * (q + 1) / all)};
}

// The units of cluster `cluster`: cluster, cluster + clusters, ... < units.
__device__ __forceinline__ int units_of_cluster(int units, int cluster, int clusters) {
  return cluster < units ? (units - 1 - cluster) / clusters + 1 : 0;
}

struct GateUpParams {
  const void* x = nullptr;
  int64_t ldx = 0;
  int rows = 0;
  const void* gate = nullptr;  // nullptr: relu2
  const void* up = nullptr;
  int n = 0, k = 0;
  int64_t ldw = 0, expert_stride = 0;
  void* act = nullptr;
  int64_t ld_act = 0;
  const int32_t* ids = nullptr;  // nullptr: dense
  int top_k = 1, num_experts = 1, max_unique = 1, row_blocks = 1;
  bool situ = false;
  float situ_beta = 4.0f, situ_linear_beta = 25.0f;
  Schedule schedule;
};

// Units: (distinct expert ue, row block b) as u = ue * row_blocks + b; steps: the k steps.
template <class T, bool kGated>
__global__ void __launch_bounds__(kMaxWarps * 32) skinny_gate_up_kernel(GateUpParams p) {
  constexpr int kPieces = gate_up_pieces<kGated>();
  constexpr int kAccs = kGated ? 2 : 1;
  extern __shared__ __align__(16) int smem[];
  const bool routed = p.ids != nullptr;
  const int pairs = routed ? p.rows * p.top_k : 0;
  const Table table = carve_table(smem, pairs, p.max_unique);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  uint4* rings = reinterpret_cast<uint4*>(smem + table_words(pairs, p.max_unique));
  float* partials = reinterpret_cast<float*>(rings + warps * kGateUpStages * kPieces * 32);  // [2][warps][kAccs][128]
  bool waited = false;
  if (routed) {
    pdl_wait();
    pdl_trigger();
    waited = true;
    build_routed_table(table, p.ids, nullptr, p.rows, p.top_k, p.num_experts);
  } else {
    build_dense_table(table, p.rows);
  }
  const int split = p.schedule.split, clusters = p.schedule.clusters;
  const int rank = static_cast<int>(blockIdx.x) % split, cluster = static_cast<int>(blockIdx.x) / split;
  const int my_units = units_of_cluster(*table.count * p.row_blocks, cluster, clusters);
  const int steps = (p.k + kStep - 1) / kStep;
  const WarpRange range = warp_range(steps, rank, warp, warps, split);
  const int span = range.end - range.begin;
  const int total = my_units * span;  // steps this warp multiplies
  const int first_offset = range.begin * kStep + 8 * c;
  const LaneRing<kPieces> ring = carve_ring<kPieces, kGateUpStages>(rings, warp, lane);

  // Issue cursor: the next step to copy (unit index i of this cluster, k offset of this lane).
  int issued = 0, issue_stage = 0, issue_unit = 0, issue_left = span, issue_offset = first_offset;
  bool valid0 = false, valid1 = false;
  const T* up_lo = nullptr;
  const T* up_hi = nullptr;
  const T* gate_lo = nullptr;
  const T* gate_hi = nullptr;
  auto point_weights = [&] {
    const int u = cluster + issue_unit * clusters;
    const int ue = u / p.row_blocks, block = u - ue * p.row_blocks;
    const int r0 = block * kUnitRows + g, r1 = r0 + 8;
    valid0 = r0 < p.n;
    valid1 = r1 < p.n;
    const int64_t base = static_cast<int64_t>(table.expert[ue]) * p.expert_stride + first_offset;
    const int64_t lo = base + (valid0 ? r0 : 0) * p.ldw, hi = base + (valid1 ? r1 : 0) * p.ldw;
    up_lo = static_cast<const T*>(p.up) + lo;
    up_hi = static_cast<const T*>(p.up) + hi;
    if constexpr (kGated) {
      gate_lo = static_cast<const T*>(p.gate) + lo;
      gate_hi = static_cast<const T*>(p.gate) + hi;
    }
  };
  if (total > 0) point_weights();
  auto issue = [&] {  // the warp's next step into the next stage (an empty group past the end)
    if (issued < total) {
      const bool v0 = issue_offset < p.k, v1 = issue_offset + kChunk < p.k;
      copy_weights(ring.at(issue_stage, 0), up_lo, valid0 && v0);
      copy_weights(ring.at(issue_stage, 1), up_hi, valid1 && v0);
      copy_weights(ring.at(issue_stage, 2), up_lo + kChunk, valid0 && v1);
      copy_weights(ring.at(issue_stage, 3), up_hi + kChunk, valid1 && v1);
      if constexpr (kGated) {
        copy_weights(ring.at(issue_stage, 4), gate_lo, valid0 && v0);
        copy_weights(ring.at(issue_stage, 5), gate_hi, valid1 && v0);
        copy_weights(ring.at(issue_stage, 6), gate_lo + kChunk, valid0 && v1);
        copy_weights(ring.at(issue_stage, 7), gate_hi + kChunk, valid1 && v1);
        gate_lo += kStep;
        gate_hi += kStep;
      }
      up_lo += kStep;
      up_hi += kStep;
      issue_offset += kStep;
      if (--issue_left == 0 && issued + 1 < total) {  // on to the next unit
        ++issue_unit;
        issue_left = span;
        issue_offset = first_offset;
        point_weights();
      }
    }
    copy_commit();
    ++issued;
    issue_stage = next_stage(issue_stage, kGateUpStages);
  };

#pragma unroll
  for (int j = 0; j < kGateUpStages - 1; ++j) issue();
  if (!waited) {  // dense: x may be the previous kernel's output
    pdl_wait();
    pdl_trigger();
  }
  // Input cursor: one step ahead of the multiply. x row g is token g's; nullptr: token g does not
  // use the unit's expert (its column stays zero).
  int input_unit = 0, input_left = span, input_offset = first_offset;
  const T* x_row = nullptr;
  auto point_input = [&] {
    const int ue = (cluster + input_unit * clusters) / p.row_blocks;
    x_row = table.row[ue * kCols + g] >= 0 ? static_cast<const T*>(p.x) + g * p.ldx + first_offset : nullptr;
  };
  auto next_input = [&](uint4(&v)[2], int j) {  // step j's inputs, then advance
    if (j >= total) return;
    load_step_input(v, x_row, input_offset, p.k);
    input_offset += kStep;
    if (x_row != nullptr) x_row += kStep;
    if (--input_left == 0 && j + 1 < total) {
      ++input_unit;
      input_left = span;
      input_offset = first_offset;
      point_input();
    }
  };
  if (total > 0) point_input();
  uint4 x_next[2] = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
  next_input(x_next, 0);

  int stage = 0, j = 0;
  for (int i = 0; i < my_units; ++i) {
    float acc_g[4] = {0.0f, 0.0f, 0.0f, 0.0f}, acc_u[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int s = 0; s < span; ++s, ++j, stage = next_stage(stage, kGateUpStages)) {
      copy_wait<kGateUpStages - 2>();  // step j has landed
      uint4 w[kPieces];
#pragma unroll
      for (int q = 0; q < kPieces; ++q) w[q] = *ring.at(stage, q);
      const uint4 x0 = x_next[0], x1 = x_next[1];
      next_input(x_next, j + 1);
      issue();  // into the stage read one step ago
      mma_chunk<T>(acc_u, w[0], w[1], x0);
      mma_chunk<T>(acc_u, w[2], w[3], x1);
      if constexpr (kGated) {
        mma_chunk<T>(acc_g, w[4], w[5], x0);
        mma_chunk<T>(acc_g, w[6], w[7], x1);
      }
    }
    float* buffer = partials + (i & 1) * warps * kAccs * kAccPerWarp;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      buffer[warp * kAccs * kAccPerWarp + lane * 4 + e] = acc_u[e];
      if constexpr (kGated) buffer[(warp * kAccs + 1) * kAccPerWarp + lane * 4 + e] = acc_g[e];
    }
    cluster_barrier(split);
    if (rank != 0) continue;
    const int u = cluster + i * clusters;
    const int ue = u / p.row_blocks, block = u - ue * p.row_blocks;
    for (int index = threadIdx.x; index < kAccPerWarp; index += blockDim.x) {
      const int row = block * kUnitRows + acc_row(index);
      const int out_row = table.row[ue * kCols + acc_col(index)];
      if (out_row < 0 || row >= p.n) continue;
      float sum_u = 0.0f, sum_g = 0.0f;
      for (int r = 0; r < split; ++r) {
        const float* from = cluster_shared(buffer, r, split);
        for (int w = 0; w < warps; ++w) {
          sum_u += from[w * kAccs * kAccPerWarp + index];
          if constexpr (kGated) sum_g += from[(w * kAccs + 1) * kAccPerWarp + index];
        }
      }
      const float value =
          kGated ? act::gated<true>(sum_g, sum_u, p.situ, p.situ_beta, p.situ_linear_beta) : act::relu2(sum_u);
      static_cast<T*>(p.act)[out_row * p.ld_act + row] = from_float<T>(value);
    }
  }
  copy_wait<0>();
  if (split > 1) cluster_barrier(split);  // the first CTA has read every CTA's partials
}

struct DownParams {
  const void* a = nullptr;
  int64_t lda = 0;
  int rows = 0;
  const void* w = nullptr;
  int n = 0, k = 0;
  int64_t ldw = 0, expert_stride = 0;
  void* out = nullptr;
  int64_t ld_out = 0;
  bool accumulate = false;
  // Dense only: the results go into every rank's receive region of the GPU group's next all-gather
  // (tier 0's fused up-projection) instead of `out`, which `accumulate` still reads.
  bool pushing = false;
  LamportPeers push;
  const int32_t* ids = nullptr;  // nullptr: dense
  const float* weights = nullptr;
  int top_k = 1, num_experts = 1, max_unique = 1;
  Schedule schedule;
};

// Units: blocks of 16 output rows; steps: (distinct expert, k step), expert-major. A warp folds an
// expert's sums into its unit total with the expert's coefficients when it leaves the expert.
template <class T>
__global__ void __launch_bounds__(kMaxWarps * 32) skinny_down_kernel(DownParams p) {
  extern __shared__ __align__(16) int smem[];
  const bool routed = p.ids != nullptr;
  const int pairs = routed ? p.rows * p.top_k : 0;
  const Table table = carve_table(smem, pairs, p.max_unique);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  uint4* rings = reinterpret_cast<uint4*>(smem + table_words(pairs, p.max_unique));
  float* partials = reinterpret_cast<float*>(rings + warps * kDownStages * kDownPieces * 32);  // [2][warps][128]
  if (routed) {
    build_routed_table(table, p.ids, p.weights, p.rows, p.top_k, p.num_experts);  // ids: two kernels back
  } else {
    build_dense_table(table, p.rows);
  }
  const int split = p.schedule.split, clusters = p.schedule.clusters;
  const int rank = static_cast<int>(blockIdx.x) % split, cluster = static_cast<int>(blockIdx.x) / split;
  const int units = (p.n + kUnitRows - 1) / kUnitRows;
  const int my_units = units_of_cluster(units, cluster, clusters);
  const int steps_per_expert = (p.k + kStep - 1) / kStep;
  const WarpRange range = warp_range(*table.count * steps_per_expert, rank, warp, warps, split);
  const int span = range.end - range.begin;
  const int total = my_units * span;
  // Where the range starts in every unit: expert index and this lane's k offset.
  const int first_expert = range.begin / steps_per_expert;
  const int first_offset = (range.begin - first_expert * steps_per_expert) * kStep + 8 * c;
  const T* w = static_cast<const T*>(p.w);
  const T* a = static_cast<const T*>(p.a);
  const LaneRing<kDownPieces> ring = carve_ring<kDownPieces, kDownStages>(rings, warp, lane);

  // Issue cursor: the next step to copy.
  int issued = 0, issue_stage = 0, issue_unit = 0, issue_left = span, issue_expert = first_expert;
  int issue_offset = first_offset;
  bool valid0 = false, valid1 = false;
  int64_t row0 = 0, row1 = 0;  // this lane's weight rows' element offsets in a matrix
  const T* w_lo = nullptr;
  const T* w_hi = nullptr;
  auto point_rows = [&] {
    const int r0 = (cluster + issue_unit * clusters) * kUnitRows + g, r1 = r0 + 8;
    valid0 = r0 < p.n;
    valid1 = r1 < p.n;
    row0 = static_cast<int64_t>(valid0 ? r0 : 0) * p.ldw;
    row1 = static_cast<int64_t>(valid1 ? r1 : 0) * p.ldw;
  };
  auto point_weights = [&] {
    const T* base = w + static_cast<int64_t>(table.expert[issue_expert]) * p.expert_stride + issue_offset;
    w_lo = base + row0;
    w_hi = base + row1;
  };
  if (total > 0) {
    point_rows();
    point_weights();
  }
  auto issue = [&] {
    if (issued < total) {
      const bool v0 = issue_offset < p.k, v1 = issue_offset + kChunk < p.k;
      copy_weights(ring.at(issue_stage, 0), w_lo, valid0 && v0);
      copy_weights(ring.at(issue_stage, 1), w_hi, valid1 && v0);
      copy_weights(ring.at(issue_stage, 2), w_lo + kChunk, valid0 && v1);
      copy_weights(ring.at(issue_stage, 3), w_hi + kChunk, valid1 && v1);
      issue_offset += kStep;
      w_lo += kStep;
      w_hi += kStep;
      if (issued + 1 < total) {
        if (--issue_left == 0) {  // on to the next unit, at the range's start
          ++issue_unit;
          issue_left = span;
          issue_expert = first_expert;
          issue_offset = first_offset;
          point_rows();
          point_weights();
        } else if (issue_offset - 8 * c >= p.k) {  // on to the next expert
          ++issue_expert;
          issue_offset = 8 * c;
          point_weights();
        }
      }
    }
    copy_commit();
    ++issued;
    issue_stage = next_stage(issue_stage, kDownStages);
  };
  // Input cursor: the step whose inputs are loaded next (one ahead of the multiply). The input rows
  // depend on the expert only, not on the unit.
  int input_left = span, input_expert = first_expert, input_offset = first_offset;
  const T* a_row = nullptr;
  auto point_input = [&] {
    const int row = table.row[input_expert * kCols + g];
    a_row = row >= 0 ? a + static_cast<int64_t>(row) * p.lda + input_offset : nullptr;
  };
  auto next_input = [&](uint4(&v)[2], int j) {  // step j's inputs, then advance
    if (j >= total) return;
    load_step_input(v, a_row, input_offset, p.k);
    input_offset += kStep;
    if (a_row != nullptr) a_row += kStep;
    if (j + 1 < total) {
      if (--input_left == 0) {
        input_left = span;
        input_expert = first_expert;
        input_offset = first_offset;
        point_input();
      } else if (input_offset - 8 * c >= p.k) {
        ++input_expert;
        input_offset = 8 * c;
        point_input();
      }
    }
  };

#pragma unroll
  for (int j = 0; j < kDownStages - 1; ++j) issue();
  pdl_wait();  // a and out: the previous kernel's
  pdl_trigger();
  // The previous collective of the stream has advanced the epoch that names the slot.
  const int push_slot = p.pushing ? lamport::next_slot(p.push) : 0;
  if (total > 0) point_input();
  uint4 a_next[2] = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
  next_input(a_next, 0);
  T* out = static_cast<T*>(p.out);
  int stage = 0, j = 0;
  for (int i = 0; i < my_units; ++i) {
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};           // the current expert's
    float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};           // coefficient-weighted over the experts
    int expert = first_expert, offset = first_offset;  // multiply cursor
    for (int s = 0; s < span; ++s, ++j, stage = next_stage(stage, kDownStages)) {
      copy_wait<kDownStages - 2>();
      uint4 v[kDownPieces];
#pragma unroll
      for (int q = 0; q < kDownPieces; ++q) v[q] = *ring.at(stage, q);
      const uint4 a0 = a_next[0], a1 = a_next[1];
      next_input(a_next, j + 1);
      issue();
      mma_chunk<T>(acc, v[0], v[1], a0);
      mma_chunk<T>(acc, v[2], v[3], a1);
      offset += kStep;
      if (offset - 8 * c >= p.k || s + 1 == span) {  // leaving the expert: fold it in with its coefficients
        const float c0 = table.coef[expert * kCols + 2 * c], c1 = table.coef[expert * kCols + 2 * c + 1];
        sum[0] = fmaf(c0, acc[0], sum[0]);
        sum[1] = fmaf(c1, acc[1], sum[1]);
        sum[2] = fmaf(c0, acc[2], sum[2]);
        sum[3] = fmaf(c1, acc[3], sum[3]);
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[e] = 0.0f;
        ++expert;
        offset = 8 * c;
      }
    }
    float* buffer = partials + (i & 1) * warps * kAccPerWarp;
#pragma unroll
    for (int e = 0; e < 4; ++e) buffer[warp * kAccPerWarp + lane * 4 + e] = sum[e];
    cluster_barrier(split);
    if (rank != 0) continue;
    const int block = cluster + i * clusters;
    for (int index = threadIdx.x; index < kAccPerWarp; index += blockDim.x) {
      const int row = block * kUnitRows + acc_row(index);
      const int token = acc_col(index);
      if (token >= p.rows || row >= p.n) continue;
      float value = 0.0f;
      for (int r = 0; r < split; ++r) {
        const float* from = cluster_shared(buffer, r, split);
        for (int v = 0; v < warps; ++v) value += from[v * kAccPerWarp + index];
      }
      T* target = out + token * p.ld_out + row;
      if (p.accumulate) value += to_float(*target);
      if (p.pushing) {
        lamport::push_all_gather<T>(p.push, push_slot, p.n, token, row, from_float<T>(value));
      } else {
        *target = from_float<T>(value);
      }
    }
  }
  copy_wait<0>();
  if (split > 1) cluster_barrier(split);  // the first CTA has read every CTA's partials
}

// Shared memory of one warp: its copy ring and its two partials buffers (`accumulators` tiles each).
constexpr size_t warp_shared_bytes(int ring_pieces, int accumulators) {
  return static_cast<size_t>(ring_pieces) * 32 * sizeof(uint4) +
         2 * static_cast<size_t>(accumulators) * kAccPerWarp * 4;
}

struct Launch {
  int warps = 1;
  Schedule schedule;
  size_t shared = 0;
};

// The launch of a call of `units` units of `steps` steps each (upper bounds for routed calls), or the
// forced shape. Measured on the H200 (docs/SKINNY_GEMM.md): one unit per cluster, all units at once,
// beats persistent clusters that loop over units (whose per-unit barrier waits for the slowest of
// the cluster's loads every few steps), even when the units are several waves. So: clusters = units;
// split = the smallest of 1, 2, 4, 8 that gives at least as many CTAs as SMs (few units, such as
// Nemotron's W_down of 64 units, would leave SMs idle), keeping a step per warp; warps = the most
// (4..16) that keep all CTAs near kWarpsPerSm warps per SM, within one CTA's shared memory and the
// steps of a unit.
Launch choose_launch(const void* kernel, int64_t units, int64_t steps, size_t table_bytes, size_t per_warp,
                     const SkinnyShape& shape) {
  const size_t limit = static_cast<size_t>(current_shared_memory_optin());
  check_cluster_shape("skinny GEMM", shape.warps, kMaxWarps, shape.split, shape.clusters);
  const bool clusters_supported = current_compute_capability() >= 90;
  const int fit =
      limit > table_bytes ? static_cast<int>(std::min<size_t>(kMaxWarps, (limit - table_bytes) / per_warp)) : 0;
  LATENTMOE_CHECK(fit >= 1, "skinny GEMM: the table (", table_bytes, " bytes) leaves no shared memory for a warp");
  const int64_t sms = current_sm_count();
  int split = shape.split;
  if (split == 0) {
    split = 1;
    while (clusters_supported && split < kMaxSplit && units * split < sms && 2 * split * kMinWarps <= steps) split *= 2;
  }
  Launch launch;
  if (shape.warps > 0) {
    launch.warps = shape.warps;
  } else {
    const int64_t ctas = units * split;
    int warps = kMaxWarps;
    while (warps > kMinWarps && ctas * warps > sms * kWarpsPerSm) warps /= 2;
    warps = static_cast<int>(std::min<int64_t>(warps, std::max<int64_t>(1, steps / split)));
    launch.warps = std::min(warps, fit);
  }
  LATENTMOE_CHECK(launch.warps <= fit, "skinny GEMM: ", launch.warps, " warps need ",
                  table_bytes + launch.warps * per_warp, " bytes of shared memory, more than the device's ", limit);
  launch.shared = table_bytes + launch.warps * per_warp;
  launch.schedule.split = split;
  const int64_t clusters = shape.clusters > 0 ? shape.clusters : std::max<int64_t>(1, units);
  LATENTMOE_CHECK(clusters * split <= INT_MAX, "skinny GEMM: ", clusters, " clusters exceed the grid");
  launch.schedule.clusters = static_cast<int>(clusters);
  return launch;
}

bool routed_call(const SkinnyRouting& routing) { return routing.topk_ids != nullptr; }

void check_common(const char* what, DType dtype, const SkinnyRouting& routing, int64_t rows,
                  const SkinnyWeights& weights, std::initializer_list<SkinnyRows> operands) {
  LATENTMOE_CHECK(skinny_supported(dtype, rows, weights.k, operands), what, ": ", rows, " rows of ", dtype_name(dtype),
                  " with k = ", weights.k,
                  " is not a skinny problem (bf16/f16, 1..8 rows, k a multiple of 8, 16-byte aligned rows)");
  LATENTMOE_CHECK(weights.n >= 1 && weights.n <= INT_MAX && weights.ld >= weights.k, what, ": weights of ", weights.n,
                  " rows with ld ", weights.ld, " for k = ", weights.k);
  if (routed_call(routing)) {
    LATENTMOE_CHECK(routing.top_k >= 1 && routing.top_k <= kSkinnyMaxTopK && routing.num_experts >= 1, what, ": top_k ",
                    routing.top_k, " (1..", kSkinnyMaxTopK, ") and ", routing.num_experts, " experts");
    LATENTMOE_CHECK(weights.expert_stride >= weights.n * weights.ld &&
                        (static_cast<size_t>(weights.expert_stride) * dtype_size(dtype)) % 16 == 0,
                    what, ": expert stride ", weights.expert_stride, " does not hold ", weights.n, " rows of ",
                    weights.ld);
  }
}

// Launches `kernel` with the chosen shape, as a programmatic dependent where the device has it.
template <class Params>
void launch_skinny(const char* what, void (*kernel)(Params), const Launch& launch, cudaStream_t stream,
                   const Params& params) {
  const unsigned grid = static_cast<unsigned>(launch.schedule.clusters) * static_cast<unsigned>(launch.schedule.split);
  launch_kernel_clustered(what, pdl_supported(), static_cast<unsigned>(launch.schedule.split), kernel, dim3(grid),
                          dim3(static_cast<unsigned>(launch.warps * 32)), launch.shared, stream, params);
}

// Sets a kernel's dynamic shared memory limit to the device's (once per device per kernel).
void open_shared_memory(const void* kernel, std::atomic<uint64_t>* limit_set) {
  gg::ensure_smem_limit(kernel, current_shared_memory_optin(), limit_set);
}

}  // namespace

bool skinny_supported(DType dtype, int64_t rows, int64_t k, std::initializer_list<SkinnyRows> operands) {
  if (dtype != DType::bf16 && dtype != DType::f16) return false;
  if (rows < 1 || rows > kSkinnyMaxRows || k < 8 || k % 8 != 0 || k > INT_MAX / 2) return false;
  for (const SkinnyRows& operand : operands) {
    if (operand.data != nullptr && !rows_aligned(operand.data, operand.ld, dtype_size(dtype), 16)) return false;
  }
  return current_compute_capability() >= 80;  // mma.sync bf16/f16
}

void skinny_gate_up(DType dtype, const ::latentmoe::detail::ActivationParams& activation, const SkinnyRouting& routing,
                    const SkinnyRows& x, int64_t rows, const SkinnyWeights& weights, void* act, int64_t ld_act,
                    cudaStream_t stream, const SkinnyShape& shape) {
  if (rows == 0) return;
  const bool gated = activation.activation != Activation::relu2;
  LATENTMOE_CHECK(gated == (weights.gate != nullptr), "skinny_gate_up: ", to_string(activation.activation),
                  gated ? " needs" : " takes no", " gate weights");
  check_common("skinny_gate_up", dtype, routing, rows, weights,
               {x, {weights.w, weights.ld}, {weights.gate, weights.ld}});
  LATENTMOE_CHECK(ld_act >= weights.n, "skinny_gate_up: act row stride ", ld_act, " < n = ", weights.n);
  GateUpParams p;
  p.x = x.data;
  p.ldx = x.ld;
  p.rows = static_cast<int>(rows);
  p.gate = weights.gate;
  p.up = weights.w;
  p.n = static_cast<int>(weights.n);
  p.k = static_cast<int>(weights.k);
  p.ldw = weights.ld;
  p.expert_stride = weights.expert_stride;
  p.act = act;
  p.ld_act = ld_act;
  const bool routed = routed_call(routing);
  p.ids = routing.topk_ids;
  p.top_k = routed ? routing.top_k : 1;
  p.num_experts = routed ? routing.num_experts : 1;
  const int pairs = routed ? p.rows * p.top_k : 0;
  p.max_unique = routed ? std::min(p.num_experts, pairs) : 1;
  p.row_blocks = static_cast<int>((weights.n + kUnitRows - 1) / kUnitRows);
  p.situ = activation.activation == Activation::situ;
  p.situ_beta = activation.situ_beta;
  p.situ_linear_beta = activation.situ_linear_beta;
  const int64_t units = static_cast<int64_t>(p.max_unique) * p.row_blocks;
  LATENTMOE_CHECK(units <= INT_MAX, "skinny_gate_up: ", units, " units exceed the grid");
  const int64_t steps = (weights.k + kStep - 1) / kStep;
  const size_t table_bytes = table_words(pairs, p.max_unique) * sizeof(int);
  auto launch = [&](auto tag, auto gated_tag) {
    using T = decltype(tag);
    constexpr bool kGated = decltype(gated_tag)::value;
    static std::atomic<uint64_t> limit_set{0};
    auto* kernel = skinny_gate_up_kernel<T, kGated>;
    open_shared_memory(reinterpret_cast<const void*>(kernel), &limit_set);
    const Launch chosen =
        choose_launch(reinterpret_cast<const void*>(kernel), units, steps, table_bytes,
                      warp_shared_bytes(kGateUpStages * gate_up_pieces<kGated>(), kGated ? 2 : 1), shape);
    p.schedule = chosen.schedule;
    launch_skinny("skinny_gate_up_kernel", kernel, chosen, stream, p);
  };
  if (dtype == DType::bf16) {
    gated ? launch(__nv_bfloat16{}, std::true_type{}) : launch(__nv_bfloat16{}, std::false_type{});
  } else {
    gated ? launch(__half{}, std::true_type{}) : launch(__half{}, std::false_type{});
  }
}

void skinny_down(DType dtype, const SkinnyRouting& routing, const SkinnyRows& a, int64_t rows,
                 const SkinnyWeights& weights, void* out, int64_t ld_out, bool accumulate, cudaStream_t stream,
                 const SkinnyShape& shape, const LamportPeers* push_to) {
  if (rows == 0) return;
  check_common("skinny_down", dtype, routing, rows, weights, {a, {weights.w, weights.ld}});
  LATENTMOE_CHECK(ld_out >= weights.n, "skinny_down: output row stride ", ld_out, " < n = ", weights.n);
  const bool routed = routed_call(routing);
  LATENTMOE_CHECK(!routed || routing.topk_weights != nullptr, "skinny_down: a routed call needs topk_weights");
  LATENTMOE_CHECK(push_to == nullptr || !routed, "skinny_down: only a dense call pushes into a GPU group");
  LATENTMOE_CHECK(
      push_to == nullptr || rows * weights.n * static_cast<int64_t>(dtype_size(dtype)) <= push_to->capacity_bytes,
      "skinny_down: a block of ", rows, " x ", weights.n, " exceeds the GPU group's capacity of ",
      push_to != nullptr ? push_to->capacity_bytes : 0, " bytes");
  DownParams p;
  p.a = a.data;
  p.lda = a.ld;
  p.rows = static_cast<int>(rows);
  p.w = weights.w;
  p.n = static_cast<int>(weights.n);
  p.k = static_cast<int>(weights.k);
  p.ldw = weights.ld;
  p.expert_stride = weights.expert_stride;
  p.out = out;
  p.ld_out = ld_out;
  p.accumulate = accumulate;
  if (push_to != nullptr) {
    p.pushing = true;
    p.push = *push_to;
  }
  p.ids = routing.topk_ids;
  p.weights = routing.topk_weights;
  p.top_k = routed ? routing.top_k : 1;
  p.num_experts = routed ? routing.num_experts : 1;
  const int pairs = routed ? p.rows * p.top_k : 0;
  p.max_unique = routed ? std::min(p.num_experts, pairs) : 1;
  const int64_t units = (weights.n + kUnitRows - 1) / kUnitRows;
  const int64_t steps = static_cast<int64_t>(p.max_unique) * ((weights.k + kStep - 1) / kStep);
  LATENTMOE_CHECK(steps <= INT_MAX, "skinny_down: ", steps, " steps per unit");
  const size_t table_bytes = table_words(pairs, p.max_unique) * sizeof(int);
  auto launch = [&](auto tag) {
    using T = decltype(tag);
    static std::atomic<uint64_t> limit_set{0};
    auto* kernel = skinny_down_kernel<T>;
    open_shared_memory(reinterpret_cast<const void*>(kernel), &limit_set);
    const Launch chosen = choose_launch(reinterpret_cast<const void*>(kernel), units, steps, table_bytes,
                                        warp_shared_bytes(kDownStages * kDownPieces, 1), shape);
    p.schedule = chosen.schedule;
    launch_skinny("skinny_down_kernel", kernel, chosen, stream, p);
  };
  if (dtype == DType::bf16) {
    launch(__nv_bfloat16{});
  } else {
    launch(__half{});
  }
}

}  // namespace latentmoe::cuda

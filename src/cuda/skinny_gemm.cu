// The skinny GEMM kernels of skinny_gemm.h and their launchers.
//
// Work split. A CTA owns one *unit*: 16 consecutive weight rows (the MMA's M) of one matrix
// (skinny_gate_up: of one distinct expert, gate and up rows alike) or of every matrix the batch uses
// (skinny_down, summing over the experts). Its warps split the unit's reduction into 32-element
// chunks, round robin; each warp keeps the unit's 16 x 8 fp32 accumulators of its chunks, and the
// warps' sums are added in warp order at the end (deterministic). The host sizes the CTA (4-16 warps)
// so that all units together ask for about 16 warps per SM: with decode's units all resident at once,
// the DRAM requests of every SM are in flight together and the weight stream runs at the bandwidth
// however unevenly the units fall on the SMs.
//
// Operands straight from global memory into MMA fragments. mma.m16n8k16 gives lane (g = lane / 4,
// c = lane % 4) the A elements of rows g and g + 8 at k in {2c, 2c+1, 2c+8, 2c+9} and the B elements
// of column g at the same k. Any permutation of k inside a chunk that A and B share leaves the dot
// products unchanged, so lane (g, c) loads 16 contiguous bytes (8 elements at 8c) of weight rows g and
// g + 8 and of the input row of token g, and feeds words {0, 1} to the first k16 step and {2, 3} to
// the second. Every weight byte is loaded once, 16 bytes per lane, fully used 32-byte sectors, no
// shared memory, no ldmatrix; weights bypass L1 and ask the L2 for 256-byte fetches.
//
// The table (routed calls). Each CTA reads the batch's pairs (<= kSkinnyMaxRows * top_k ids) into
// shared memory and finds, for each real pair, the first pair naming its expert (O(pairs) compares per
// thread, a few hundred at most); the leaders, numbered in pair order by a ballot scan, are the
// distinct experts. Per (expert, token column): the input row of the token's first pair naming the
// expert (-1 for none) and the summed weights of its pairs naming it, added in slot order.
//
// Programmatic dependent launch (src/cuda/pdl.cuh): skinny_gate_up waits before it reads topk_ids
// (routed) or x; skinny_down builds its table (topk_ids: written two kernels back) and issues its first
// weight loads before it waits, and reads `a` and `out` after. Both trigger right after their wait.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <type_traits>

#include "cuda/convert.cuh"
#include "cuda/device.h"
#include "cuda/grouped_gemm_common.cuh"
#include "cuda/grouped_gemm_launch.h"
#include "cuda/pdl.cuh"
#include "cuda/skinny_gemm.h"
#include "latentmoe/error.h"

namespace latentmoe::cuda {
namespace {

constexpr int kUnitRows = 16;          // weight rows per unit: the MMA's M
constexpr int kCols = kSkinnyMaxRows;  // token columns: the MMA's N
constexpr int kChunk = 32;             // reduction elements of one MMA pair (4 lanes x 8)
constexpr int kStep = 2 * kChunk;      // reduction elements a warp copies and multiplies per step
constexpr int kAccPerWarp = kUnitRows * kCols;
constexpr int kMinWarps = 4;
constexpr int kMaxWarps = 16;
constexpr int kWarpsPerSm = 16;   // resident warps the units of one call aim for
// Depth of each lane's copy ring, in steps: kStages - 1 steps of weights are in flight per warp while
// it multiplies one: 8 KB (gated gate/up) or 6 KB (down) per warp, about 100 KB per SM at 16 warps,
// which measured enough to stream at the bandwidth (bench/micro/skinny_stream_bench.cu). The rings
// take 12 or 8 KB of shared memory per warp.
constexpr int kGateUpStages = 3;
constexpr int kDownStages = 4;

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
      first = p;
      for (int q = 0; q < p; ++q) {
        if (t.ids[q] == e) {
          first = q;
          break;
        }
      }
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
// kept in L1, fetched from DRAM 256 bytes at a time; zeros where !valid (nothing is read).
__device__ __forceinline__ void copy_weights(uint4* destination, const void* source, bool valid) {
  const auto address = static_cast<uint32_t>(__cvta_generic_to_shared(destination));
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(address), "l"(source),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void copy_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most `kPending` of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void copy_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

__device__ __forceinline__ uint4 load_input(const void* pointer) { return __ldg(static_cast<const uint4*>(pointer)); }

template <class T>
__device__ __forceinline__ void mma_16x8x16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                            uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
#endif
}

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
__device__ __forceinline__ LaneRing<kPieces> carve_ring(void* smem, int warp, int lane) {
  return {static_cast<uint4*>(smem) + warp * kStages * kPieces * 32 + lane};
}

__device__ __forceinline__ int next_stage(int stage, int stages) { return stage + 1 == stages ? 0 : stage + 1; }

// The lane's two input pieces of a step (chunks 0 and 1), zero where the step ends past k.
template <class T>
__device__ __forceinline__ void load_step_input(uint4 (&v)[2], const T* x, int offset, int k) {
  v[0] = x != nullptr && offset < k ? load_input(x) : make_uint4(0, 0, 0, 0);
  v[1] = x != nullptr && offset + kChunk < k ? load_input(x + kChunk) : make_uint4(0, 0, 0, 0);
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
};

// Pieces of one step: {up, gate} x {row g, row g + 8} x {chunk 0, chunk 1}.
template <bool kGated>
constexpr int gate_up_pieces() {
  return kGated ? 8 : 4;
}

// One CTA: one distinct expert's unit of 16 rows (of up, and of gate); warp w multiplies the steps
// [w * S / W, (w + 1) * S / W) of its k range, then the warps' sums are added in warp order.
template <class T, bool kGated>
__global__ void __launch_bounds__(kMaxWarps * 32) skinny_gate_up_kernel(GateUpParams p) {
  constexpr int kPieces = gate_up_pieces<kGated>();
  extern __shared__ __align__(16) int smem[];
  const bool routed = p.ids != nullptr;
  const int pairs = routed ? p.rows * p.top_k : 0;
  const Table table = carve_table(smem, pairs, p.max_unique);
  void* work = smem + table_words(pairs, p.max_unique);  // the lanes' rings, then the reduction
  bool waited = false;
  if (routed) {
    pdl_wait();
    pdl_trigger();
    waited = true;
    build_routed_table(table, p.ids, nullptr, p.rows, p.top_k, p.num_experts);
  } else {
    build_dense_table(table, p.rows);
  }
  const int u = blockIdx.x / p.row_blocks;
  const int block = blockIdx.x - u * p.row_blocks;
  if (u >= *table.count) {  // the host's grid is sized for min(E, pairs) distinct experts
    if (!waited) pdl_wait();
    return;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int64_t expert = table.expert[u];
  const int r0 = block * kUnitRows + g, r1 = r0 + 8;
  const bool valid0 = r0 < p.n, valid1 = r1 < p.n;
  const int steps = (p.k + kStep - 1) / kStep;
  const int begin = steps * warp / warps, mine = steps * (warp + 1) / warps - begin;
  const int64_t first = static_cast<int64_t>(begin) * kStep + 8 * c;  // this lane's k offset of its first step
  const T* up_lo = static_cast<const T*>(p.up) + expert * p.expert_stride + (valid0 ? r0 : 0) * p.ldw + first;
  const T* up_hi = static_cast<const T*>(p.up) + expert * p.expert_stride + (valid1 ? r1 : 0) * p.ldw + first;
  const T* gate_lo = nullptr;
  const T* gate_hi = nullptr;
  if constexpr (kGated) {
    gate_lo = static_cast<const T*>(p.gate) + expert * p.expert_stride + (valid0 ? r0 : 0) * p.ldw + first;
    gate_hi = static_cast<const T*>(p.gate) + expert * p.expert_stride + (valid1 ? r1 : 0) * p.ldw + first;
  }
  const bool has_input = table.row[u * kCols + g] >= 0;  // token g uses this expert
  const T* x = has_input ? static_cast<const T*>(p.x) + g * p.ldx + first : nullptr;
  const LaneRing<kPieces> ring = carve_ring<kPieces, kGateUpStages>(work, warp, lane);

  int issued = 0, issue_stage = 0, issue_offset = static_cast<int>(first);
  auto issue = [&] {  // the warp's next step into the next stage (an empty group past the end)
    if (issued < mine) {
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
  float acc_g[4] = {0.0f, 0.0f, 0.0f, 0.0f}, acc_u[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  int offset = static_cast<int>(first);
  uint4 x_next[2];
  load_step_input(x_next, x, offset, p.k);
  for (int j = 0, stage = 0; j < mine; ++j, stage = next_stage(stage, kGateUpStages)) {
    copy_wait<kGateUpStages - 2>();  // step j has landed
    uint4 w[kPieces];
#pragma unroll
    for (int q = 0; q < kPieces; ++q) w[q] = *ring.at(stage, q);
    const uint4 x0 = x_next[0], x1 = x_next[1];
    offset += kStep;
    if (x != nullptr) x += kStep;
    load_step_input(x_next, j + 1 < mine ? x : nullptr, offset, p.k);
    issue();  // into the stage read one step ago
    mma_chunk<T>(acc_u, w[0], w[1], x0);
    mma_chunk<T>(acc_u, w[2], w[3], x1);
    if constexpr (kGated) {
      mma_chunk<T>(acc_g, w[4], w[5], x0);
      mma_chunk<T>(acc_g, w[6], w[7], x1);
    }
  }
  copy_wait<0>();
  __syncthreads();  // the reduction reuses the rings

  float* red = static_cast<float*>(work);
  float* own = red + warp * 2 * kAccPerWarp;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    own[lane * 4 + i] = acc_u[i];
    if constexpr (kGated) own[kAccPerWarp + lane * 4 + i] = acc_g[i];
  }
  __syncthreads();
  for (int index = threadIdx.x; index < kAccPerWarp; index += blockDim.x) {
    float sum_u = 0.0f, sum_g = 0.0f;
    for (int w = 0; w < warps; ++w) {
      sum_u += red[w * 2 * kAccPerWarp + index];
      if constexpr (kGated) sum_g += red[w * 2 * kAccPerWarp + kAccPerWarp + index];
    }
    const int row = block * kUnitRows + acc_row(index);
    const int out_row = table.row[u * kCols + acc_col(index)];
    if (out_row < 0 || row >= p.n) continue;
    const float value =
        kGated ? gg::gated_act<true>(sum_g, sum_u, p.situ, p.situ_beta, p.situ_linear_beta) : gg::relu2_act(sum_u);
    static_cast<T*>(p.act)[out_row * p.ld_act + row] = from_float<T>(value);
  }
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
  const int32_t* ids = nullptr;  // nullptr: dense
  const float* weights = nullptr;
  int top_k = 1, num_experts = 1, max_unique = 1;
};

constexpr int kDownPieces = 4;  // {row g, row g + 8} x {chunk 0, chunk 1}

// One CTA: 16 output rows, summed over the distinct experts. The (expert, step) list, expert-major,
// is cut into one contiguous range per warp; each warp folds an expert's sums in with its
// coefficients when it leaves the expert, and the warps' sums are added in warp order.
template <class T>
__global__ void __launch_bounds__(kMaxWarps * 32) skinny_down_kernel(DownParams p) {
  extern __shared__ __align__(16) int smem[];
  const bool routed = p.ids != nullptr;
  const int pairs = routed ? p.rows * p.top_k : 0;
  const Table table = carve_table(smem, pairs, p.max_unique);
  void* work = smem + table_words(pairs, p.max_unique);
  if (routed) {
    build_routed_table(table, p.ids, p.weights, p.rows, p.top_k, p.num_experts);  // ids: two kernels back
  } else {
    build_dense_table(table, p.rows);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int block = blockIdx.x;
  const int r0 = block * kUnitRows + g, r1 = r0 + 8;
  const bool valid0 = r0 < p.n, valid1 = r1 < p.n;
  const int64_t o0 = static_cast<int64_t>(valid0 ? r0 : 0) * p.ldw + 8 * c;
  const int64_t o1 = static_cast<int64_t>(valid1 ? r1 : 0) * p.ldw + 8 * c;
  const T* w = static_cast<const T*>(p.w);
  const T* a = static_cast<const T*>(p.a);
  const int steps_per_expert = (p.k + kStep - 1) / kStep;
  const int total = *table.count * steps_per_expert;
  const int begin = static_cast<int>(static_cast<int64_t>(total) * warp / warps);
  const int mine = static_cast<int>(static_cast<int64_t>(total) * (warp + 1) / warps) - begin;
  const int first_unit = begin / steps_per_expert;
  const int first_offset = (begin - first_unit * steps_per_expert) * kStep + 8 * c;
  const LaneRing<kDownPieces> ring = carve_ring<kDownPieces, kDownStages>(work, warp, lane);

  // Issue cursor: the next step to copy.
  int issued = 0, issue_stage = 0, issue_unit = first_unit, issue_offset = first_offset;
  const T* w_lo = nullptr;
  const T* w_hi = nullptr;
  auto point_weights = [&] {
    const T* base = w + static_cast<int64_t>(table.expert[issue_unit]) * p.expert_stride;
    w_lo = base + o0 + (issue_offset - 8 * c);
    w_hi = base + o1 + (issue_offset - 8 * c);
  };
  if (mine > 0) point_weights();
  auto issue = [&] {
    if (issued < mine) {
      const bool v0 = issue_offset < p.k, v1 = issue_offset + kChunk < p.k;
      copy_weights(ring.at(issue_stage, 0), w_lo, valid0 && v0);
      copy_weights(ring.at(issue_stage, 1), w_hi, valid1 && v0);
      copy_weights(ring.at(issue_stage, 2), w_lo + kChunk, valid0 && v1);
      copy_weights(ring.at(issue_stage, 3), w_hi + kChunk, valid1 && v1);
      issue_offset += kStep;
      w_lo += kStep;
      w_hi += kStep;
      if (issue_offset - 8 * c >= p.k && issued + 1 < mine) {  // on to the next expert
        ++issue_unit;
        issue_offset = 8 * c;
        point_weights();
      }
    }
    copy_commit();
    ++issued;
    issue_stage = next_stage(issue_stage, kDownStages);
  };
  // Input cursor: the step whose inputs are loaded next (one ahead of the multiply).
  int input_unit = first_unit, input_offset = first_offset;
  const T* a_row = nullptr;
  auto point_input = [&] {
    const int row = table.row[input_unit * kCols + g];
    a_row = row >= 0 ? a + static_cast<int64_t>(row) * p.lda + input_offset : nullptr;
  };
  auto next_input = [&](uint4 (&v)[2], int j) {  // step j's inputs, then advance
    if (j >= mine) return;
    load_step_input(v, a_row, input_offset, p.k);
    input_offset += kStep;
    if (a_row != nullptr) a_row += kStep;
    if (input_offset - 8 * c >= p.k && j + 1 < mine) {
      ++input_unit;
      input_offset = 8 * c;
      point_input();
    }
  };

#pragma unroll
  for (int j = 0; j < kDownStages - 1; ++j) issue();
  pdl_wait();  // a and out: the previous kernel's
  pdl_trigger();
  if (mine > 0) point_input();
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // the current expert's
  float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // coefficient-weighted over the experts
  uint4 a_next[2] = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
  next_input(a_next, 0);
  int unit = first_unit, offset = first_offset;  // multiply cursor
  for (int j = 0, stage = 0; j < mine; ++j, stage = next_stage(stage, kDownStages)) {
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
    if (offset - 8 * c >= p.k || j + 1 == mine) {  // leaving the expert: fold it in with its coefficients
      const float c0 = table.coef[unit * kCols + 2 * c], c1 = table.coef[unit * kCols + 2 * c + 1];
      sum[0] = fmaf(c0, acc[0], sum[0]);
      sum[1] = fmaf(c1, acc[1], sum[1]);
      sum[2] = fmaf(c0, acc[2], sum[2]);
      sum[3] = fmaf(c1, acc[3], sum[3]);
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[i] = 0.0f;
      ++unit;
      offset = 8 * c;
    }
  }
  copy_wait<0>();
  __syncthreads();  // the reduction reuses the rings

  float* red = static_cast<float*>(work);
#pragma unroll
  for (int i = 0; i < 4; ++i) red[warp * kAccPerWarp + lane * 4 + i] = sum[i];
  __syncthreads();
  T* out = static_cast<T*>(p.out);
  for (int index = threadIdx.x; index < kAccPerWarp; index += blockDim.x) {
    const int row = block * kUnitRows + acc_row(index);
    const int token = acc_col(index);
    if (token >= p.rows || row >= p.n) continue;
    float value = 0.0f;
    for (int v = 0; v < warps; ++v) value += red[v * kAccPerWarp + index];
    T* target = out + token * p.ld_out + row;
    if (p.accumulate) value += to_float(*target);
    *target = from_float<T>(value);
  }
}

// CTA size for `units` units: the most warps (<= 16) that keep all units near kWarpsPerSm per SM.
int warps_for(int64_t units) {
  const int64_t target = static_cast<int64_t>(current_sm_count()) * kWarpsPerSm;
  int warps = kMaxWarps;
  while (warps > kMinWarps && units * warps > target) warps /= 2;
  return warps;
}

// Dynamic shared memory of a launch: the table, then per warp the larger of its ring (`ring_pieces`
// uint4 per lane) and its slots of the final reduction (`accumulators` 16 x 8 fp32 tiles).
size_t shared_bytes(int pairs, int max_unique, int warps, int ring_pieces, int accumulators) {
  const size_t per_warp = std::max<size_t>(static_cast<size_t>(ring_pieces) * 32 * sizeof(uint4),
                                           static_cast<size_t>(accumulators) * kAccPerWarp * sizeof(float));
  return table_words(pairs, max_unique) * sizeof(int) + warps * per_warp;
}
// The most any launch asks for: kMaxWarps gated gate/up warps with the largest table.
constexpr int kMaxSharedBytes =
    table_words(kSkinnyMaxRows * kSkinnyMaxTopK, kSkinnyMaxRows * kSkinnyMaxTopK) * 4 + kMaxWarps * kGateUpStages * gate_up_pieces<true>() * 512;
static_assert(kMaxWarps * kDownStages * kDownPieces * 512 <= kMaxWarps * kGateUpStages * gate_up_pieces<true>() * 512);
static_assert(kMaxSharedBytes <= 227 * 1024, "the skinny rings exceed an SM's shared memory");

bool routed_call(const SkinnyRouting& routing) { return routing.topk_ids != nullptr; }

bool aligned16(const void* data, int64_t ld, size_t element) {
  return reinterpret_cast<uintptr_t>(data) % 16 == 0 && (static_cast<size_t>(ld) * element) % 16 == 0;
}

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

}  // namespace

bool skinny_supported(DType dtype, int64_t rows, int64_t k, std::initializer_list<SkinnyRows> operands) {
  if (dtype != DType::bf16 && dtype != DType::f16) return false;
  if (rows < 1 || rows > kSkinnyMaxRows || k < 8 || k % 8 != 0 || k > INT_MAX / 2) return false;
  for (const SkinnyRows& operand : operands) {
    if (operand.data != nullptr && !aligned16(operand.data, operand.ld, dtype_size(dtype))) return false;
  }
  return current_compute_capability() >= 80;  // mma.sync bf16/f16
}

void skinny_gate_up(DType dtype, const ::latentmoe::detail::ActivationParams& activation, const SkinnyRouting& routing,
                    const SkinnyRows& x, int64_t rows, const SkinnyWeights& weights, void* act, int64_t ld_act,
                    cudaStream_t stream) {
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
  const int warps = warps_for(units);
  const int pieces = gated ? gate_up_pieces<true>() : gate_up_pieces<false>();
  const size_t shared = shared_bytes(pairs, p.max_unique, warps, kGateUpStages * pieces, 2);
  const auto grid = static_cast<unsigned>(units);
  const unsigned threads = warps * 32;
  auto launch = [&](auto tag) {
    using T = decltype(tag);
    if (gated) {
      static std::atomic<uint64_t> limit_set{0};
      gg::ensure_smem_limit(reinterpret_cast<const void*>(skinny_gate_up_kernel<T, true>), kMaxSharedBytes, &limit_set);
      launch_dependent("skinny_gate_up_kernel", skinny_gate_up_kernel<T, true>, grid, threads, shared, stream, p);
    } else {
      static std::atomic<uint64_t> limit_set{0};
      gg::ensure_smem_limit(reinterpret_cast<const void*>(skinny_gate_up_kernel<T, false>), kMaxSharedBytes, &limit_set);
      launch_dependent("skinny_gate_up_kernel", skinny_gate_up_kernel<T, false>, grid, threads, shared, stream, p);
    }
  };
  if (dtype == DType::bf16) {
    launch(__nv_bfloat16{});
  } else {
    launch(__half{});
  }
}

void skinny_down(DType dtype, const SkinnyRouting& routing, const SkinnyRows& a, int64_t rows,
                 const SkinnyWeights& weights, void* out, int64_t ld_out, bool accumulate, cudaStream_t stream) {
  if (rows == 0) return;
  check_common("skinny_down", dtype, routing, rows, weights, {a, {weights.w, weights.ld}});
  LATENTMOE_CHECK(ld_out >= weights.n, "skinny_down: output row stride ", ld_out, " < n = ", weights.n);
  const bool routed = routed_call(routing);
  LATENTMOE_CHECK(!routed || routing.topk_weights != nullptr, "skinny_down: a routed call needs topk_weights");
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
  p.ids = routing.topk_ids;
  p.weights = routing.topk_weights;
  p.top_k = routed ? routing.top_k : 1;
  p.num_experts = routed ? routing.num_experts : 1;
  const int pairs = routed ? p.rows * p.top_k : 0;
  p.max_unique = routed ? std::min(p.num_experts, pairs) : 1;
  const int64_t units = (weights.n + kUnitRows - 1) / kUnitRows;
  const int warps = warps_for(units);
  const size_t shared = shared_bytes(pairs, p.max_unique, warps, kDownStages * kDownPieces, 1);
  const auto grid = static_cast<unsigned>(units);
  const unsigned threads = warps * 32;
  auto launch = [&](auto tag) {
    using T = decltype(tag);
    static std::atomic<uint64_t> limit_set{0};
    gg::ensure_smem_limit(reinterpret_cast<const void*>(skinny_down_kernel<T>), kMaxSharedBytes, &limit_set);
    launch_dependent("skinny_down_kernel", skinny_down_kernel<T>, grid, threads, shared, stream, p);
  };
  if (dtype == DType::bf16) {
    launch(__nv_bfloat16{});
  } else {
    launch(__half{});
  }
}

}  // namespace latentmoe::cuda

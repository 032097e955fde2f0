// MXFP4 routed experts at decode on the tensor cores (bf16 and f16 activations; mxfp4_decode_mma.h).
//
// Operands straight from the checkpoint's layout into mma.m16n8k16 fragments; no repack, no
// dequantised copy. A warp computes a 16-row tile of one expert matrix against up to 8 tokens (the
// MMA's N): lane (g = lane / 4, t = lane % 4) loads, for scale group q, the 4 code bytes 4t..4t+3 of
// rows g and g + 8 (8 E2M1 values each, physical columns 32q + 8t .. 32q + 8t + 7) and the 8 activation
// values of token g at the same columns (16 bytes). The MMA's k order is a permutation of the physical
// one, the same for A and B: the column pairs (0, 1), (2, 3) of the eight feed the first MMA's k slots
// {2t, 2t+1} and {2t+8, 2t+9}, (4, 5), (6, 7) the second's, so each pair is one register of decoded
// codes (e2m1_pair: the kernel order, mxfp4_device.cuh) and one 32-bit word of the activation row as
// loaded.
//
// Numerics: E2M1 values are exact in bf16 and f16. They are placed as the subnormal E2M1 * 2^-126
// (bf16) or E2M1 * 2^-14 (f16) and multiplied by 2^126 / 2^14 (exact). The two MMAs of one group give
// that group's fp32 dot products unscaled (the group lies inside one row's single scale), which are
// multiplied by the group's power of two in fp32 (exact unless the true value leaves the fp32 range) and
// added to the fp32 accumulators group by group. Partial sums of the warps that split K are added in
// warp order, then the activation (gate/up) or the rounding (down) is applied once: results are
// deterministic run to run; the order of additions differs from the CPU reference's, so they agree
// within rounding.
//
// gate/up: one CTA per (8 / split consecutive 16-row tiles, pair p); the CTA of the first pair naming an
//   expert computes that expert for every token that names it (so each touched expert's weights are read
//   once) and writes act row p' = the first pair by which each token names it; other CTAs of that expert
//   exit. The `split` warps of a tile (8, 2 or 1: choose_gate_up_split) share the groups of K.
// down: one cluster of `split` CTAs per 16-row tile of the output; each warp of the cluster takes a
//   contiguous range of the (touched expert, chunk of groups) work items, loaded ahead in a ring of registers
//   (four items in flight at one token, two above: kDownDeepTokens); each item's products are
//   weighted by the routing weight of each token (summed over the pairs by which a token names the
//   expert), and the cluster's partial sums are added in a fixed order through distributed shared
//   memory.
// The down kernel is a programmatic dependent of gate/up (pdl.cuh): gate/up triggers at once, so down's CTAs start
// in gate/up's last wave and build their expert list there, and wait for gate/up only before they read its act
// rows. So mxfp4_mma_down must follow the gate/up kernel of the same call on its stream with nothing in between
// that writes the routing (mxfp4_decode.h).
//
// Speed (docs/MXFP4.md): bound by the DRAM round trip of each warp's chunk (ncu on an H100, Kimi-K3 tp-shard 8:
// gate/up 46-57% and down 20-42% of DRAM bandwidth at 1-8 tokens, under one eligible warp per scheduler). Measured
// and taken out (session 17): a bulk L2 prefetch of each CTA's whole share when it starts (slower at 4-8 tokens) and
// per-warp cp.async rings of 4 chunks for the codes and scale words (no faster in the layer, gate/up slower alone).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <climits>
#include <cstdint>
#include <type_traits>

#include "cuda/common/activation.cuh"
#include "cuda/common/cluster.cuh"
#include "cuda/common/convert.cuh"
#include "cuda/common/cuda_check.h"
#include "cuda/common/device.h"
#include "cuda/common/matrix.h"
#include "cuda/common/mma.cuh"
#include "cuda/common/pdl.cuh"
#include "cuda/gemm/mxfp4_decode_mma.h"
#include "cuda/gemm/mxfp4_device.cuh"
#include "latentmoe/error.h"

namespace latentmoe::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kTileRows = 16;
constexpr int kGroup = kMxfp4Group;  // columns per scale
constexpr int kChunk = 2;            // consecutive scale groups a warp takes at a time (one 32-byte sector of a row)
constexpr int kMaxTokens = 8;        // the MMA's N
constexpr int kMaxPairs = kThreads;  // tokens * top_k: one thread per pair in the routing prologues
// CTAs per SM the register budget must allow (at most 80 registers a thread). Measured on the H200 (b014371,
// docs/MXFP4.md): 5-7% faster than 2 per SM from 2 to 8 tokens, both presets; Kimi-K3 tp 8's 384 gate/up
// CTAs at one token then run in one wave instead of 1.5. With the gate/up double buffer the gated kernel
// spilled at this bound and was slower (05fbeeb).
constexpr int kMinCtasPerSm = 3;
// The ungated (relu2) gate/up kernel needs fewer registers: 4 CTAs per SM (at most 64 registers). Measured
// with ncu on nemotron3-super at 8 tokens (docs/MXFP4.md): at 70 registers (3 CTAs) it ran 23% slower than at
// 62 (4 CTAs).
constexpr int kMinCtasPerSmUngated = 4;
// The down kernel keeps kInFlight work items of a warp in registers (a ring): 2 (79 registers, 3 CTAs per SM) or 4
// (127-128 registers, 2 CTAs per SM). At one token (Kimi-K3 tp-shard 8, 224 clusters) only 13 of an SM's warps are
// resident, so each warp's loads in flight bound the bytes in flight (ncu, docs/MXFP4.md). Measured on an H100
// (session 27, bench layer alternating, three rounds; docs/MXFP4.md, "Eighth measurement"): four in flight make the
// routed experts alone 8-10% faster at 1-8 tokens, but the layer graph only at one token (1-4%, three calls); at 2
// and 4 tokens it was 4-5% slower, its registers leaving no room on the SMs for the shared expert that runs beside
// it. So: four at one token.
constexpr int kDownDeepTokens = 1;    // calls of up to this many tokens take the deep ring
constexpr int kDownInFlightDeep = 4;  // 2 CTAs per SM
constexpr int kDownInFlight = 2;      // kMinCtasPerSm
constexpr int down_min_ctas_per_sm(int in_flight) { return in_flight == kDownInFlightDeep ? 2 : kMinCtasPerSm; }

// One lane's share of one scale group: the code words of rows g and g + 8, their scale bytes, and the
// 8 activation values of token g (zero for a token beyond the call's or one that does not take part).
struct GroupOperands {
  uint32_t code_lo = 0, code_hi = 0;  // rows g, g + 8
  uint32_t scale_lo = 0, scale_hi = 0;
  uint4 x = {0, 0, 0, 0};
};

// Through L1 (no-allocate would send each 32-byte sector's second half, the next group's bytes, back
// to L2 for another request): a warp's consecutive groups of one row share sectors. A 128-byte L2
// prefetch on the gate/up loads (which gained the rows kernel 13-22%) measured no change here (H100,
// fc6ce31 against 5bb32e4, bench layer 1-8 tokens: the `split` warps of a tile already read 32 * split
// consecutive bytes of each row together) and was taken out.
__device__ __forceinline__ uint32_t load_u32(const uint8_t* address) {
  return __ldg(reinterpret_cast<const unsigned int*>(address));
}

// The group's two MMAs on unscaled values, then the scale of each row, into acc (c0, c1: row g;
// c2, c3: row g + 8; columns 2t, 2t + 1). factor_even / factor_odd multiply columns 2t / 2t + 1.
template <class T>
__device__ __forceinline__ void group_mma(float (&acc)[4], const GroupOperands& op, float factor_even,
                                          float factor_odd) {
  float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  mma_16x8x16<T>(d, e2m1_pair<T, 0>(op.code_lo), e2m1_pair<T, 0>(op.code_hi), e2m1_pair<T, 1>(op.code_lo),
                 e2m1_pair<T, 1>(op.code_hi), op.x.x, op.x.y);
  mma_16x8x16<T>(d, e2m1_pair<T, 2>(op.code_lo), e2m1_pair<T, 2>(op.code_hi), e2m1_pair<T, 3>(op.code_lo),
                 e2m1_pair<T, 3>(op.code_hi), op.x.z, op.x.w);
  const float scale_lo = e8m0_scale(op.scale_lo), scale_hi = e8m0_scale(op.scale_hi);
  acc[0] = fmaf(d[0], scale_lo * factor_even, acc[0]);
  acc[1] = fmaf(d[1], scale_lo * factor_odd, acc[1]);
  acc[2] = fmaf(d[2], scale_hi * factor_even, acc[2]);
  acc[3] = fmaf(d[3], scale_hi * factor_odd, acc[3]);
}

// One lane's rows of a 16-row tile of one MXFP4 matrix: rows g and g + 8 of the expert whose first row
// is row expert * rows, each clamped to the matrix's last row (a row past it is read but never stored: the
// kernels store only rows < rows), so every load is unconditional; their code bytes 4t .. 4t + 3 of
// group 0 and their scale bytes of group 0.
struct TileRows {
  const uint8_t* code_lo;
  const uint8_t* code_hi;
  const uint8_t* scale_lo;
  const uint8_t* scale_hi;
};

// Offsets inside one expert's matrix are 32-bit (the host checks rows * cols / 2 <= INT_MAX): the set-up
// of the pointers before the loops is a few 32-bit products instead of ~130 instructions of 64-bit ones
// (measured on nemotron3-super's two-chunk relu2 loop, docs/MXFP4.md). `first_group`: where the pointers start.
__device__ __forceinline__ TileRows tile_rows(const Mxfp4Matrices& m, int expert, int row0, int t, int first_group) {
  const int rows = static_cast<int>(m.rows), groups = static_cast<int>(m.cols / kGroup),
            row_bytes = groups * (kGroup / 2);
  const int lo = min(row0, rows - 1), hi = min(row0 + 8, rows - 1);
  const int64_t expert_row = static_cast<int64_t>(expert) * rows;  // the one 64-bit product
  const uint8_t* codes = m.packed + expert_row * row_bytes + first_group * (kGroup / 2) + 4 * t;
  const uint8_t* scales = m.scales + expert_row * groups + first_group;
  return TileRows{codes + lo * row_bytes, codes + hi * row_bytes, scales + lo * groups, scales + hi * groups};
}

// Codes and scales of the last, partial chunk: its first `left` (< kChunk) groups from where `r` points, the
// missing ones as zero codes.
__device__ __forceinline__ void load_partial_chunk(GroupOperands (&op)[kChunk], const TileRows& r, int64_t left) {
#pragma unroll
  for (int j = 0; j < kChunk; ++j) {
    const bool valid = j < left;
    op[j].code_lo = valid ? load_u32(r.code_lo + j * (kGroup / 2)) : 0u;
    op[j].code_hi = valid ? load_u32(r.code_hi + j * (kGroup / 2)) : 0u;
    op[j].scale_lo = valid ? __ldg(r.scale_lo + j) : 0u;
    op[j].scale_hi = valid ? __ldg(r.scale_hi + j) : 0u;
  }
}

// Moves every pointer of `r` on by `groups` scale groups.
__device__ __forceinline__ void advance(TileRows& r, int64_t groups) {
  r.code_lo += groups * (kGroup / 2);
  r.code_hi += groups * (kGroup / 2);
  r.scale_lo += groups;
  r.scale_hi += groups;
}

// Codes and scales of the kChunk groups `r` points at (all of them inside the matrix), from immediate offsets.
__device__ __forceinline__ void load_whole_chunk(GroupOperands (&op)[kChunk], const TileRows& r) {
#pragma unroll
  for (int j = 0; j < kChunk; ++j) {
    op[j].code_lo = load_u32(r.code_lo + j * (kGroup / 2));
    op[j].code_hi = load_u32(r.code_hi + j * (kGroup / 2));
    op[j].scale_lo = __ldg(r.scale_lo + j);
    op[j].scale_hi = __ldg(r.scale_hi + j);
  }
}

// The activation values of the last, partial chunk for this lane's token: its first `left` (< kChunk) groups
// from `row` (zero when the lane's token takes no part, and past the groups).
template <class T>
__device__ __forceinline__ void load_partial_x_chunk(GroupOperands (&op)[kChunk], const T* row, bool active,
                                                     int64_t left, int t) {
#pragma unroll
  for (int j = 0; j < kChunk; ++j) {
    op[j].x = active && j < left ? *reinterpret_cast<const uint4*>(row + j * kGroup + 8 * t) : uint4{0, 0, 0, 0};
  }
}

// ---- gate/up -------------------------------------------------------------------------------------

// kSplit: the warps that split one tile's K (8: the whole CTA on one tile, the groups of K spread over its
// warps; 1: each warp one tile over all of K). A CTA covers kWarps / kSplit consecutive tiles. Fewer warps per
// tile amortise each warp's pointer set-up and the CTA's routing prologue over more groups, where the call has
// enough (tile, pair) units to fill the GPU without splitting K (choose_gate_up_split).
template <class T, bool kGated, int kSplit>
__global__ void __launch_bounds__(kThreads, kGated ? kMinCtasPerSm : kMinCtasPerSmUngated)
    mxfp4_mma_gate_up_kernel(Mxfp4GateUpCall p) {
  static_assert(kSplit >= 1 && kWarps % kSplit == 0);
  constexpr int kTilesPerCta = kWarps / kSplit;
  __shared__ int act_row[kMaxTokens];  // per token: the pair whose act row it writes, or -1
  __shared__ float partial[kWarps][2][4][32];
  // Never launched as a dependent (pdl.cuh, 3.): the down kernel after it may start as soon as every CTA of this
  // one is running, and build its expert lists in this kernel's last wave.
  pdl_trigger();
  const int pair = blockIdx.y;
  const int expert = p.ids[pair];
  if (expert < 0 || expert >= p.num_experts) return;  // a zero expert or a pad: no row
  const int pairs = p.tokens * p.top_k;
  // Only the first pair naming the expert computes it (for every token).
  const bool earlier = threadIdx.x < pair && p.ids[threadIdx.x] == expert;
  if (__syncthreads_or(earlier)) return;
  if (threadIdx.x < kMaxTokens) act_row[threadIdx.x] = INT_MAX;
  __syncthreads();
  if (threadIdx.x < pairs && p.ids[threadIdx.x] == expert) atomicMin(&act_row[threadIdx.x / p.top_k], threadIdx.x);
  __syncthreads();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int part = warp % kSplit;  // this warp's share of K
  const int first_tile = static_cast<int>(blockIdx.x) * kTilesPerCta;
  // A tile past the matrix (the last CTA's) reads clamped rows (tile_rows) and stores nothing.
  const int row0 = (first_tile + warp / kSplit) * kTileRows + g;
  const int groups = static_cast<int>(p.up.cols / kGroup);  // 32-bit: check_expert_offsets
  // Only the tokens that name the expert read their activations (the others' MMA columns are zeros and
  // never stored): reading every token's row measured 6-7% slower on Nemotron's relu2 experts, whose
  // activation rows are as many bytes as the tile's codes.
  const bool token_active = g < p.tokens && act_row[g] != INT_MAX;
  const T* z_row = static_cast<const T*>(p.z) + (token_active ? g * p.ld_z : 0) + 8 * t;
  TileRows up_rows = tile_rows(p.up, expert, row0, t, part * kChunk);
  TileRows gate_rows = kGated ? tile_rows(p.gate, expert, row0, t, part * kChunk) : up_rows;
  float up[4] = {0.0f, 0.0f, 0.0f, 0.0f}, gate[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  // Chunks of kChunk consecutive groups per warp (chunk c: groups kChunk c ..; the lanes of a row read
  // whole sectors), one at a time: double-buffering them measured nothing (221b153) and its registers
  // kept the kernel at 2 CTAs per SM (kMinCtasPerSm). The whole chunks walk pointers that advance by a
  // constant (no 64-bit address arithmetic per load); a last, partial chunk is taken after the loop.
  const int whole_chunks = groups / kChunk;
  constexpr int kStrideGroups = kSplit * kChunk;
  const T* z_chunk = z_row + part * kChunk * kGroup;
  GroupOperands u[kChunk], v[kChunk];
  auto compute = [&] {  // the chunk in u (and v), both matrices against u's activations
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      group_mma<T>(up, u[j], 1.0f, 1.0f);
      if constexpr (kGated) {
        v[j].x = u[j].x;
        group_mma<T>(gate, v[j], 1.0f, 1.0f);
      }
    }
  };
  for (int chunk = part; chunk < whole_chunks; chunk += kSplit) {
    load_whole_chunk(u, up_rows);
    if constexpr (kGated) load_whole_chunk(v, gate_rows);
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      u[j].x = token_active ? *reinterpret_cast<const uint4*>(z_chunk + j * kGroup) : uint4{0, 0, 0, 0};
    }
    compute();
    advance(up_rows, kStrideGroups);
    if constexpr (kGated) advance(gate_rows, kStrideGroups);
    z_chunk += kStrideGroups * kGroup;
  }
  if (groups % kChunk != 0 && whole_chunks % kSplit == part) {  // the partial chunk: the pointers are there
    const int left = groups - whole_chunks * kChunk;
    load_partial_chunk(u, up_rows, left);
    if constexpr (kGated) load_partial_chunk(v, gate_rows, left);
    load_partial_x_chunk(u, z_chunk - 8 * t, token_active, left, t);
    compute();
  }
  for (int i = 0; i < 4; ++i) {
    partial[warp][0][i][lane] = up[i];
    partial[warp][1][i][lane] = gate[i];
  }
  __syncthreads();
  // 128 outputs per tile (16 rows x 8 tokens): output (tile, i, lane) sums the tile's kSplit warps in warp order.
#pragma unroll 1
  for (int o = threadIdx.x; o < kTilesPerCta * 4 * 32; o += kThreads) {
    const int tile = o / (4 * 32), i = (o / 32) % 4, l = o % 32;
    float u = 0.0f, v = 0.0f;
#pragma unroll
    for (int w = 0; w < kSplit; ++w) {
      u += partial[tile * kSplit + w][0][i][l];
      v += partial[tile * kSplit + w][1][i][l];
    }
    const int token = 2 * (l % 4) + (i & 1);
    const int64_t row = static_cast<int64_t>(first_tile + tile) * kTileRows + l / 4 + (i >= 2 ? 8 : 0);
    if (token < p.tokens && act_row[token] != INT_MAX && row < p.up.rows) {
      const float value = kGated ? act::gated(v, u, p.activation.activation == Activation::situ, p.activation.situ_beta,
                                              p.activation.situ_linear_beta)
                                 : act::relu2(u);
      static_cast<T*>(p.act)[static_cast<int64_t>(act_row[token]) * p.up.rows + row] = from_float<T>(value);
    }
  }
}

// ---- down ----------------------------------------------------------------------------------------

// The touched experts of the call in order of first naming, and per expert and token the act row (the
// first pair by which the token names it, -1: it does not) and the summed routing weight.
struct ExpertList {
  int count;
  int expert[kMaxPairs];
  int act_row[kMaxPairs][kMaxTokens];
  float weight[kMaxPairs][kMaxTokens];
  // The call's ids and weights, one load a thread: each pair's walk over its token's top_k pairs below then reads
  // shared memory instead of making top_k dependent global loads.
  int pair_id[kMaxPairs];
  float pair_weight[kMaxPairs];
};

// Built by every CTA from ids (one thread per pair); `first_pair` is shared scratch of num_experts ints.
__device__ void build_expert_list(const Mxfp4DownCall& p, ExpertList& list, int* first_pair, int* slot_of_pair) {
  const int pairs = p.tokens * p.top_k;
  const int pair = threadIdx.x;
  const int expert = pair < pairs ? p.ids[pair] : -1;
  list.pair_id[pair] = expert;
  list.pair_weight[pair] = pair < pairs ? p.weights[pair] : 0.0f;
  for (int e = threadIdx.x; e < p.num_experts; e += kThreads) first_pair[e] = INT_MAX;
  for (int i = threadIdx.x; i < pairs * kMaxTokens; i += kThreads) {  // slots < count <= pairs
    list.act_row[i / kMaxTokens][i % kMaxTokens] = -1;
    list.weight[i / kMaxTokens][i % kMaxTokens] = 0.0f;
  }
  __syncthreads();
  const bool real = expert >= 0 && expert < p.num_experts;
  if (real) atomicMin(&first_pair[expert], pair);
  __syncthreads();
  // Slots in order of first naming: a block-wide exclusive count of the experts' first pairs.
  const bool first = real && first_pair[expert] == pair;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const unsigned ballot = __ballot_sync(0xffffffffu, first);
  __shared__ int warp_counts[kWarps];
  if (lane == 0) warp_counts[warp] = __popc(ballot);
  __syncthreads();
  int before = __popc(ballot & ((1u << lane) - 1u));
  for (int w = 0; w < warp; ++w) before += warp_counts[w];
  if (first) {
    slot_of_pair[pair] = before;
    list.expert[before] = expert;
  }
  if (threadIdx.x == kThreads - 1) list.count = before + (first ? 1 : 0);
  __syncthreads();
  // The token's first pair naming the expert writes the token's entry, summing the weights of its pairs.
  if (real) {
    const int token = pair / p.top_k, j = pair % p.top_k;
    bool token_first = true;
    float weight = 0.0f;
    for (int jj = 0; jj < p.top_k; ++jj) {
      if (list.pair_id[token * p.top_k + jj] != expert) continue;
      if (jj < j) token_first = false;
      weight += list.pair_weight[token * p.top_k + jj];
    }
    if (token_first) {
      const int slot = slot_of_pair[first_pair[expert]];
      list.act_row[slot][token] = pair;
      list.weight[slot][token] = weight;
    }
  }
  __syncthreads();
}

template <class T, int kInFlight>
__global__ void __launch_bounds__(kThreads, down_min_ctas_per_sm(kInFlight))
    mxfp4_mma_down_kernel(Mxfp4DownCall p, int split) {
  static_assert(kInFlight >= 2);
  extern __shared__ int first_pair[];  // [num_experts]
  __shared__ ExpertList list;
  __shared__ int slot_of_pair[kMaxPairs];
  __shared__ float partial[kWarps][4][32];
  build_expert_list(p, list, first_pair, slot_of_pair);

  const int rank = static_cast<int>(blockIdx.x) % split;
  const int64_t tile = blockIdx.x / split;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int row0 = static_cast<int>(tile) * kTileRows + g;
  const int64_t groups = p.down.cols / kGroup;
  // Work items (touched expert, chunk of kChunk consecutive groups) in expert-major order; each warp of
  // the cluster takes one contiguous range of them (so it walks an expert's chunks in order, one division
  // per warp), kInFlight of them loaded in a ring of registers.
  const int chunks = static_cast<int>((groups + kChunk - 1) / kChunk);
  const int items = list.count * chunks;  // 32-bit: count <= 256 pairs, chunks <= INT_MAX / 256 (host check)
  const int warps_total = split * kWarps;
  const int per_warp = (items + warps_total - 1) / warps_total;
  const int begin = min(items, (rank * kWarps + warp) * per_warp), end = min(items, begin + per_warp);
  // Launched as a programmatic dependent of the gate/up kernel (mxfp4_mma_down): everything above read only the
  // routing (written before gate/up started); the act rows below are gate/up's.
  pdl_wait();
  pdl_trigger();
  int slot = chunks > 0 ? begin / chunks : 0, chunk = begin - slot * chunks;
  // The current expert's rows, activation row and weights, recomputed only when the slot changes.
  int rows_slot = -1, act_row = -1;
  TileRows rows{};
  const T* act = nullptr;
  float2 slot_weight = make_float2(0.0f, 0.0f);
  auto load = [&](GroupOperands(&op)[kChunk], float2& weight) {
    if (slot != rows_slot) {  // a warp's range may begin inside an expert: start at its chunk
      rows_slot = slot;
      rows = tile_rows(p.down, list.expert[slot], row0, t, chunk * kChunk);
      act_row = g < p.tokens ? list.act_row[slot][g] : -1;
      act = static_cast<const T*>(p.act) + static_cast<int64_t>(act_row < 0 ? 0 : act_row) * p.down.cols +
            static_cast<int64_t>(chunk) * kChunk * kGroup + 8 * t;
      slot_weight = make_float2(list.weight[slot][2 * t], list.weight[slot][2 * t + 1]);
    }
    // Zeros for a token that does not name the expert: its weight is 0 there, and 0 * inf would be NaN.
    const bool active = act_row >= 0;
    if (chunk + 1 < chunks || groups % kChunk == 0) {  // a whole chunk, from the pointers' immediate offsets
      load_whole_chunk(op, rows);
#pragma unroll
      for (int j = 0; j < kChunk; ++j) {
        op[j].x = active ? *reinterpret_cast<const uint4*>(act + j * kGroup) : uint4{0, 0, 0, 0};
      }
    } else {
      const int64_t left = groups - static_cast<int64_t>(chunk) * kChunk;
      load_partial_chunk(op, rows, left);
      load_partial_x_chunk(op, act - 8 * t, active, left, t);
    }
    advance(rows, kChunk);
    act += kChunk * kGroup;
    weight = slot_weight;
    if (++chunk == chunks) {  // the next item
      chunk = 0;
      ++slot;
    }
  };
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  auto compute = [&](const GroupOperands(&op)[kChunk], float2 weight) {
#pragma unroll
    for (int j = 0; j < kChunk; ++j) group_mma<T>(acc, op[j], weight.x, weight.y);
  };
  // The ring: slot s holds item `base + s`. Items are loaded in order (load() walks them), each kInFlight - 1
  // ahead of the one computed; a slot is loaded again only after its item was computed. Indices are constants
  // (the loop over slots is unrolled), so the ring stays in registers.
  GroupOperands ring[kInFlight][kChunk];
  float2 ring_weight[kInFlight];
#pragma unroll
  for (int s = 0; s < kInFlight - 1; ++s) {
    if (begin + s < end) load(ring[s], ring_weight[s]);
  }
  for (int base = begin; base < end; base += kInFlight) {
#pragma unroll
    for (int s = 0; s < kInFlight; ++s) {
      constexpr int kAhead = kInFlight - 1;
      if (base + s < end) {
        if (base + s + kAhead < end) load(ring[(s + kAhead) % kInFlight], ring_weight[(s + kAhead) % kInFlight]);
        compute(ring[s], ring_weight[s]);
      }
    }
  }
  for (int i = 0; i < 4; ++i) partial[warp][i][lane] = acc[i];
  cluster_barrier(split);
  if (rank == 0 && threadIdx.x < 4 * 32) {
    const int i = threadIdx.x / 32, l = threadIdx.x % 32;
    float total = 0.0f;
    for (int r = 0; r < split; ++r) {
      const float* peer = cluster_shared(&partial[0][0][0], r, split);
      for (int w = 0; w < kWarps; ++w) total += peer[(w * 4 + i) * 32 + l];
    }
    const int token = 2 * (l % 4) + (i & 1);
    const int64_t row = tile * kTileRows + l / 4 + (i >= 2 ? 8 : 0);
    if (token < p.tokens && row < p.down.rows) {
      static_cast<T*>(p.out)[token * p.ld_out + row] = from_float<T>(total);
    }
  }
  cluster_barrier(split);  // the peers' shared memory stays alive until rank 0 has read it
}

template <class Kernel>
void open_shared(Kernel kernel, size_t bytes) {
  static_assert(sizeof(ExpertList) < 48 * 1024);
  if (bytes + sizeof(ExpertList) + 4096 > 48 * 1024) {
    LATENTMOE_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  }
}

// The down kernel's instances, as ctas_per_sm's tags.
template <class T, int kInFlight>
struct DownInstance {};

// Resident CTAs per SM of `kernel` with `shared` dynamic bytes on the current device, queried once per (device,
// instance) and again only when `shared` (the model's expert count) changes: the down launcher asks on every decode
// step, and the occupancy query is a driver call. Tag names the instance (its pointer type is the other instance's).
template <class Tag, class Kernel>
int ctas_per_sm(Kernel kernel, size_t shared) {
  static std::array<std::atomic<uint64_t>, 64> cache{};  // per device: shared << 32 | (CTAs per SM + 1), 0 unset
  int device = 0;
  LATENTMOE_CUDA_CHECK(cudaGetDevice(&device));
  const bool cacheable = device >= 0 && device < static_cast<int>(cache.size()) && shared <= UINT32_MAX;
  if (cacheable) {
    const uint64_t entry = cache[device].load(std::memory_order_relaxed);
    if ((entry & 0xFFFFFFFFu) != 0 && (entry >> 32) == shared) return static_cast<int>(entry & 0xFFFFFFFFu) - 1;
  }
  int per_sm = 0;
  LATENTMOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, shared));
  if (cacheable) {
    cache[device].store(static_cast<uint64_t>(shared) << 32 | static_cast<uint64_t>(per_sm + 1),
                        std::memory_order_relaxed);
  }
  return per_sm;
}

// The gate/up kernel's warps per tile along K. With at least 64 groups of K (8 or more per warp at 8 warps a
// tile) all 8: measured on an H100, Kimi-K3's gated experts (112 groups) ran 5-11% slower at tp-shard 1 with 1
// or 2 warps a tile. Shorter K: the fewest of 1 and 2 whose warps ((tile, pair) units x split) still fill one
// wave of the SMs at the kernel's CTAs per SM, else 8; Nemotron-3's relu2 experts (32 groups) ran 4-14% faster
// with 1 or 2 (docs/MXFP4.md). Pairs stand in for the touched experts (an upper bound: only the device knows
// which pairs repeat an expert). `forced` (the call's warps_per_tile) other than 0 is taken as it is.
int choose_gate_up_split(int forced, int64_t tiles, int64_t pairs, int64_t groups, bool gated) {
  if (forced != 0) {
    LATENTMOE_CHECK(forced == 1 || forced == 2 || forced == kWarps, "MXFP4 gate/up: ", forced,
                    " warps per tile; expected 0 (the measured rule), 1, 2 or ", kWarps);
    return forced;
  }
  if (groups >= 8 * kWarps) return kWarps;
  const int64_t resident =
      static_cast<int64_t>(current_sm_count()) * (gated ? kMinCtasPerSm : kMinCtasPerSmUngated) * kWarps;
  for (int split : {1, 2}) {
    if (tiles * pairs * split >= resident) return split;
  }
  return kWarps;
}

// The kernels' in-expert offsets are 32-bit (tile_rows): one expert's codes below 2 GiB.
void check_expert_offsets(const Mxfp4Matrices& m, const char* what) {
  LATENTMOE_CHECK(m.rows >= 1 && m.cols >= kGroup && m.rows <= INT_MAX / (m.cols / 2), "MXFP4 tensor-core ", what,
                  ": one expert's codes (", m.rows, " x ", m.cols / 2,
                  " bytes) exceed the kernels' 32-bit in-expert offsets (2^31 - 1 bytes)");
}

}  // namespace

bool mxfp4_mma_supported(DType dtype, int64_t tokens, int top_k, const void* x, int64_t ld_x) {
  return (dtype == DType::bf16 || dtype == DType::f16) && tokens >= 1 && tokens <= kMaxTokens &&
         tokens * top_k <= kMaxPairs && rows_aligned(x, ld_x, 2, 16) && current_compute_capability() >= 80;
}

void mxfp4_mma_gate_up(const Mxfp4GateUpCall& call, cudaStream_t stream) {
  LATENTMOE_CHECK(mxfp4_mma_supported(call.dtype, call.tokens, call.top_k, call.z, call.ld_z),
                  "MXFP4 tensor-core gate/up: unsupported call");
  const int64_t tiles = (call.up.rows + kTileRows - 1) / kTileRows;
  LATENTMOE_CHECK(tiles <= INT_MAX, "MXFP4 gate/up: ", call.up.rows, " rows exceed the grid");
  check_expert_offsets(call.up, "gate/up");
  if (call.gate.packed != nullptr) check_expert_offsets(call.gate, "gate/up");
  const bool gated = call.gate.packed != nullptr;
  const int64_t pairs = call.tokens * call.top_k;
  const int split = choose_gate_up_split(call.warps_per_tile, tiles, pairs, call.up.cols / kGroup, gated);
  const int64_t tiles_per_cta = kWarps / split;
  const dim3 grid(static_cast<unsigned>((tiles + tiles_per_cta - 1) / tiles_per_cta), static_cast<unsigned>(pairs));
  auto launch = [&](auto kernel) {
    launch_kernel("mxfp4_mma_gate_up_kernel", false, kernel, grid, dim3(kThreads), 0, stream, call);
  };
  auto launch_split = [&](auto type, auto gated_constant) {
    using T = decltype(type);
    constexpr bool kGated = decltype(gated_constant)::value;
    if (split == 1) {
      launch(mxfp4_mma_gate_up_kernel<T, kGated, 1>);
    } else if (split == 2) {
      launch(mxfp4_mma_gate_up_kernel<T, kGated, 2>);
    } else {
      launch(mxfp4_mma_gate_up_kernel<T, kGated, kWarps>);
    }
  };
  if (call.dtype == DType::bf16) {
    gated ? launch_split(__nv_bfloat16{}, std::true_type{}) : launch_split(__nv_bfloat16{}, std::false_type{});
  } else {
    gated ? launch_split(__half{}, std::true_type{}) : launch_split(__half{}, std::false_type{});
  }
}

void mxfp4_mma_down(const Mxfp4DownCall& call, cudaStream_t stream) {
  LATENTMOE_CHECK(mxfp4_mma_supported(call.dtype, call.tokens, call.top_k, call.act, call.down.cols),
                  "MXFP4 tensor-core down: unsupported call");
  const int64_t tiles = (call.down.rows + kTileRows - 1) / kTileRows;
  LATENTMOE_CHECK((call.down.cols / kGroup + kChunk - 1) / kChunk <= INT_MAX / kMaxPairs,
                  "MXFP4 down: ", call.down.cols, " columns exceed the kernel's 32-bit work count");
  const size_t shared = static_cast<size_t>(call.num_experts) * sizeof(int);
  // Tag: one occupancy cache per kernel instance (ctas_per_sm).
  auto launch = [&](auto tag, auto kernel) {
    open_shared(kernel, shared);
    // Clusters of up to 8 CTAs share a tile (sm_90 and later): the most that still run in one wave, so that no
    // last partial wave runs alone. Before (session 17) the clusters gave at least two CTAs per SM: Kimi-K3's 224
    // tiles in pairs, 448 CTAs at 3 per SM, 1.13 waves on an H100 (ncu: 18 µs at one token for an 11 MB read).
    // Measured on an H100 with the programmatic launch (bench layer alternating, graph, Kimi-K3 tp-shard 8, 224
    // CTAs now): the layer 1-6% faster from 1 to 8 tokens; tp-shard 1 level at 1, 3% faster at 4, 3% slower at 8
    // tokens (one run). At 4 CTAs per SM (64 registers, spilling; 448 CTAs in one wave) it was no faster.
    int split = 1;
    if (current_compute_capability() >= 90) {
      const int per_sm = ctas_per_sm<decltype(tag)>(kernel, shared);
      const int64_t resident = static_cast<int64_t>(std::max(per_sm, 1)) * current_sm_count();
      while (split < 8 && tiles * split * 2 <= resident) split *= 2;
    }
    LATENTMOE_CHECK(tiles * split <= INT_MAX, "MXFP4 down: ", call.down.rows, " rows exceed the grid");
    launch_kernel_clustered("mxfp4_mma_down_kernel", pdl_supported(), static_cast<unsigned>(split), kernel,
                            dim3(static_cast<unsigned>(tiles * split)), dim3(kThreads), shared, stream, call, split);
  };
  check_expert_offsets(call.down, "down");
  auto launch_depth = [&](auto type) {
    using T = decltype(type);
    if (call.tokens <= kDownDeepTokens) {
      launch(DownInstance<T, kDownInFlightDeep>{}, mxfp4_mma_down_kernel<T, kDownInFlightDeep>);
    } else {
      launch(DownInstance<T, kDownInFlight>{}, mxfp4_mma_down_kernel<T, kDownInFlight>);
    }
  };
  if (call.dtype == DType::bf16) {
    launch_depth(__nv_bfloat16{});
  } else {
    launch_depth(__half{});
  }
}

}  // namespace latentmoe::cuda

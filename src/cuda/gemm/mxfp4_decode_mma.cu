// MXFP4 routed experts at decode on the tensor cores (bf16 and f16 activations; mxfp4_decode_mma.h).
//
// Operands straight from the checkpoint's layout into mma.m16n8k16 fragments; no repack, no
// dequantised copy. A warp computes a 16-row tile of one expert matrix against up to 8 tokens (the
// MMA's N): lane (g = lane / 4, t = lane % 4) loads, for scale group q, the 4 code bytes 4t..4t+3 of
// rows g and g + 8 (8 E2M1 values each, physical columns 32q + 8t .. 32q + 8t + 7) and the 8 activation
// values of token g at the same columns (16 bytes). The MMA's k order is a permutation of the physical
// one, the same for A and B: the nibble pairs (0, 4), (1, 5) feed the first MMA's k slots {2t, 2t+1}
// and {2t+8, 2t+9}, (2, 6), (3, 7) the second's, so a pair of nibbles 16 bits apart becomes one
// 2-element register with two shifts and two masks (e2m1_pair).
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
//   contiguous range of the (touched expert, chunk of groups) work items; each item's products are
//   weighted by the routing weight of each token (summed over the pairs by which a token names the
//   expert), and the cluster's partial sums are added in a fixed order through distributed shared
//   memory.
// Copies: each warp streams its weights (codes and the aligned words holding their scale bytes) through its own
//   cp.async ring of kRingStages chunks in shared memory, kRingStages - 1 chunks ahead of its MMAs (no barrier
//   but __syncwarp: nobody reads another warp's stages); the activations come through registers one chunk ahead.
//   Before the rings (session 17) each warp held one chunk in registers, ~1 KB in flight, and the kernels reached
//   46% (gate/up) and 20-42% (down) of DRAM bandwidth (ncu, H100, Kimi-K3 tp-shard 8 at 1 and 8 tokens).
// The down kernel is a programmatic dependent of gate/up (pdl.cuh): gate/up triggers at once, so down's CTAs start
// in gate/up's last wave, build their expert list and ask for their first weights there, and wait for gate/up only
// before they read its act rows. So mxfp4_mma_down must follow the gate/up kernel of the same call on its stream
// with nothing in between that writes the routing (mxfp4_decode.h).
//
// Speed: docs/MXFP4.md.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>
#include <type_traits>

#include "cuda/common/activation.cuh"
#include "cuda/common/cluster.cuh"
#include "cuda/common/convert.cuh"
#include "cuda/common/cuda_check.h"
#include "cuda/common/device.h"
#include "cuda/common/matrix.h"
#include "cuda/common/mma.cuh"
#include "cuda/common/pdl.cuh"
#include "cuda/gemm/grouped_gemm_mma.cuh"  // cp.async copies
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
// The down kernel: 4 CTAs per SM (at most 64 registers). With 3 (76 registers), Kimi-K3's 224 output tiles in
// clusters of 2 made 448 CTAs, 1.13 waves on an H100: the last 52 CTAs ran alone, and down took 18 µs at one
// token for an 11 MB read (ncu, session 17; mxfp4_mma_down sizes the clusters to one wave).
constexpr int kMinCtasPerSmDown = 4;

// One lane's share of one scale group: the code words of rows g and g + 8, their scale bytes, and the
// 8 activation values of token g (zero for a token beyond the call's or one that does not take part).
struct GroupOperands {
  uint32_t code_lo = 0, code_hi = 0;  // rows g, g + 8
  uint32_t scale_lo = 0, scale_hi = 0;
  uint4 x = {0, 0, 0, 0};
};

// The group's two MMAs on unscaled values, then the scale of each row, into acc (c0, c1: row g;
// c2, c3: row g + 8; columns 2t, 2t + 1). factor_even / factor_odd multiply columns 2t / 2t + 1.
template <class T>
__device__ __forceinline__ void group_mma(float (&acc)[4], const GroupOperands& op, float factor_even,
                                          float factor_odd) {
  const uint32_t b00 = __byte_perm(op.x.x, op.x.z, 0x5410), b01 = __byte_perm(op.x.x, op.x.z, 0x7632);
  const uint32_t b10 = __byte_perm(op.x.y, op.x.w, 0x5410), b11 = __byte_perm(op.x.y, op.x.w, 0x7632);
  float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  mma_16x8x16<T>(d, e2m1_pair<T, 0>(op.code_lo), e2m1_pair<T, 0>(op.code_hi), e2m1_pair<T, 1>(op.code_lo),
                 e2m1_pair<T, 1>(op.code_hi), b00, b01);
  mma_16x8x16<T>(d, e2m1_pair<T, 2>(op.code_lo), e2m1_pair<T, 2>(op.code_hi), e2m1_pair<T, 3>(op.code_lo),
                 e2m1_pair<T, 3>(op.code_hi), b10, b11);
  const float scale_lo = e8m0_scale(op.scale_lo), scale_hi = e8m0_scale(op.scale_hi);
  acc[0] = fmaf(d[0], scale_lo * factor_even, acc[0]);
  acc[1] = fmaf(d[1], scale_lo * factor_odd, acc[1]);
  acc[2] = fmaf(d[2], scale_hi * factor_even, acc[2]);
  acc[3] = fmaf(d[3], scale_hi * factor_odd, acc[3]);
}

// ---- gate/up -------------------------------------------------------------------------------------

// The gate/up kernel's ring: each warp streams its tile's codes and scale words through kRingStages chunks of
// shared memory (cp.async), so that it keeps ~4 KB of weights requested instead of the ~1 KB one chunk held in
// registers (ncu on an H100 at one token, Kimi-K3 tp-shard 8: 46% of DRAM bandwidth, 0.85 eligible warps per
// scheduler; registers capped the kernel at 3 CTAs per SM, so a register double buffer only halved the CTAs).
constexpr int kRingStages = 4;
// A row's kChunk * 16 code bytes of a chunk, padded by 16: the LDS.32 of rows g = 0..7 (stride 48 bytes) fall in
// distinct banks.
constexpr int kRingRowStride = kChunk * 16 + 16;
template <bool kGated>
struct GateUpStage {
  static constexpr int kMats = kGated ? 2 : 1;  // [0] up, [1] gate
  uint8_t codes[kMats][kTileRows * kRingRowStride];
  uint32_t scale_words[kMats][kTileRows][kChunk];  // the aligned word holding each (row, group)'s scale byte
};
template <bool kGated>
constexpr size_t gate_up_ring_bytes() {
  return static_cast<size_t>(kWarps) * kRingStages * sizeof(GateUpStage<kGated>);
}

// kSplit: the warps that split one tile's K (8: the whole CTA on one tile, the groups of K spread over its
// warps; 1: each warp one tile over all of K). A CTA covers kWarps / kSplit consecutive tiles. Fewer warps per
// tile amortise each warp's pointer set-up and the CTA's routing prologue over more groups, where the call has
// enough (tile, pair) units to fill the GPU without splitting K (choose_gate_up_split).
// Warp `part` of a tile takes the chunks part, part + kSplit, ... (chunk c: groups kChunk c ..; the kSplit warps
// of a tile read consecutive sectors of each row together); each chunk's codes and scale words come through the
// warp's ring (kRingStages - 1 chunks ahead; lane l copies row l / 2's 16 code bytes and scale word of group
// kChunk c + l % 2 for each matrix), its activations through registers one chunk ahead. Groups past K (a last,
// partial chunk) are zero-filled codes, scale bytes and activations.
template <class T, bool kGated, int kSplit>
__global__ void __launch_bounds__(kThreads, kGated ? kMinCtasPerSm : kMinCtasPerSmUngated)
    mxfp4_mma_gate_up_kernel(Mxfp4GateUpCall p) {
  static_assert(kSplit >= 1 && kWarps % kSplit == 0);
  constexpr int kTilesPerCta = kWarps / kSplit;
  using Stage = GateUpStage<kGated>;
  constexpr int kMats = Stage::kMats;
  extern __shared__ __align__(16) uint8_t ring_bytes[];  // [kWarps][kRingStages] stages
  __shared__ int act_row[kMaxTokens];                    // per token: the pair whose act row it writes, or -1
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
  const int tile_row0 = (first_tile + warp / kSplit) * kTileRows;
  const int rows = static_cast<int>(p.up.rows), groups = static_cast<int>(p.up.cols / kGroup);  // 32-bit: host checks
  const int row_bytes = groups * (kGroup / 2);
  const int chunks = (groups + kChunk - 1) / kChunk;
  const int my_chunks = part < chunks ? (chunks - part + kSplit - 1) / kSplit : 0;
  Stage* ring = reinterpret_cast<Stage*>(ring_bytes) + warp * kRingStages;

  // This lane's copies: row copy_row of the tile (clamped to the matrix: a tile past it stores nothing), group
  // kChunk c + half of chunk c.
  const int copy_row = lane / 2, half = lane % 2;
  const uint8_t* code_src[kMats];
  const uint8_t* scale_src[kMats];
  const int64_t expert_row = static_cast<int64_t>(expert) * rows + min(tile_row0 + copy_row, rows - 1);
#pragma unroll
  for (int m = 0; m < kMats; ++m) {
    const Mxfp4Matrices& mat = m == 0 ? p.up : p.gate;
    code_src[m] = mat.packed + expert_row * row_bytes + half * 16;
    scale_src[m] = mat.scales + expert_row * groups + half;
  }
  auto issue = [&](int chunk, Stage& stage) {
    const int q = chunk * kChunk;  // the chunk's first group; this lane's is q + half
    const bool valid = q + half < groups;
#pragma unroll
    for (int m = 0; m < kMats; ++m) {
      gg::cp_async_16(gg::smem_u32(&stage.codes[m][copy_row * kRingRowStride + half * 16]),
                      code_src[m] + (valid ? q * 16 : 0), valid);
      const uintptr_t scale = reinterpret_cast<uintptr_t>(scale_src[m] + (valid ? q : 0));
      gg::cp_async_4(gg::smem_u32(&stage.scale_words[m][copy_row][half]),
                     reinterpret_cast<const void*>(scale & ~uintptr_t{3}), valid);
    }
    gg::cp_async_commit();
  };

  // The scale byte of (row, group q) sits at byte (address & 3) of its word; the rows' addresses mod 4 are fixed.
  int scale_shift_base[2][kMats];
#pragma unroll
  for (int m = 0; m < kMats; ++m) {
    const Mxfp4Matrices& mat = m == 0 ? p.up : p.gate;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = static_cast<int64_t>(expert) * rows + min(tile_row0 + g + 8 * h, rows - 1);
      scale_shift_base[h][m] = static_cast<int>(reinterpret_cast<uintptr_t>(mat.scales + row * groups) & 3);
    }
  }
  // Only the tokens that name the expert read their activations (the others' MMA columns are zeros and
  // never stored): reading every token's row measured 6-7% slower on Nemotron's relu2 experts, whose
  // activation rows are as many bytes as the tile's codes.
  const bool token_active = g < p.tokens && act_row[g] != INT_MAX;
  const T* z_row = static_cast<const T*>(p.z) + (token_active ? g * p.ld_z : 0) + 8 * t;
  auto load_x = [&](int chunk, uint4(&x)[kChunk]) {
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      const int q = chunk * kChunk + j;
      x[j] = token_active && q < groups ? *reinterpret_cast<const uint4*>(z_row + q * kGroup) : uint4{0, 0, 0, 0};
    }
  };

  float up[4] = {0.0f, 0.0f, 0.0f, 0.0f}, gate[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int s = 0; s < kRingStages - 1; ++s) {
    if (s < my_chunks) {
      issue(part + s * kSplit, ring[s]);
    } else {
      gg::cp_async_commit();  // an empty group: the wait below counts groups
    }
  }
  uint4 x_next[kChunk];
  if (my_chunks > 0) load_x(part, x_next);
  for (int i = 0; i < my_chunks; ++i) {
    const int chunk = part + i * kSplit;
    // Stage (i + kRingStages - 1) % kRingStages was read in iteration i - 1 (the __syncwarp at its end).
    if (i + kRingStages - 1 < my_chunks) {
      issue(chunk + (kRingStages - 1) * kSplit, ring[(i + kRingStages - 1) % kRingStages]);
    } else {
      gg::cp_async_commit();
    }
    uint4 x[kChunk];
#pragma unroll
    for (int j = 0; j < kChunk; ++j) x[j] = x_next[j];
    if (i + 1 < my_chunks) load_x(chunk + kSplit, x_next);
    gg::cp_async_wait<kRingStages - 1>();  // this lane's copies of chunk i have landed
    __syncwarp();                          // and every lane's
    const Stage& stage = ring[i % kRingStages];
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      const int q = chunk * kChunk + j;
      GroupOperands op;
      op.x = x[j];
#pragma unroll
      for (int m = 0; m < kMats; ++m) {
        op.code_lo = *reinterpret_cast<const uint32_t*>(&stage.codes[m][g * kRingRowStride + j * 16 + 4 * t]);
        op.code_hi = *reinterpret_cast<const uint32_t*>(&stage.codes[m][(g + 8) * kRingRowStride + j * 16 + 4 * t]);
        op.scale_lo = (stage.scale_words[m][g][j] >> (8 * ((scale_shift_base[0][m] + q) & 3))) & 0xffu;
        op.scale_hi = (stage.scale_words[m][g + 8][j] >> (8 * ((scale_shift_base[1][m] + q) & 3))) & 0xffu;
        group_mma<T>(m == 0 ? up : gate, op, 1.0f, 1.0f);
      }
    }
    __syncwarp();  // every lane has read the stage before iteration i + 1 refills it
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
  int pair_id[kMaxPairs];        // the call's ids and weights, one load a thread: each token's pairs are then read
  float pair_weight[kMaxPairs];  // from shared memory (a loop of top_k global loads took ~6 µs a CTA at one token)
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

// The down kernel's ring: as gate/up's (kRingStages chunks of one expert's 16 tile rows a warp), one matrix.
struct DownStage {
  uint8_t codes[kTileRows * kRingRowStride];
  uint32_t scale_words[kTileRows][kChunk];
};
constexpr size_t kDownRingBytes = static_cast<size_t>(kWarps) * kRingStages * sizeof(DownStage);

// Work items (touched expert, chunk of kChunk consecutive groups) in expert-major order; each warp of the cluster
// takes one contiguous range of them (so it walks an expert's chunks in order). Each item's codes and scale words
// come through the warp's ring, kRingStages - 1 items ahead (lane l copies row l / 2's 16 code bytes and scale word
// of group kChunk c + l % 2); the first kRingStages - 1 are asked for before the wait for gate/up (weights only).
// The act rows come through registers one item ahead.
template <class T>
__global__ void __launch_bounds__(kThreads, kMinCtasPerSmDown) mxfp4_mma_down_kernel(Mxfp4DownCall p, int split) {
  extern __shared__ __align__(16) uint8_t dynamic_bytes[];  // the ring, then first_pair [num_experts]
  DownStage* const rings = reinterpret_cast<DownStage*>(dynamic_bytes);
  int* const first_pair = reinterpret_cast<int*>(dynamic_bytes + kDownRingBytes);
  __shared__ ExpertList list;
  __shared__ int slot_of_pair[kMaxPairs];
  __shared__ float partial[kWarps][4][32];
  build_expert_list(p, list, first_pair, slot_of_pair);

  const int rank = static_cast<int>(blockIdx.x) % split;
  const int tile = static_cast<int>(blockIdx.x) / split;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int tile_row0 = tile * kTileRows;
  const int rows = static_cast<int>(p.down.rows), groups = static_cast<int>(p.down.cols / kGroup);  // host checks
  const int row_bytes = groups * (kGroup / 2);
  const int chunks = (groups + kChunk - 1) / kChunk;
  const int items = list.count * chunks;  // 32-bit: count <= 256 pairs, chunks <= INT_MAX / 256 (host check)
  const int warps_total = split * kWarps;
  const int per_warp = (items + warps_total - 1) / warps_total;
  const int begin = min(items, (rank * kWarps + warp) * per_warp), end = min(items, begin + per_warp);
  const int count = end - begin;
  DownStage* const ring = rings + warp * kRingStages;

  // The copies' cursor, kRingStages - 1 items ahead of the MMAs; the lane's source rows, set per expert.
  const int copy_row = lane / 2, half = lane % 2;
  const int first_slot = chunks > 0 ? begin / chunks : 0, first_chunk = begin - first_slot * chunks;
  int copy_slot = first_slot, copy_chunk = first_chunk, source_slot = -1;
  const uint8_t* code_src = nullptr;
  const uint8_t* scale_src = nullptr;
  auto issue = [&](DownStage& stage) {
    if (copy_slot != source_slot) {
      source_slot = copy_slot;
      const int64_t row = static_cast<int64_t>(list.expert[copy_slot]) * rows + min(tile_row0 + copy_row, rows - 1);
      code_src = p.down.packed + row * row_bytes + half * 16;
      scale_src = p.down.scales + row * groups + half;
    }
    const int q = copy_chunk * kChunk;
    const bool valid = q + half < groups;
    gg::cp_async_16(gg::smem_u32(&stage.codes[copy_row * kRingRowStride + half * 16]), code_src + (valid ? q * 16 : 0),
                    valid);
    const uintptr_t scale = reinterpret_cast<uintptr_t>(scale_src + (valid ? q : 0));
    gg::cp_async_4(gg::smem_u32(&stage.scale_words[copy_row][half]),
                   reinterpret_cast<const void*>(scale & ~uintptr_t{3}), valid);
    gg::cp_async_commit();
    if (++copy_chunk == chunks) {
      copy_chunk = 0;
      ++copy_slot;
    }
  };
#pragma unroll
  for (int s = 0; s < kRingStages - 1; ++s) {
    if (s < count) {
      issue(ring[s]);
    } else {
      gg::cp_async_commit();  // an empty group: the waits count groups
    }
  }
  // Launched as a programmatic dependent of the gate/up kernel (mxfp4_mma_down): everything above read only the
  // routing (written before gate/up started) and the weights; the act rows below are gate/up's.
  pdl_wait();
  pdl_trigger();

  // The activations' cursor, one item ahead of the MMAs. Zeros for a token that does not name the expert (its
  // weight is 0 there, and 0 * inf would be NaN) and past K.
  int x_slot = first_slot, x_chunk = first_chunk;
  auto load_x = [&](uint4(&x)[kChunk]) {
    const int act_row = g < p.tokens ? list.act_row[x_slot][g] : -1;
    const T* act = static_cast<const T*>(p.act) + static_cast<int64_t>(act_row < 0 ? 0 : act_row) * p.down.cols +
                   static_cast<int64_t>(x_chunk) * kChunk * kGroup + 8 * t;
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      x[j] = act_row >= 0 && x_chunk * kChunk + j < groups ? *reinterpret_cast<const uint4*>(act + j * kGroup)
                                                           : uint4{0, 0, 0, 0};
    }
    if (++x_chunk == chunks) {
      x_chunk = 0;
      ++x_slot;
    }
  };
  uint4 x_next[kChunk];
  if (count > 0) load_x(x_next);

  // The MMAs' cursor. The scale byte of (row, group q) sits at byte (address & 3) of its word (32-bit arithmetic
  // keeps the address mod 4).
  int slot = first_slot, chunk = first_chunk;
  const uint32_t scales_base = static_cast<uint32_t>(reinterpret_cast<uintptr_t>(p.down.scales));
  const uint32_t row_lo = static_cast<uint32_t>(min(tile_row0 + g, rows - 1)),
                 row_hi = static_cast<uint32_t>(min(tile_row0 + g + 8, rows - 1));
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int i = 0; i < count; ++i) {
    // Stage (i + kRingStages - 1) % kRingStages was read in iteration i - 1 (the __syncwarp at its end).
    if (i + kRingStages - 1 < count) {
      issue(ring[(i + kRingStages - 1) % kRingStages]);
    } else {
      gg::cp_async_commit();
    }
    uint4 x[kChunk];
#pragma unroll
    for (int j = 0; j < kChunk; ++j) x[j] = x_next[j];
    if (i + 1 < count) load_x(x_next);
    const uint32_t expert_row = static_cast<uint32_t>(list.expert[slot]) * static_cast<uint32_t>(rows);
    const uint32_t shift_lo = scales_base + (expert_row + row_lo) * static_cast<uint32_t>(groups),
                   shift_hi = scales_base + (expert_row + row_hi) * static_cast<uint32_t>(groups);
    const float weight_even = list.weight[slot][2 * t], weight_odd = list.weight[slot][2 * t + 1];
    gg::cp_async_wait<kRingStages - 1>();  // this lane's copies of item i have landed
    __syncwarp();                          // and every lane's
    const DownStage& stage = ring[i % kRingStages];
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      const uint32_t q = static_cast<uint32_t>(chunk * kChunk + j);
      GroupOperands op;
      op.x = x[j];
      op.code_lo = *reinterpret_cast<const uint32_t*>(&stage.codes[g * kRingRowStride + j * 16 + 4 * t]);
      op.code_hi = *reinterpret_cast<const uint32_t*>(&stage.codes[(g + 8) * kRingRowStride + j * 16 + 4 * t]);
      op.scale_lo = (stage.scale_words[g][j] >> (8 * ((shift_lo + q) & 3u))) & 0xffu;
      op.scale_hi = (stage.scale_words[g + 8][j] >> (8 * ((shift_hi + q) & 3u))) & 0xffu;
      group_mma<T>(acc, op, weight_even, weight_odd);
    }
    __syncwarp();  // every lane has read the stage before iteration i + 1 refills it
    if (++chunk == chunks) {
      chunk = 0;
      ++slot;
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
  auto launch_split = [&](auto type, auto gated_constant) {
    using T = decltype(type);
    constexpr bool kGated = decltype(gated_constant)::value;
    auto launch = [&](auto kernel) {
      constexpr size_t ring = gate_up_ring_bytes<kGated>();
      if (ring > 48 * 1024) {
        LATENTMOE_CUDA_CHECK(
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(ring)));
      }
      launch_kernel("mxfp4_mma_gate_up_kernel", false, kernel, grid, dim3(kThreads), ring, stream, call);
    };
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
  const size_t shared = kDownRingBytes + static_cast<size_t>(call.num_experts) * sizeof(int);
  auto launch = [&](auto kernel) {
    open_shared(kernel, shared);
    // Clusters of up to 8 CTAs share a tile (sm_90 and later): the most that still run in one wave, so that no
    // last partial wave runs alone (at 1.13 waves the down kernel took twice its one-wave time, session 17).
    int split = 1;
    if (current_compute_capability() >= 90) {
      int per_sm = 0;
      LATENTMOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, shared));
      const int64_t resident = static_cast<int64_t>(std::max(per_sm, 1)) * current_sm_count();
      while (split < 8 && tiles * split * 2 <= resident) split *= 2;
    }
    LATENTMOE_CHECK(tiles * split <= INT_MAX, "MXFP4 down: ", call.down.rows, " rows exceed the grid");
    launch_kernel_clustered("mxfp4_mma_down_kernel", pdl_supported(), static_cast<unsigned>(split), kernel,
                            dim3(static_cast<unsigned>(tiles * split)), dim3(kThreads), shared, stream, call, split);
  };
  check_expert_offsets(call.down, "down");
  if (call.dtype == DType::bf16) {
    launch(mxfp4_mma_down_kernel<__nv_bfloat16>);
  } else {
    launch(mxfp4_mma_down_kernel<__half>);
  }
}

}  // namespace latentmoe::cuda

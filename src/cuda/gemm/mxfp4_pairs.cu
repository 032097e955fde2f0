// MXFP4 routed experts at decode, one (token, expert) pair at a time, on the tensor cores (mxfp4_pairs.h).
//
// A unit is 16 rows of one expert matrix against one pair's activation row: mma.m16n8k16 with the weights as A
// and the activations as B. Every lane loads its own activation words whatever its g, so the 8 columns of B are the
// same row and column 0 (lane (g, 0)'s c0 and c2) is read back. Lane (g = lane / 4, t = lane % 4) takes, in step c of
// warp s of a unit's W warps, scale group q = 4 (c W + s) + t of A's rows g and g + 8: the 16 code bytes of each row
// (one 16-byte load; the four lanes of a row read 64 consecutive bytes), their two scale bytes, and the group's 32
// activation values (four 16-byte loads, through L1). The MMA's k order is a permutation of the columns that is the
// same for A and B: word w of the group (columns 32q + 8w ..) feeds two MMAs, its column pairs (0, 1) and (2, 3) the
// first's k slots {2t, 2t+1} and {2t+8, 2t+9}, (4, 5) and (6, 7) the second's.
//
// Numerics: every lane brings its own group, so one MMA sums four groups under four scales; the scales are
// therefore folded into A (mxfp4_decode8: E2M1 * 2^(s - 127) exactly in bf16, one multiply a pair for s <= 128, two
// above; scale bytes 253 and 254 with the largest codes overflow to infinity, as in the grouped tile kernels). The
// products with bf16 activations are exact and summed in fp32 by the MMAs; the warps that split a unit's K add their
// sums in warp order; the activation (gate/up) is applied to the fp32 sums and rounded once. bf16 only: f16 cannot
// hold the folded products of small scales exactly (the tile decode kernels, which scale in fp32 after the MMA,
// take f16). Results are deterministic run to run and agree with the CPU reference within rounding.
//
// gate/up: one CTA of kGateUpWarps warps per (8 rows i0..i0+7, pair): A's row g is gate row i0 + g and row g + 8 up
//   row i0 + g, so one lane ends with both sums of a row (relu2, no gate: 16 up rows i0..i0+15). Never launched as
//   a dependent; it triggers at once so that down's CTAs start in its last wave.
// down: one cluster of C CTAs per 16 output rows (down_shape); CTA r takes pairs [rQ, rQ + Q), a warp a pair at a
//   time over all of K, and keeps each pair's sums times its routing weight in shared memory; rank 0 adds each
//   token's pairs in j order across the cluster (distributed shared memory) and rounds once. A programmatic
//   dependent of gate/up: a warp's first codes are loaded before pdl_wait(), the act rows after.
//
// Loads: a warp issues kGateUpBatch (4) or kDownBatch (3) steps' codes and scales before it decodes any
// (gg::stream_load: no L1 allocation, evict-first in L2, 256-byte L2 fetches; the weights are read once), so up to 4 KB
// (3 KB) a warp are in flight.
#include <cuda_bf16.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "cuda/common/activation.cuh"
#include "cuda/common/cluster.cuh"
#include "cuda/common/device.h"
#include "cuda/common/matrix.h"
#include "cuda/common/mma.cuh"
#include "cuda/common/pdl.cuh"
#include "cuda/gemm/grouped_gemm_mma.cuh"  // stream_load, evict_first_policy
#include "cuda/gemm/mxfp4_device.cuh"
#include "cuda/gemm/mxfp4_pairs.h"
#include "latentmoe/error.h"

namespace latentmoe::cuda {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kGroup = kMxfp4Group;      // columns per scale byte
constexpr int kGroupBytes = kGroup / 2;  // code bytes per group: one 16-byte load
constexpr int kRowLanes = 4;             // the lanes t of an MMA row: a warp step covers 4 groups of each row
constexpr int kTileRows = 16;            // A's rows
constexpr int kGateUpBatch = 4;          // steps whose loads a gate/up warp issues before it decodes
constexpr int kDownBatch = 3;            // the same for down (within kDownMinCtasPerSm's registers)
constexpr int kGateUpWarps = 4;          // warps splitting one gate/up unit's K
// At most 80 registers a thread, 6 CTAs an SM: Kimi-K3 tp 8's one-token gate/up is 768 CTAs (48 units x 16 pairs), one
// wave of 132 x 6 (ptxas took 91-96 unbounded, which leaves 5 an SM).
constexpr int kGateUpMinCtasPerSm = 6;
constexpr int kDownMaxWarps = 8;
// At most 80 registers a thread (3 CTAs of 8 warps, 6 of 4, an SM; ptxas: 77, no spill; unbounded it took 97, and
// at 64 or 72 it spilled). Kimi-K3 tp 8's one-token down is 3584 warps (224 tiles x 16 pairs) in 896 CTAs of 4 warps:
// 1.13 waves at 6 CTAs an SM, each warp's 3 KB all in flight at once.
constexpr int kDownMinCtasPerSm = 3;
constexpr int kMaxCluster = 8;
constexpr int kMaxPairsPerCta = kMxfp4PairsMaxPairs / kMaxCluster;

// One lane's share of one step: the 16 code bytes of group q of A's rows g and g + 8, and their scale bytes.
struct Step {
  uint4 lo, hi;
  uint32_t scale_lo, scale_hi;
};

// A lane's two rows of A: their codes and scales at group 0.
struct LaneRows {
  const uint8_t* code_lo;
  const uint8_t* code_hi;
  const uint8_t* scale_lo;
  const uint8_t* scale_hi;
};

__device__ __forceinline__ LaneRows lane_rows(const Mxfp4Matrices& lo_matrix, int64_t lo_row,
                                              const Mxfp4Matrices& hi_matrix, int64_t hi_row) {
  const int64_t row_bytes = lo_matrix.cols / 2, groups = lo_matrix.cols / kGroup;
  return LaneRows{lo_matrix.packed + lo_row * row_bytes, hi_matrix.packed + hi_row * row_bytes,
                  lo_matrix.scales + lo_row * groups, hi_matrix.scales + hi_row * groups};
}

// Group q of the lane's rows; a group past the row (q >= groups: the last step of a K that is not a multiple of
// 4 W groups) is read at group 0, and step_mma gives it zero codes. Nothing here reads the loaded registers: a
// select on them would wait for the load before the warp could issue the next one (the SASS of a first version
// did so), and the loads of a batch must all be in flight together.
__device__ __forceinline__ Step load_step(const LaneRows& r, int q, int groups, uint64_t policy) {
  const int at = q < groups ? q : 0;
  Step s;
  s.lo = gg::stream_load(reinterpret_cast<const uint4*>(r.code_lo + at * kGroupBytes), policy);
  s.hi = gg::stream_load(reinterpret_cast<const uint4*>(r.code_hi + at * kGroupBytes), policy);
  s.scale_lo = __ldg(r.scale_lo + at);
  s.scale_hi = __ldg(r.scale_hi + at);
  return s;
}

__device__ __forceinline__ uint32_t word_of(const uint4& v, int w) {
  return w == 0 ? v.x : w == 1 ? v.y : w == 2 ? v.z : v.w;  // w is a constant after unrolling
}

// The step's 8 MMAs into acc: `x` the activation row (bf16) at column 0. A group past the row (valid false) takes
// zero codes and zero activations (its values are never read: they may lie past the row's end, and 0 * inf would be
// NaN). The four activation loads are issued before the first MMA, so the step waits for L1 once.
__device__ __forceinline__ void step_mma(float (&acc)[4], const Step& s, const bf16* x, int q, bool valid) {
  const uint4* group = reinterpret_cast<const uint4*>(x + static_cast<int64_t>(valid ? q : 0) * kGroup);
  uint4 b[4];
#pragma unroll
  for (int w = 0; w < 4; ++w) b[w] = valid ? __ldg(group + w) : make_uint4(0u, 0u, 0u, 0u);
  const uint32_t keep = valid ? 0xFFFFFFFFu : 0u;
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const uint4 a_lo = mxfp4_decode8<bf16>(word_of(s.lo, w) & keep, s.scale_lo);
    const uint4 a_hi = mxfp4_decode8<bf16>(word_of(s.hi, w) & keep, s.scale_hi);
    mma_16x8x16<bf16>(acc, a_lo.x, a_hi.x, a_lo.y, a_hi.y, b[w].x, b[w].y);
    mma_16x8x16<bf16>(acc, a_lo.z, a_hi.z, a_lo.w, a_hi.w, b[w].z, b[w].w);
  }
}

// One warp's steps of a unit into acc: groups first, first + stride, ... (first = 4 s for warp s of W, stride
// 4 W; each lane adds its t), kBatch steps loaded, then multiplied. `before_compute` runs after each batch's
// loads (down: pdl_wait, so that the first codes stream while gate/up finishes).
template <int kBatch, class BeforeCompute>
__device__ __forceinline__ void unit_mma(float (&acc)[4], const LaneRows& rows, const bf16* x, int groups, int first,
                                         int stride, int t, uint64_t policy, BeforeCompute before_compute) {
  for (int base = first; base < groups; base += kBatch * stride) {
    Step steps[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      if (base + j * stride < groups)
        steps[j] = load_step(rows, base + j * stride + t, groups, policy);  // warp-uniform
    }
    before_compute();
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int q = base + j * stride + t;
      if (base + j * stride < groups) step_mma(acc, steps[j], x, q, q < groups);
    }
  }
}

// ---- gate/up -------------------------------------------------------------------------------------

template <bool kGated>
__global__ void __launch_bounds__(kGateUpWarps * 32, kGateUpMinCtasPerSm)
    mxfp4_pairs_gate_up_kernel(Mxfp4GateUpCall p) {
  constexpr int kUnitRows = kGated ? kTileRows / 2 : kTileRows;  // intermediate rows per CTA
  __shared__ float partial[kGateUpWarps][kTileRows];
  pdl_trigger();  // never a dependent (pdl.cuh, 3.)
  const int pair = static_cast<int>(blockIdx.y);
  const int expert = p.ids[pair];
  if (expert < 0 || expert >= p.num_experts) return;  // a zero expert or a pad: no act row
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32, g = lane / 4,
            t = lane % 4;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kUnitRows;
  const int64_t first_row = static_cast<int64_t>(expert) * p.up.rows + row0;
  const LaneRows rows = kGated ? lane_rows(p.gate, first_row + g, p.up, first_row + g)
                               : lane_rows(p.up, first_row + g, p.up, first_row + 8 + g);
  const bf16* x = static_cast<const bf16*>(p.z) + static_cast<int64_t>(pair / p.top_k) * p.ld_z;
  const int groups = static_cast<int>(p.up.cols / kGroup);
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  unit_mma<kGateUpBatch>(acc, rows, x, groups, kRowLanes * warp, kRowLanes * kGateUpWarps, t, gg::evict_first_policy(),
                         [] {});
  if (t == 0) {
    partial[warp][g] = acc[0];
    partial[warp][g + 8] = acc[2];
  }
  __syncthreads();
  if (threadIdx.x < kUnitRows) {
    const int i = static_cast<int>(threadIdx.x);
    float lo = 0.0f, hi = 0.0f;
#pragma unroll
    for (int w = 0; w < kGateUpWarps; ++w) {
      lo += partial[w][i];
      if constexpr (kGated) hi += partial[w][i + 8];
    }
    const float value = kGated ? act::gated(lo, hi, p.activation.activation == Activation::situ, p.activation.situ_beta,
                                            p.activation.situ_linear_beta)
                               : act::relu2(lo);
    static_cast<bf16*>(p.act)[static_cast<int64_t>(pair) * p.up.rows + row0 + i] = __float2bfloat16_rn(value);
  }
}

// ---- down ----------------------------------------------------------------------------------------

__global__ void __launch_bounds__(kDownMaxWarps * 32, kDownMinCtasPerSm)
    mxfp4_pairs_down_kernel(Mxfp4DownCall p, int cluster, int pairs_per_cta) {
  __shared__ float partial[kMaxPairsPerCta][kTileRows];  // this CTA's pairs: weight x sum, per row of the tile
  const int rank = static_cast<int>(blockIdx.x) % cluster;
  const int64_t tile_row = static_cast<int64_t>(blockIdx.x / cluster) * kTileRows;
  const int warps = static_cast<int>(blockDim.x) / 32, warp = static_cast<int>(threadIdx.x) / 32,
            lane = static_cast<int>(threadIdx.x) % 32, g = lane / 4, t = lane % 4;
  const int pairs = p.tokens * p.top_k;
  const int first_pair = rank * pairs_per_cta, end_pair = min(pairs, first_pair + pairs_per_cta);
  const int groups = static_cast<int>(p.down.cols / kGroup);
  const uint64_t policy = gg::evict_first_policy();
  // ids and weights were written before gate/up (pdl.cuh, 1.); only act is gate/up's.
  for (int pair = first_pair + warp; pair < end_pair; pair += warps) {  // warp-uniform
    const int expert = p.ids[pair];
    const bool real = expert >= 0 && expert < p.num_experts;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (real) {
      const int64_t first_row = static_cast<int64_t>(expert) * p.down.rows + tile_row;
      const LaneRows rows = lane_rows(p.down, first_row + g, p.down, first_row + 8 + g);
      const bf16* act = static_cast<const bf16*>(p.act) + static_cast<int64_t>(pair) * p.down.cols;
      unit_mma<kDownBatch>(acc, rows, act, groups, 0, kRowLanes, t, policy, [] { pdl_wait(); });
    }
    if (t == 0) {
      const float weight = real ? p.weights[pair] : 0.0f;
      partial[pair - first_pair][g] = real ? weight * acc[0] : 0.0f;
      partial[pair - first_pair][g + 8] = real ? weight * acc[2] : 0.0f;
    }
  }
  pdl_wait();  // every CTA, before it writes (pdl.cuh, 2.)
  pdl_trigger();
  cluster_barrier(cluster);
  if (rank == 0) {
    for (int o = static_cast<int>(threadIdx.x); o < p.tokens * kTileRows; o += static_cast<int>(blockDim.x)) {
      const int token = o / kTileRows, row = o % kTileRows;
      float total = 0.0f;
      for (int j = 0; j < p.top_k; ++j) {
        const int pair = token * p.top_k + j;
        const float* peer = cluster_shared(&partial[0][0], pair / pairs_per_cta, cluster);
        total += peer[(pair % pairs_per_cta) * kTileRows + row];
      }
      static_cast<bf16*>(p.out)[static_cast<int64_t>(token) * p.ld_out + tile_row + row] = __float2bfloat16_rn(total);
    }
  }
  cluster_barrier(cluster);  // the peers' shared memory stays alive until rank 0 has read it
}

bool aligned16(const void* pointer) { return reinterpret_cast<uintptr_t>(pointer) % 16 == 0; }

// A whole matrix the kernels read with 16-byte loads: codes and scales given, whole 16-row tiles and scale groups.
bool matrix_supported(const Mxfp4Matrices& m) {
  return m.packed != nullptr && m.scales != nullptr && aligned16(m.packed) && m.rows >= kTileRows &&
         m.rows % kTileRows == 0 && m.cols >= kGroup && m.cols % kGroup == 0;
}

bool pairs_supported(DType dtype, int tokens, int top_k) {
  return dtype == DType::bf16 && tokens >= 1 && tokens <= kMxfp4PairsMaxTokens && top_k >= 1 &&
         tokens * top_k <= kMxfp4PairsMaxPairs;
}

bool gate_up_supported(const Mxfp4GateUpCall& c) {
  const bool gated = c.activation.activation != Activation::relu2;
  return pairs_supported(c.dtype, c.tokens, c.top_k) && c.ids != nullptr && matrix_supported(c.up) &&
         gated == (c.gate.packed != nullptr) &&
         (!gated || (matrix_supported(c.gate) && c.gate.rows == c.up.rows && c.gate.cols == c.up.cols)) &&
         c.z != nullptr && rows_aligned(c.z, c.ld_z, 2, 16) && c.ld_z >= c.up.cols && c.act != nullptr &&
         aligned16(c.act);
}

bool down_supported(const Mxfp4DownCall& c) {
  return pairs_supported(c.dtype, c.tokens, c.top_k) && c.ids != nullptr && c.weights != nullptr &&
         matrix_supported(c.down) && c.act != nullptr && aligned16(c.act) && c.out != nullptr &&
         c.ld_out >= c.down.rows;
}

}  // namespace

Mxfp4PairsDownShape mxfp4_pairs_down_shape(int pairs) {
  LATENTMOE_CHECK(pairs >= 1 && pairs <= kMxfp4PairsMaxPairs, "MXFP4 pair kernels: ", pairs, " pairs; they take 1..",
                  kMxfp4PairsMaxPairs);
  Mxfp4PairsDownShape shape;
  shape.pairs_per_cta = (pairs + std::min(kMaxCluster, (pairs + 3) / 4) - 1) / std::min(kMaxCluster, (pairs + 3) / 4);
  shape.cluster = (pairs + shape.pairs_per_cta - 1) / shape.pairs_per_cta;  // no CTA without a pair
  shape.warps = std::min(shape.pairs_per_cta, kDownMaxWarps);
  return shape;
}

bool mxfp4_pairs_supported(const Mxfp4GateUpCall& gate_up, const Mxfp4DownCall& down) {
  return gate_up_supported(gate_up) && down_supported(down) && gate_up.tokens == down.tokens &&
         gate_up.top_k == down.top_k && gate_up.num_experts == down.num_experts && gate_up.up.rows == down.down.cols &&
         gate_up.up.cols == down.down.rows && current_compute_capability() >= 90;
}

void mxfp4_pairs_gate_up(const Mxfp4GateUpCall& call, cudaStream_t stream) {
  LATENTMOE_CHECK(gate_up_supported(call), "MXFP4 pair gate/up: unsupported call (", call.tokens, " tokens, top_k ",
                  call.top_k, ", ", call.up.rows, " x ", call.up.cols, ")");
  const bool gated = call.activation.activation != Activation::relu2;
  const int64_t units = call.up.rows / (gated ? kTileRows / 2 : kTileRows);
  LATENTMOE_CHECK(units <= INT_MAX, "MXFP4 pair gate/up: ", call.up.rows, " rows exceed the grid");
  const dim3 grid(static_cast<unsigned>(units), static_cast<unsigned>(call.tokens * call.top_k));
  if (gated) {
    launch_kernel("mxfp4_pairs_gate_up_kernel", false, mxfp4_pairs_gate_up_kernel<true>, grid, dim3(kGateUpWarps * 32),
                  0, stream, call);
  } else {
    launch_kernel("mxfp4_pairs_gate_up_kernel", false, mxfp4_pairs_gate_up_kernel<false>, grid, dim3(kGateUpWarps * 32),
                  0, stream, call);
  }
}

void mxfp4_pairs_down(const Mxfp4DownCall& call, cudaStream_t stream) {
  LATENTMOE_CHECK(down_supported(call) && current_compute_capability() >= 90, "MXFP4 pair down: unsupported call (",
                  call.tokens, " tokens, top_k ", call.top_k, ", ", call.down.rows, " x ", call.down.cols, ")");
  const Mxfp4PairsDownShape shape = mxfp4_pairs_down_shape(call.tokens * call.top_k);
  const int64_t ctas = call.down.rows / kTileRows * shape.cluster;
  LATENTMOE_CHECK(ctas <= INT_MAX, "MXFP4 pair down: ", call.down.rows, " rows exceed the grid");
  launch_kernel_clustered("mxfp4_pairs_down_kernel", pdl_supported(), static_cast<unsigned>(shape.cluster),
                          mxfp4_pairs_down_kernel, dim3(static_cast<unsigned>(ctas)), dim3(shape.warps * 32), 0, stream,
                          call, shape.cluster, shape.pairs_per_cta);
}

}  // namespace latentmoe::cuda

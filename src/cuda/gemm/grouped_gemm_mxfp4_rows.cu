// The grouped GEMM variant `mxfp4_rows` (grouped_gemm.h): MXFP4 expert weights decoded straight into
// mma.sync A fragments, for experts that hold few rows each (the layer takes it from 17 tokens to a few
// hundred). Each expert's weights are read once per pass of up to kPassRows of its rows, however many
// tokens chose it (the decode kernels of mxfp4_decode_mma.cu take at most 8 tokens at once, and above
// that run in batches of 8, each reading the weights again).
//
// Why a ring: the decode kernels load their codes into registers, so the bytes in flight per SM are
// bounded by registers and occupancy (they reach 23-48% of the byte floor, docs/MXFP4.md). Here each
// CTA streams the codes, the scale words and its expert's activation rows through a cp.async ring of
// kStages steps in shared memory (one step = 4 scale groups = 128 columns of K), several steps ahead of
// the warps that decode and multiply.
//
// Work: CTA (x, e) owns expert e's weight blocks of 64 rows (4 warps) [x * blocks_per_cta, ...) and walks
// the steps (pass, block, k-step) in that order through one pipeline (Cursor: no division per step; the
// copies' source offsets are recomputed once per block and the pass's rows looked up in sorted_pairs once
// per pass: Loader); after a block's last k-step its warps store that pass's outputs and clear their
// accumulators.
// Split-K (few tokens and few output columns, where the touched experts' blocks would leave most SMs idle:
//   plan_rows): CTA (x * k_splits + split, e) takes k-steps [split * steps_per_split, ...) of every pass and
//   stores fp32 sums per grouped row in the workspace; the last of the k_splits CTAs to arrive (a counter per
//   (first grouped row of the expert, x): unique per touched expert, reset by that CTA) adds them in split
//   order and runs the epilogue, so the result does not depend on the order of arrival.
//   warp w: rows 16 w .. 16 w + 15 of the block; lane (g, t) holds rows g and g + 8 (the A fragment) and,
//   per n8 tile c of the pass, the expert's row 8 c + g (the B fragment, at the same k slots).
// k order: as mxfp4_decode_mma.cu: per scale group two MMAs; lane t takes code bytes 4t..4t+3 of the group
//   for its rows (nibbles 2i and 2i + 1 form one register, e2m1_pair) and the activation values at the same
//   eight columns, whose 32-bit words are the same column pairs (no permute). Scales: with bf16 and aligned scale
//   words, each row's scale is folded into its decoded values where every scale byte of the warp's step is <= 128
//   (exact; the MMAs then accumulate in place: run_step); otherwise each group's MMAs start from zero, and their fp32
//   result is multiplied by the row's scale (an exact power of two) and added to the accumulators.
// Pipeline invariants (one __syncthreads a step): the copies of step i are committed as one group by
//   every thread (empty groups included), so at the top of step i wait_group(kStages - 2) leaves step i
//   landed for this thread; the barrier after it makes step i visible to all and guarantees every warp
//   has finished step i - 1, whose slot step i + kStages - 1 then overwrites.
// Edges: groups past K in a partial last step are zero-filled (codes, scale words, activations); weight
//   rows past N read a clamped row and store nothing; pass rows past the expert's read zeros and store
//   nothing. Results are deterministic (fixed order of additions per output).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <type_traits>

#include "cuda/common/convert.cuh"
#include "cuda/common/device.h"
#include "cuda/common/mma.cuh"
#include "cuda/common/pdl.cuh"
#include "cuda/gemm/grouped_gemm_launch.cuh"
#include "cuda/gemm/grouped_gemm_mma.cuh"
#include "cuda/gemm/mxfp4_device.cuh"
#include "latentmoe/error.h"

namespace latentmoe::cuda::gg {
namespace {

constexpr int kStepGroups = 4;  // scale groups per pipeline step

// Pipeline steps over a reduction of k (a multiple of the scale group).
__host__ __device__ constexpr int k_steps_of(int k) { return (k / kMxfp4Group + kStepGroups - 1) / kStepGroups; }
// Ring depth 4 and 3 CTAs per SM. A 3-stage ring with 4 CTAs per SM (16 warps, registers capped at 128) measured
// 0-8% slower at 1-2048 tokens on two H100 runs (2b0f8f2, a1e373f; docs/MXFP4.md) and was removed. A 5-stage ring
// (unpadded stage rows with swizzled chunks, to fit 3 CTAs per SM) measured gate/up 1-7% faster and down 3-8%
// slower, the layer unchanged (H100, 801f95b against fc6ce31, issue31_h100_801f95b.json), and was reverted.
constexpr int kStages = 4;
constexpr int kCtasPerSm = 3;
// The register bound of the kernel (__launch_bounds__' minimum CTAs per SM): the gated mode's ring (two matrices,
// 63 KB) fits 3 CTAs per SM, the single-matrix modes' (down, relu2's gate/up: 42 KB) 4, which 128 registers a
// thread allow. Left at 3, the down kernel took 130 registers once its B fragments lost their byte permutes
// (45766b8) and ran at 3 CTAs per SM: 6-8% slower at 16-256 tokens (H100, session 25, ncu: 216.7 against 233.2
// µs at 64 tokens, bench/results/issue31_h100_s25.json). The plan (plan_rows) still counts kCtasPerSm.
template <Mode kMode>
constexpr int kRegisterBoundCtasPerSm = kMode == Mode::gated ? kCtasPerSm : 4;
// How far past a copy's bytes the L2 fetches from DRAM on a miss (cp.async's prefetch size): a step reads 64 code
// bytes and 4 scale bytes of each of its rows, rows K/2 (K/32) bytes apart, so without a hint DRAM sees short
// scattered reads; 128 or 256 bytes bring the row's next steps into L2 with the first. GemmChoice::option of
// mxfp4_rows: 0 the default (default_fetch), 1 none, 2 128 bytes for the codes, 3 256 bytes for the codes, 4 128
// bytes for the codes and the scale words.
enum class L2Fetch { none, b128, b256, b128_scales };
// Measured on an H100 (5bb32e4, grouped_gemm_bench, kimi-k3 tp-shard 8, bench/results/issue31_h100_5bb32e4.json):
// gate/up (K 3584, rows of 1792 bytes) 128 bytes 1.13-1.22x faster than none at 8-1024 tokens (380 against 449 µs at
// 64), 256 bytes the same within 1%; down (K 384: a block's 64 rows are 12 KB in a row, read in 3 steps) none
// the fastest or within 2% at 1-1024 tokens, 256 bytes up to 6% slower. So 128 bytes for long rows, none for short
// ones; the boundary, K 1024, lies between the two measured shapes. Prefetching the scale words too (option 4) stayed
// within the run-to-run spread of option 2 at 16-1024 tokens, tp-shard 8 and 1 (d34d8e3, issue31_h100_d34d8e3.json).
L2Fetch default_fetch(int k) { return k >= 1024 ? L2Fetch::b128 : L2Fetch::none; }
constexpr int kPassRows = 16;  // expert rows per pass: two n8 tiles
constexpr int kRowsWarps = 4;  // warps a CTA: 64 weight rows (kept a parameter of the templates below)
// Shared-memory row strides, padded so that the fragment reads are free of bank conflicts: a code row
// of a step is 64 bytes (+16: the 8 rows g of a warp's LDS.32 fall on 8 distinct 4-bank sets), an
// activation row 256 bytes (+64: rows g and g + 1, which share a phase of an LDS.128, use opposite halves).
constexpr int kCodeStride = kStepGroups * 16 + 16;
constexpr int kActStride = kStepGroups * 64 + 64;

template <Mode kMode>
constexpr int kMats = kMode == Mode::gated ? 2 : 1;

// kWarps warps, 16 weight rows each: a block of 16 kWarps rows. kAligned: every row's scale bytes of a step
// lie in one aligned word (K a multiple of 128 and the scale tensors 4-byte aligned): one word per row and
// step; otherwise the aligned word holding each (row, group)'s byte.
template <Mode kMode, int kWarps, bool kAligned>
struct Stage {
  static constexpr int kRows = 16 * kWarps;
  static constexpr int kWordsPerRow = kAligned ? 1 : kStepGroups;
  uint8_t codes[kMats<kMode>][kRows * kCodeStride];
  uint32_t scale_words[kMats<kMode>][kRows * kWordsPerRow];
  uint8_t acts[kPassRows * kActStride];
};

__device__ __forceinline__ uint32_t lds_u32(const void* p) { return *static_cast<const uint32_t*>(p); }

// The CTA's place in the work. Expert e's weight blocks [first_block, first_block + blocks), the k-steps
// [ks_begin, ks_end) of its split of the reduction (all of them without split-K).
struct Walk {
  int expert, first_row;  // the expert's first grouped row
  int rows;               // the expert's rows
  int first_block, blocks, ks_begin, ks_end, groups;
  __device__ int passes() const { return (rows + kPassRows - 1) / kPassRows; }
  __device__ int steps() const { return passes() * blocks * (ks_end - ks_begin); }
};

// A position in the walk: (pass, block, k-step), k-step fastest. Advanced one step at a time (no division
// in the loop); `advance` reports what changed.
struct Cursor {
  int pass, block, ks;
  enum Change { kStep, kBlock, kPass };
  __device__ Change advance(const Walk& w) {
    if (++ks < w.ks_end) return kStep;
    ks = w.ks_begin;
    if (++block < w.first_block + w.blocks) return kBlock;
    block = w.first_block;
    ++pass;
    return kPass;
  }
};

// The L2 prefetch sizes of L2Fetch for the code copies and the scale-word copies (cp_async_*_prefetch).
constexpr int code_prefetch_bytes(L2Fetch fetch) {
  return fetch == L2Fetch::none ? 0 : fetch == L2Fetch::b256 ? 256 : 128;
}
constexpr int scale_prefetch_bytes(L2Fetch fetch) { return fetch == L2Fetch::b128_scales ? 128 : 0; }

// One thread's share of every step's copies, with the sources of the current block's rows and the pass's
// activation rows kept as pointers: per step a copy costs one 64-bit add (the step's offset, shared by all
// copies) and the cp.async (the pass's activation rows are looked up in sorted_pairs once per pass, the weight
// rows' addresses computed once per block).
template <class T, Mode kMode, int kWarps, bool kAligned, L2Fetch kFetch>
struct Loader {
  using S = Stage<kMode, kWarps, kAligned>;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kCodeCopies = S::kRows * kStepGroups / kThreads;  // 16-byte code copies per matrix
  static constexpr int kActCopies = (kPassRows * 16 + kThreads - 1) / kThreads;
  static_assert(S::kRows * kStepGroups % kThreads == 0 && kThreads % 16 == 0, "whole copy rounds");

  const uint8_t* scales[2];                             // the expert's scales, per matrix (compute_step's addresses)
  const uint8_t* code_row[kMats<kMode>][kCodeCopies];   // copy j's (row of the block, clamped) codes + part * 16
  const uint8_t* scale_row[kMats<kMode>][kCodeCopies];  // that row's scale bytes
  const T* act_src[kActCopies];
  bool act_ok[kActCopies];
  Cursor at;  // the next step to load

  // A thread's code copy j: weight row u / 4 of the block, 16-byte part u % 4 (u = tid + j * kThreads).
  __device__ void set_block(const KernelArgs& a, const Walk& w) {
#pragma unroll
    for (int j = 0; j < kCodeCopies; ++j) {
      const int row = min(at.block * S::kRows + (threadIdx.x + j * kThreads) / kStepGroups, a.n - 1);  // clamped
#pragma unroll
      for (int m = 0; m < kMats<kMode>; ++m) {
        const uint8_t* codes =
            static_cast<const uint8_t*>(m == 0 ? a.w0 : a.w1) + static_cast<int64_t>(w.expert) * a.n * (a.k / 2);
        code_row[m][j] = codes + static_cast<int64_t>(row) * (a.k / 2) + (threadIdx.x % kStepGroups) * 16;
        scale_row[m][j] = scales[m] + static_cast<int64_t>(row) * w.groups;
      }
    }
  }
  // A thread's activation copy j: pass row u / 16, 16-byte part u % 16 of the row's step (u = tid + j * kThreads).
  __device__ void set_pass(const KernelArgs& a, const Walk& w) {
#pragma unroll
    for (int j = 0; j < kActCopies; ++j) {
      const int r = (threadIdx.x + j * kThreads) / 16, idx = at.pass * kPassRows + r;
      act_ok[j] = r < kPassRows && idx < w.rows;
      const int64_t a_row = !act_ok[j]                  ? 0
                            : a.sorted_pairs != nullptr ? a.sorted_pairs[w.first_row + idx] / a.top_k
                                                        : w.first_row + idx;
      act_src[j] = static_cast<const T*>(a.a) + a_row * a.k + (threadIdx.x % 16) * 8;
    }
  }
  __device__ void start(const KernelArgs& a, const Walk& w) {
    scales[0] = a.s0 + static_cast<int64_t>(w.expert) * a.n * w.groups;
    scales[1] = kMats<kMode> == 2 ? a.s1 + static_cast<int64_t>(w.expert) * a.n * w.groups : scales[0];
    at = Cursor{0, w.first_block, w.ks_begin};
    set_block(a, w);
    set_pass(a, w);
  }

  // Issues the copies of step `at` into `stage`, commits them as one group and moves to the next step.
  __device__ void load(const KernelArgs& a, const Walk& w, S& stage) {
    const int tid = threadIdx.x, part = tid % kStepGroups;
    const int q = at.ks * kStepGroups + part;
    // Groups past K (a partial last step) are zero-filled; with whole steps (kAligned) there are none.
    const bool valid = kAligned || q < w.groups;
    const int code_step = valid ? at.ks * kStepGroups * 16 : -part * 16;  // an invalid copy points at its row's start
#pragma unroll
    for (int m = 0; m < kMats<kMode>; ++m) {
#pragma unroll
      for (int j = 0; j < kCodeCopies; ++j) {
        const int row = (tid + j * kThreads) / kStepGroups;
        cp_async_16_prefetch<code_prefetch_bytes(kFetch)>(smem_u32(&stage.codes[m][row * kCodeStride + part * 16]),
                                                          code_row[m][j] + code_step, valid);
        if constexpr (kAligned) {
          if (part == 0) {  // the row's four scale bytes of the step, one aligned word (K has whole steps)
            cp_async_4_prefetch<scale_prefetch_bytes(kFetch)>(smem_u32(&stage.scale_words[m][row]),
                                                              scale_row[m][j] + at.ks * kStepGroups, true);
          }
        } else {
          // The aligned word by absolute address (a scale tensor may start anywhere).
          const uint8_t* scale = scale_row[m][j] + (valid ? q : 0);
          cp_async_4_prefetch<scale_prefetch_bytes(kFetch)>(
              smem_u32(&stage.scale_words[m][row * kStepGroups + part]),
              reinterpret_cast<const uint8_t*>(reinterpret_cast<uintptr_t>(scale) & ~uintptr_t{3}), valid);
        }
      }
    }
    // The pass's activation rows: 16 rows of 256 bytes (4 groups of 32 values), 16 copies each.
#pragma unroll
    for (int j = 0; j < kActCopies; ++j) {
      const int r = (tid + j * kThreads) / 16, part16 = tid % 16;
      if (r >= kPassRows) break;
      const bool ok = act_ok[j] && (kAligned || at.ks * kStepGroups + part16 / 4 < w.groups);
      cp_async_16(smem_u32(&stage.acts[r * kActStride + part16 * 16]),
                  ok ? act_src[j] + static_cast<int64_t>(at.ks) * kStepGroups * 32 : act_src[j], ok);
    }
    cp_async_commit();
    switch (at.advance(w)) {
      case Cursor::kPass:
        set_pass(a, w);
        set_block(a, w);
        break;
      case Cursor::kBlock:
        set_block(a, w);
        break;
      case Cursor::kStep:
        break;
    }
  }
};

// The B fragments of group q, n8 tile c: the activation values at the lane's eight columns, whose 32-bit words are
// the column pairs the codes' nibble pairs decode to (the kernel order), so they feed the MMAs as loaded.
struct BFragments {
  uint32_t b00, b01, b10, b11;
};
template <int kStride>
__device__ __forceinline__ BFragments b_fragments(const uint8_t* acts, int c, int q, int g, int t) {
  const uint4 x = *reinterpret_cast<const uint4*>(&acts[(c * 8 + g) * kStride + q * 64 + 16 * t]);
  return {x.x, x.y, x.z, x.w};
}

// One step's MMAs for a warp, kTiles n8 tiles of the pass, every scale applied in fp32 after its group's two
// MMAs (any scale byte). scale_address[m][h]: the low bits of the address of group 0's scale byte of matrix
// m, row g + 8 h of the warp's tile (the byte's place in its aligned word; unused when kAligned).
template <class T, Mode kMode, int kWarps, bool kAligned, int kTiles>
__device__ __forceinline__ void compute_step(const Stage<kMode, kWarps, kAligned>& stage, int warp, int g, int t,
                                             const uint32_t (&scale_address)[2][2], int ks, float (&acc)[2][2][4]) {
  using S = Stage<kMode, kWarps, kAligned>;
  const int row_lo = warp * 16 + g, row_hi = row_lo + 8;
#pragma unroll
  for (int q = 0; q < kStepGroups; ++q) {
    uint32_t lo[2], hi[2];
    float scale_lo[2], scale_hi[2];
#pragma unroll
    for (int m = 0; m < kMats<kMode>; ++m) {
      lo[m] = lds_u32(&stage.codes[m][row_lo * kCodeStride + q * 16 + 4 * t]);
      hi[m] = lds_u32(&stage.codes[m][row_hi * kCodeStride + q * 16 + 4 * t]);
      if constexpr (kAligned) {
        scale_lo[m] = e8m0_scale((stage.scale_words[m][row_lo] >> (8 * q)) & 0xFFu);
        scale_hi[m] = e8m0_scale((stage.scale_words[m][row_hi] >> (8 * q)) & 0xFFu);
      } else {
        const uint32_t shift_lo = ((scale_address[m][0] + ks * kStepGroups + q) & 3u) * 8u;
        const uint32_t shift_hi = ((scale_address[m][1] + ks * kStepGroups + q) & 3u) * 8u;
        scale_lo[m] = e8m0_scale((stage.scale_words[m][row_lo * S::kWordsPerRow + q] >> shift_lo) & 0xFFu);
        scale_hi[m] = e8m0_scale((stage.scale_words[m][row_hi * S::kWordsPerRow + q] >> shift_hi) & 0xFFu);
      }
    }
#pragma unroll
    for (int c = 0; c < kTiles; ++c) {
      const BFragments b = b_fragments<kActStride>(stage.acts, c, q, g, t);
#pragma unroll
      for (int m = 0; m < kMats<kMode>; ++m) {
        float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        mma_16x8x16<T>(d, e2m1_pair<T, 0>(lo[m]), e2m1_pair<T, 0>(hi[m]), e2m1_pair<T, 1>(lo[m]),
                       e2m1_pair<T, 1>(hi[m]), b.b00, b.b01);
        mma_16x8x16<T>(d, e2m1_pair<T, 2>(lo[m]), e2m1_pair<T, 2>(hi[m]), e2m1_pair<T, 3>(lo[m]),
                       e2m1_pair<T, 3>(hi[m]), b.b10, b.b11);
        acc[m][c][0] = fmaf(d[0], scale_lo[m], acc[m][c][0]);
        acc[m][c][1] = fmaf(d[1], scale_lo[m], acc[m][c][1]);
        acc[m][c][2] = fmaf(d[2], scale_hi[m], acc[m][c][2]);
        acc[m][c][3] = fmaf(d[3], scale_hi[m], acc[m][c][3]);
      }
    }
  }
}

// The same step with bf16 activations and aligned scale words whose bytes are all <= 128: each row's scale
// folded into its decoded values (e2m1_pair_scaled_bf16, exact), so the MMAs accumulate straight into acc
// (no per-group product, scale and add).
template <Mode kMode, int kWarps, int kTiles, int kQ>
__device__ __forceinline__ void compute_group_scaled(const Stage<kMode, kWarps, true>& stage, int warp, int g, int t,
                                                     const uint32_t (&scales_lo)[2], const uint32_t (&scales_hi)[2],
                                                     float (&acc)[2][2][4]) {
  const int row_lo = warp * 16 + g, row_hi = row_lo + 8;
  uint32_t a[2][8];
#pragma unroll
  for (int m = 0; m < kMats<kMode>; ++m) {
    const uint32_t lo = lds_u32(&stage.codes[m][row_lo * kCodeStride + kQ * 16 + 4 * t]);
    const uint32_t hi = lds_u32(&stage.codes[m][row_hi * kCodeStride + kQ * 16 + 4 * t]);
    const uint32_t f_lo = scale_factor_bf16<kQ>(scales_lo[m]), f_hi = scale_factor_bf16<kQ>(scales_hi[m]);
    a[m][0] = e2m1_pair_scaled_bf16<0>(lo, f_lo);
    a[m][1] = e2m1_pair_scaled_bf16<0>(hi, f_hi);
    a[m][2] = e2m1_pair_scaled_bf16<1>(lo, f_lo);
    a[m][3] = e2m1_pair_scaled_bf16<1>(hi, f_hi);
    a[m][4] = e2m1_pair_scaled_bf16<2>(lo, f_lo);
    a[m][5] = e2m1_pair_scaled_bf16<2>(hi, f_hi);
    a[m][6] = e2m1_pair_scaled_bf16<3>(lo, f_lo);
    a[m][7] = e2m1_pair_scaled_bf16<3>(hi, f_hi);
  }
#pragma unroll
  for (int c = 0; c < kTiles; ++c) {
    const BFragments b = b_fragments<kActStride>(stage.acts, c, kQ, g, t);
#pragma unroll
    for (int m = 0; m < kMats<kMode>; ++m) {
      mma_16x8x16<__nv_bfloat16>(acc[m][c], a[m][0], a[m][1], a[m][2], a[m][3], b.b00, b.b01);
      mma_16x8x16<__nv_bfloat16>(acc[m][c], a[m][4], a[m][5], a[m][6], a[m][7], b.b10, b.b11);
    }
  }
}

// A step on the folded path if every scale byte of the warp's rows allows it (one vote), else compute_step.
template <class T, Mode kMode, int kWarps, bool kAligned, int kTiles>
__device__ __forceinline__ void run_step(const Stage<kMode, kWarps, kAligned>& stage, int warp, int g, int t,
                                         const uint32_t (&scale_address)[2][2], int ks, float (&acc)[2][2][4]) {
  if constexpr (kAligned && std::is_same_v<T, __nv_bfloat16>) {
    const int row_lo = warp * 16 + g, row_hi = row_lo + 8;
    uint32_t scales_lo[2] = {0, 0}, scales_hi[2] = {0, 0};
    bool above = false;
#pragma unroll
    for (int m = 0; m < kMats<kMode>; ++m) {
      scales_lo[m] = stage.scale_words[m][row_lo];
      scales_hi[m] = stage.scale_words[m][row_hi];
      above = above || any_scale_above_128(scales_lo[m]) || any_scale_above_128(scales_hi[m]);
      scales_lo[m] += 0x7E7E7E7Eu;  // no carry: every byte <= 128 where the sums are used
      scales_hi[m] += 0x7E7E7E7Eu;
    }
    if (!__any_sync(0xffffffffu, above)) {
      compute_group_scaled<kMode, kWarps, kTiles, 0>(stage, warp, g, t, scales_lo, scales_hi, acc);
      compute_group_scaled<kMode, kWarps, kTiles, 1>(stage, warp, g, t, scales_lo, scales_hi, acc);
      compute_group_scaled<kMode, kWarps, kTiles, 2>(stage, warp, g, t, scales_lo, scales_hi, acc);
      compute_group_scaled<kMode, kWarps, kTiles, 3>(stage, warp, g, t, scales_lo, scales_hi, acc);
      return;
    }
  }
  compute_step<T, kMode, kWarps, kAligned, kTiles>(stage, warp, g, t, scale_address, ks, acc);
}

// Where accumulator (c, i) of lane (g, t) belongs: the pass row (an index into the expert's rows) and the
// output column. C fragment: acc[.][c][0..1] weight row g, pass rows 8c + 2t and 8c + 2t + 1; acc[.][c][2..3]
// weight row g + 8.
struct FragmentPlace {
  int idx, col;
};
__device__ __forceinline__ FragmentPlace fragment_place(int pass, int first_row_of_tile, int g, int t, int c, int i) {
  return {pass * kPassRows + c * 8 + 2 * t + (i & 1), first_row_of_tile + g + (i >= 2 ? 8 : 0)};
}

// Stores a warp's outputs of one (pass, block) and clears its accumulators.
template <class T, Mode kMode>
__device__ __forceinline__ void store_pass(const KernelArgs& a, const Walk& w, int pass, int first_row_of_tile, int g,
                                           int t, float (&acc)[2][2][4]) {
  T* out = static_cast<T*>(a.out);
#pragma unroll
  for (int c = 0; c < 2; ++c) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const auto [idx, row] = fragment_place(pass, first_row_of_tile, g, t, c, i);
      float value;
      if constexpr (kMode == Mode::gated) {
        value = gated_act<true>(acc[0][c][i], acc[1][c][i], a);
      } else if constexpr (kMode == Mode::relu2) {
        value = act::relu2(acc[0][c][i]);
      } else {
        value = acc[0][c][i];
      }
      if (idx < w.rows && row < a.n) out[static_cast<int64_t>(w.first_row + idx) * a.n + row] = from_float<T>(value);
      acc[0][c][i] = 0.0f;
      acc[1][c][i] = 0.0f;
    }
  }
}

// Split-K: this CTA's fp32 sums of one (pass, block), stored per grouped row in
// partials[((row * k_splits + split) * kMats + m) * n + column] (rows of the expert only), then cleared.
template <Mode kMode>
__device__ __forceinline__ void store_partials(const KernelArgs& a, const Walk& w, int split, int pass,
                                               int first_row_of_tile, int g, int t, float (&acc)[2][2][4]) {
#pragma unroll
  for (int c = 0; c < 2; ++c) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const auto [idx, col] = fragment_place(pass, first_row_of_tile, g, t, c, i);
#pragma unroll
      for (int m = 0; m < kMats<kMode>; ++m) {
        if (idx < w.rows && col < a.n) {
          __stcg(a.partials +
                     ((static_cast<int64_t>(w.first_row + idx) * a.k_splits + split) * kMats<kMode> + m) * a.n + col,
                 acc[m][c][i]);
        }
        acc[m][c][i] = 0.0f;
      }
    }
  }
}

// Split-K, the last CTA of a tile: the sums of every split of one (pass, block), added in split order (the
// result does not depend on which CTA came last). Split by split, each thread's 16 loads of a split are issued
// together (one L2 round trip a split, not one per value: at one token the serial form took ~40 µs).
template <Mode kMode>
__device__ __forceinline__ void gather_partials(const KernelArgs& a, const Walk& w, int pass, int first_row_of_tile,
                                                int g, int t, float (&acc)[2][2][4]) {
  const int64_t split_stride = static_cast<int64_t>(kMats<kMode>) * a.n;
#pragma unroll 1
  for (int split = 0; split < a.k_splits; ++split) {
    float part[2][2][4];
#pragma unroll
    for (int c = 0; c < 2; ++c) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const auto [idx, col] = fragment_place(pass, first_row_of_tile, g, t, c, i);
        const bool ok = idx < w.rows && col < a.n;
        const float* p =
            a.partials + (static_cast<int64_t>(w.first_row + idx) * a.k_splits + split) * split_stride + col;
#pragma unroll
        for (int m = 0; m < kMats<kMode>; ++m) part[m][c][i] = ok ? __ldcg(p + m * a.n) : 0.0f;
      }
    }
#pragma unroll
    for (int m = 0; m < kMats<kMode>; ++m) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[m][c][i] = split == 0 ? part[m][c][i] : acc[m][c][i] + part[m][c][i];
      }
    }
  }
}

// Grid (x_count * k_splits, E): blockIdx.x = x * k_splits + split, x the CTA's group of weight blocks.
// CTAs per SM: what the shared memory allows (gated 3, up to 170 registers; the others 4, up to 128).
template <class T, Mode kMode, int kWarps, bool kAligned, L2Fetch kFetch>
__global__ void __launch_bounds__(32 * kWarps, kRegisterBoundCtasPerSm<kMode>)
    mxfp4_rows_kernel(KernelArgs a, int blocks_per_cta) {
  using S = Stage<kMode, kWarps, kAligned>;
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ bool s_is_last;
  S* stages = reinterpret_cast<S*>(smem);
  // expert_offsets, sorted_pairs and (down) the act rows come from the kernels before (pdl.cuh).
  pdl_wait();
  pdl_trigger();
  const int split = static_cast<int>(blockIdx.x) % a.k_splits, x = static_cast<int>(blockIdx.x) / a.k_splits;
  Walk w;
  w.expert = static_cast<int>(blockIdx.y);
  w.first_row = a.expert_offsets[w.expert];
  w.rows = a.expert_offsets[w.expert + 1] - w.first_row;
  const int total_blocks = (a.n + S::kRows - 1) / S::kRows;
  w.first_block = x * blocks_per_cta;
  w.blocks = min(blocks_per_cta, total_blocks - w.first_block);
  w.groups = a.k / kMxfp4Group;
  const int k_steps = k_steps_of(a.k);
  w.ks_begin = a.k_splits > 1 ? split * a.k_tiles_per_split : 0;
  w.ks_end = a.k_splits > 1 ? min(k_steps, w.ks_begin + a.k_tiles_per_split) : k_steps;
  if (w.rows <= 0 || w.blocks <= 0 || w.ks_begin >= w.ks_end) return;
  const int steps = w.steps();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  float acc[2][2][4] = {};
  Loader<T, kMode, kWarps, kAligned, kFetch> loader;
  loader.start(a, w);
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) {
    if (i < steps) {
      loader.load(a, w, stages[i]);
    } else {
      cp_async_commit();
    }
  }
  uint32_t scale_address[2][2] = {};  // compute_step
  Cursor at{0, w.first_block, w.ks_begin};
  for (int i = 0; i < steps; ++i) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    if (i + kStages - 1 < steps) {
      loader.load(a, w, stages[(i + kStages - 1) % kStages]);
    } else {
      cp_async_commit();
    }
    if (!kAligned && at.ks == w.ks_begin) {
#pragma unroll
      for (int m = 0; m < kMats<kMode>; ++m) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = min(at.block * S::kRows + warp * 16 + g + 8 * h, a.n - 1);
          scale_address[m][h] = static_cast<uint32_t>(reinterpret_cast<uintptr_t>(loader.scales[m] + row * w.groups));
        }
      }
    }
    const S& stage = stages[i % kStages];
    if (w.rows - at.pass * kPassRows > 8) {
      run_step<T, kMode, kWarps, kAligned, 2>(stage, warp, g, t, scale_address, at.ks, acc);
    } else {
      run_step<T, kMode, kWarps, kAligned, 1>(stage, warp, g, t, scale_address, at.ks, acc);
    }
    if (at.ks == w.ks_end - 1) {
      const int first_row_of_tile = at.block * S::kRows + warp * 16;
      if (a.k_splits > 1) {
        store_partials<kMode>(a, w, split, at.pass, first_row_of_tile, g, t, acc);
      } else {
        store_pass<T, kMode>(a, w, at.pass, first_row_of_tile, g, t, acc);
      }
    }
    at.advance(w);
  }
  cp_async_wait<0>();
  if (a.k_splits == 1) return;
  // Split-K: the last of the tile's k_splits CTAs to arrive adds them all and stores (tile: the expert's first
  // grouped row, unique per touched expert, and x). It resets the counter for the next launch.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    int* counter = a.tile_counters + static_cast<int64_t>(w.first_row) * (gridDim.x / a.k_splits) + x;
    s_is_last = atomicAdd(counter, 1) == a.k_splits - 1;
    if (s_is_last) *counter = 0;
  }
  __syncthreads();
  if (!s_is_last) return;
  __threadfence();
  for (int pass = 0; pass < w.passes(); ++pass) {
    for (int block = w.first_block; block < w.first_block + w.blocks; ++block) {
      const int first_row_of_tile = block * S::kRows + warp * 16;
      gather_partials<kMode>(a, w, pass, first_row_of_tile, g, t, acc);
      store_pass<T, kMode>(a, w, pass, first_row_of_tile, g, t, acc);
    }
  }
}

// How a launch divides the work: weight blocks a CTA takes, and the split of the reduction.
struct RowsPlan {
  int blocks_per_cta = 1;
  int k_splits = 1;
  int steps_per_split = 0;
};

// Weight blocks (of block_rows rows) a CTA takes for an output of n columns and a reduction of k.
int mxfp4_rows_blocks_per_cta(int n, int k, int block_rows) {
  // At least ~16 pipeline steps a CTA where the blocks allow: a short K (Kimi-K3's down at tp-shard 8 has 3
  // steps a block) would otherwise spend most of each CTA filling and draining its ring.
  const int k_steps = k_steps_of(k);
  const int total_blocks = (n + block_rows - 1) / block_rows;
  return std::clamp((16 + k_steps - 1) / k_steps, 1, total_blocks);
}

// launch.k_splits: 0 chosen here, 1 none, more forced (then a workspace too small is an error).
RowsPlan plan_rows(const KernelArgs& args, int block_rows, int smem_bytes, int max_ctas_per_sm, int mats,
                   const MmaLaunch& launch) {
  RowsPlan plan;
  const int k_steps = k_steps_of(args.k);
  const int total_blocks = (args.n + block_rows - 1) / block_rows;
  plan.blocks_per_cta = mxfp4_rows_blocks_per_cta(args.n, args.k, block_rows);
  int splits = launch.k_splits;
  if (splits == 0) {
    // Split K only where the touched experts' blocks leave most CTA slots empty (few tokens, few output
    // columns: Kimi-K3's gate/up at tp-shard 8 and one token has 16 experts x 6 blocks for 132 x 3 slots) and
    // K is long (no blocks grouped per CTA); each split keeps at least 4 steps so that its ring fills.
    splits = 1;
    const int64_t touched = std::max<int64_t>(1, std::min<int64_t>(args.num_experts, launch.max_rows));
    const int64_t ctas = touched * total_blocks;
    const int per_sm = std::clamp((current_shared_memory_optin() + 1024) / (smem_bytes + 1024), 1, max_ctas_per_sm);
    const int64_t resident = static_cast<int64_t>(launch.sm_count) * per_sm;
    if (launch.partials != nullptr && plan.blocks_per_cta == 1 && 2 * ctas <= resident) {
      splits = static_cast<int>(std::clamp<int64_t>(resident / ctas, 1, std::max(1, k_steps / 4)));
    }
  }
  splits = std::min(splits, k_steps);
  if (splits <= 1) return plan;
  const RowsPlan unsplit = plan;
  plan.steps_per_split = (k_steps + splits - 1) / splits;
  plan.k_splits = (k_steps + plan.steps_per_split - 1) / plan.steps_per_split;  // no empty split
  plan.blocks_per_cta = 1;
  if (plan.k_splits == 1) return unsplit;
  const int64_t counters = launch.max_rows * total_blocks;
  const int64_t floats = launch.max_rows * plan.k_splits * mats * static_cast<int64_t>(args.n);
  const bool fits = launch.partials != nullptr && counters <= launch.num_tile_counters &&
                    floats <= static_cast<int64_t>(launch.partial_floats);
  if (!fits && launch.k_splits == 0) return unsplit;
  LATENTMOE_CHECK(launch.partials != nullptr, "grouped GEMM (mxfp4_rows): ", launch.k_splits,
                  " splits of the reduction need a workspace");
  LATENTMOE_CHECK(fits, "grouped GEMM (mxfp4_rows): ", plan.k_splits, " splits of the reduction for ", launch.max_rows,
                  " rows and ", args.n, " columns need ", counters, " tile counters and ", floats * sizeof(float),
                  " bytes of partial sums; the workspace has ", launch.num_tile_counters, " and ",
                  launch.partial_floats * sizeof(float));
  return plan;
}

template <class T, Mode kMode, int kWarps, bool kAligned, L2Fetch kFetch>
void launch_rows(KernelArgs args, const MmaLaunch& launch, bool programmatic, cudaStream_t stream) {
  using S = Stage<kMode, kWarps, kAligned>;
  static std::atomic<uint64_t> smem_done{0};
  constexpr int kSmem = kStages * static_cast<int>(sizeof(S));
  auto kernel = mxfp4_rows_kernel<T, kMode, kWarps, kAligned, kFetch>;
  ensure_smem_limit(reinterpret_cast<const void*>(kernel), kSmem, &smem_done);
  const RowsPlan plan = plan_rows(args, S::kRows, kSmem, kCtasPerSm, kMats<kMode>, launch);
  args.k_splits = plan.k_splits;
  args.k_tiles_per_split = plan.steps_per_split;
  args.partials = launch.partials;
  args.tile_counters = launch.tile_counters;
  const int total_blocks = (args.n + S::kRows - 1) / S::kRows;
  const dim3 grid((total_blocks + plan.blocks_per_cta - 1) / plan.blocks_per_cta * plan.k_splits,
                  static_cast<unsigned>(args.num_experts));
  launch_kernel("grouped GEMM (mxfp4_rows)", programmatic, kernel, grid, dim3(32 * kWarps), kSmem, stream, args,
                plan.blocks_per_cta);
}

template <class T, Mode kMode, bool kAligned>
void launch_fetch(const KernelArgs& args, L2Fetch fetch, const MmaLaunch& launch, bool programmatic,
                  cudaStream_t stream) {
  switch (fetch) {
    case L2Fetch::none:
      return launch_rows<T, kMode, kRowsWarps, kAligned, L2Fetch::none>(args, launch, programmatic, stream);
    case L2Fetch::b128:
      return launch_rows<T, kMode, kRowsWarps, kAligned, L2Fetch::b128>(args, launch, programmatic, stream);
    case L2Fetch::b256:
      return launch_rows<T, kMode, kRowsWarps, kAligned, L2Fetch::b256>(args, launch, programmatic, stream);
    case L2Fetch::b128_scales:
      return launch_rows<T, kMode, kRowsWarps, kAligned, L2Fetch::b128_scales>(args, launch, programmatic, stream);
  }
}

template <class T, Mode kMode>
void launch_shape(const KernelArgs& args, bool aligned, L2Fetch fetch, const MmaLaunch& launch, bool programmatic,
                  cudaStream_t stream) {
  aligned ? launch_fetch<T, kMode, true>(args, fetch, launch, programmatic, stream)
          : launch_fetch<T, kMode, false>(args, fetch, launch, programmatic, stream);
}

template <class T>
void launch_mode(Mode mode, const KernelArgs& args, bool aligned, L2Fetch fetch, const MmaLaunch& launch,
                 bool programmatic, cudaStream_t stream) {
  switch (mode) {
    case Mode::gated:
      launch_shape<T, Mode::gated>(args, aligned, fetch, launch, programmatic, stream);
      return;
    case Mode::relu2:
      launch_shape<T, Mode::relu2>(args, aligned, fetch, launch, programmatic, stream);
      return;
    case Mode::plain:
      launch_shape<T, Mode::plain>(args, aligned, fetch, launch, programmatic, stream);
      return;
  }
}

bool aligned4(const void* p) { return p == nullptr || (reinterpret_cast<uintptr_t>(p) & 3) == 0; }

}  // namespace

void launch_mxfp4_rows(DType dtype, Mode mode, const KernelArgs& args, int cta_blocks, const MmaLaunch& launch,
                       bool programmatic, cudaStream_t stream) {
  LATENTMOE_CHECK(args.s0 != nullptr && (mode != Mode::gated || args.s1 != nullptr),
                  "grouped GEMM: the mxfp4_rows variant takes MXFP4 weights only");
  LATENTMOE_CHECK(dtype == DType::bf16 || dtype == DType::f16,
                  "grouped GEMM: the mxfp4_rows variant takes bf16 or f16 "
                  "activations, not ",
                  dtype_name(dtype));
  LATENTMOE_CHECK(args.k % kMxfp4Group == 0 && args.n > 0, "grouped GEMM: mxfp4_rows needs K a multiple of ",
                  kMxfp4Group, " (K ", args.k, ", N ", args.n, ")");
  LATENTMOE_CHECK(static_cast<int64_t>(args.n) * (args.k / 2) <= INT32_MAX,
                  "grouped GEMM: mxfp4_rows takes expert matrices of at most 2^31 code bytes (N ", args.n, ", K ",
                  args.k, ")");
  // One CTA shape, 4 warps (64 weight rows): on an H100 (9bbd3be, grouped_gemm_bench, kimi-k3 tp-shard 8,
  // gate/up + down) CTAs of 8 warps (128 rows, 2 per SM) were 12-16% slower at every count from 8 to 256
  // tokens (891 against 788 µs at 64 tokens) and were removed.
  LATENTMOE_CHECK(cta_blocks == 0 || cta_blocks == 1,
                  "grouped GEMM: mxfp4_rows takes one block of 64 weight rows a CTA (n_tiles_per_cta 0 or 1), not ",
                  cta_blocks);
  const L2Fetch by_option[] = {default_fetch(args.k), L2Fetch::none, L2Fetch::b128, L2Fetch::b256,
                               L2Fetch::b128_scales};
  const L2Fetch fetch = by_option[launch.variant_option];  // 0-4: checked by grouped_gemm
  const bool aligned = args.k % (kStepGroups * kMxfp4Group) == 0 && aligned4(args.s0) && aligned4(args.s1);
  if (dtype == DType::bf16) {
    launch_mode<__nv_bfloat16>(mode, args, aligned, fetch, launch, programmatic, stream);
  } else {
    launch_mode<__half>(mode, args, aligned, fetch, launch, programmatic, stream);
  }
}

}  // namespace latentmoe::cuda::gg

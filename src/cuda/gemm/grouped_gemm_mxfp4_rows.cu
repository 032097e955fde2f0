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
// Work: CTA (x, e) owns expert e's weight blocks of 16 kWarps rows (64: the default 4 warps; 128 with 8)
// [x * blocks_per_cta, ...) and walks the steps
// (pass, block, k-step) in that order through one pipeline; after a block's last k-step its warps store
// that pass's outputs and clear their accumulators.
//   warp w: rows 16 w .. 16 w + 15 of the block; lane (g, t) holds rows g and g + 8 (the A fragment) and,
//   per n8 tile c of the pass, the expert's row 8 c + g (the B fragment, at the same k slots).
// k order: as mxfp4_decode_mma.cu: per scale group two MMAs; lane t takes code bytes 4t..4t+3 of the group
//   for its rows (nibbles i and i + 4 form one register, e2m1_pair) and the activation values at the same
//   eight columns, permuted the same way. Scales: with bf16 and aligned scale words, each row's scale is
//   folded into its decoded values where every scale byte of the warp's step is <= 128 (exact; the MMAs
//   then accumulate in place: run_step); otherwise each group's MMAs start from zero, and their fp32
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
#include "cuda/common/mma.cuh"
#include "cuda/common/pdl.cuh"
#include "cuda/gemm/grouped_gemm_launch.cuh"
#include "cuda/gemm/grouped_gemm_mma.cuh"
#include "cuda/gemm/mxfp4_device.cuh"
#include "latentmoe/error.h"

namespace latentmoe::cuda::gg {
namespace {

constexpr int kStepGroups = 4;  // scale groups per pipeline step
constexpr int kStages = 4;
constexpr int kPassRows = 16;  // expert rows per pass: two n8 tiles
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

// The CTA's place in the work and the pipeline's step arithmetic.
struct Walk {
  int expert, first_row;  // the expert's first grouped row
  int rows;               // the expert's rows
  int first_block, blocks, k_steps, groups;
  __device__ int steps() const { return ((rows + kPassRows - 1) / kPassRows) * blocks * k_steps; }
};

// Issues the copies of step `i` into `stage` (every thread, its share) and commits them as one group.
template <class T, Mode kMode, int kWarps, bool kAligned>
__device__ __forceinline__ void load_step(const KernelArgs& a, const Walk& w, int i,
                                          Stage<kMode, kWarps, kAligned>& stage) {
  using S = Stage<kMode, kWarps, kAligned>;
  constexpr int kThreads = 32 * kWarps;
  const int ks = i % w.k_steps, rest = i / w.k_steps;
  const int block = w.first_block + rest % w.blocks, pass = rest / w.blocks;
  const int64_t row_bytes = a.k / 2;
  const int tid = threadIdx.x;
#pragma unroll
  for (int m = 0; m < kMats<kMode>; ++m) {
    const uint8_t* codes = static_cast<const uint8_t*>(m == 0 ? a.w0 : a.w1);
    const uint8_t* scales = m == 0 ? a.s0 : a.s1;
#pragma unroll
    for (int j = 0; j < S::kRows * kStepGroups / kThreads; ++j) {
      const int u = tid + j * kThreads, row = u / kStepGroups, part = u % kStepGroups;
      const int q = ks * kStepGroups + part;
      const bool valid = q < w.groups;
      const int64_t matrix_row =
          static_cast<int64_t>(w.expert) * a.n + min(block * S::kRows + row, a.n - 1);  // clamped
      cp_async_16(smem_u32(&stage.codes[m][row * kCodeStride + part * 16]),
                  codes + matrix_row * row_bytes + (valid ? q : 0) * 16, valid);
      if constexpr (kAligned) {
        if (part == 0) {  // the row's four scale bytes of the step, one aligned word (K has whole steps)
          cp_async_4(smem_u32(&stage.scale_words[m][row]), scales + matrix_row * w.groups + q, true);
        }
      } else {
        // The aligned word by absolute address (a scale tensor may start anywhere).
        const uint8_t* scale = scales + matrix_row * w.groups + (valid ? q : 0);
        cp_async_4(smem_u32(&stage.scale_words[m][row * kStepGroups + part]),
                   reinterpret_cast<const uint8_t*>(reinterpret_cast<uintptr_t>(scale) & ~uintptr_t{3}), valid);
      }
    }
  }
  // The pass's activation rows: 16 rows of 256 bytes (4 groups of 32 values), 16 copies each.
#pragma unroll
  for (int j = 0; j < (kPassRows * 16 + kThreads - 1) / kThreads; ++j) {
    const int u = tid + j * kThreads, r = u / 16, part = u % 16;
    if (r >= kPassRows) break;
    const int idx = pass * kPassRows + r;
    const int q = ks * kStepGroups + part / 4;
    const bool valid = idx < w.rows && q < w.groups;
    const T* src = static_cast<const T*>(a.a);
    if (valid) {
      const int64_t a_row = a.sorted_pairs != nullptr ? a.sorted_pairs[w.first_row + idx] / a.top_k : w.first_row + idx;
      src += a_row * a.k + static_cast<int64_t>(ks) * kStepGroups * 32 + part * 8;
    }
    cp_async_16(smem_u32(&stage.acts[r * kActStride + part * 16]), src, valid);
  }
  cp_async_commit();
}

// The B fragments of group q, n8 tile c: the activation values at the lane's eight columns, permuted as the
// codes' nibble pairs.
struct BFragments {
  uint32_t b00, b01, b10, b11;
};
template <int kStride>
__device__ __forceinline__ BFragments b_fragments(const uint8_t* acts, int c, int q, int g, int t) {
  const uint4 x = *reinterpret_cast<const uint4*>(&acts[(c * 8 + g) * kStride + q * 64 + 16 * t]);
  return {__byte_perm(x.x, x.z, 0x5410), __byte_perm(x.x, x.z, 0x7632), __byte_perm(x.y, x.w, 0x5410),
          __byte_perm(x.y, x.w, 0x7632)};
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

// Stores a warp's outputs of one (pass, block) and clears its accumulators. C fragment: acc[.][c][0..1]
// weight row g, pass rows 8c + 2t and 8c + 2t + 1; acc[.][c][2..3] weight row g + 8.
template <class T, Mode kMode>
__device__ __forceinline__ void store_pass(const KernelArgs& a, const Walk& w, int pass, int first_row_of_tile, int g,
                                           int t, float (&acc)[2][2][4]) {
  T* out = static_cast<T*>(a.out);
#pragma unroll
  for (int c = 0; c < 2; ++c) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int idx = pass * kPassRows + c * 8 + 2 * t + (i & 1);
      const int row = first_row_of_tile + g + (i >= 2 ? 8 : 0);
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

template <class T, Mode kMode, int kWarps, bool kAligned>
__global__ void __launch_bounds__(32 * kWarps, 8 / kWarps * 2) mxfp4_rows_kernel(KernelArgs a, int blocks_per_cta) {
  using S = Stage<kMode, kWarps, kAligned>;
  extern __shared__ __align__(128) uint8_t smem[];
  S* stages = reinterpret_cast<S*>(smem);
  // expert_offsets, sorted_pairs and (down) the act rows come from the kernels before (pdl.cuh).
  pdl_wait();
  pdl_trigger();
  Walk w;
  w.expert = static_cast<int>(blockIdx.y);
  w.first_row = a.expert_offsets[w.expert];
  w.rows = a.expert_offsets[w.expert + 1] - w.first_row;
  const int total_blocks = (a.n + S::kRows - 1) / S::kRows;
  w.first_block = static_cast<int>(blockIdx.x) * blocks_per_cta;
  w.blocks = min(blocks_per_cta, total_blocks - w.first_block);
  if (w.rows <= 0 || w.blocks <= 0) return;
  w.groups = a.k / kMxfp4Group;
  w.k_steps = (w.groups + kStepGroups - 1) / kStepGroups;
  const int steps = w.steps();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  float acc[2][2][4] = {};
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) {
    if (i < steps) {
      load_step<T, kMode, kWarps, kAligned>(a, w, i, stages[i]);
    } else {
      cp_async_commit();
    }
  }
  uint32_t scale_address[2][2] = {};  // compute_step
  for (int i = 0; i < steps; ++i) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    if (i + kStages - 1 < steps) {
      load_step<T, kMode, kWarps, kAligned>(a, w, i + kStages - 1, stages[(i + kStages - 1) % kStages]);
    } else {
      cp_async_commit();
    }
    const int ks = i % w.k_steps, rest = i / w.k_steps;
    const int block = w.first_block + rest % w.blocks, pass = rest / w.blocks;
    if (!kAligned && ks == 0) {
#pragma unroll
      for (int m = 0; m < kMats<kMode>; ++m) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = min(block * S::kRows + warp * 16 + g + 8 * h, a.n - 1);
          const uint8_t* scales = m == 0 ? a.s0 : a.s1;
          scale_address[m][h] = static_cast<uint32_t>(
              reinterpret_cast<uintptr_t>(scales + (static_cast<int64_t>(w.expert) * a.n + row) * w.groups));
        }
      }
    }
    const S& stage = stages[i % kStages];
    if (w.rows - pass * kPassRows > 8) {
      run_step<T, kMode, kWarps, kAligned, 2>(stage, warp, g, t, scale_address, ks, acc);
    } else {
      run_step<T, kMode, kWarps, kAligned, 1>(stage, warp, g, t, scale_address, ks, acc);
    }
    if (ks == w.k_steps - 1) store_pass<T, kMode>(a, w, pass, block * S::kRows + warp * 16, g, t, acc);
  }
  cp_async_wait<0>();
}

template <class T, Mode kMode, int kWarps, bool kAligned>
void launch_rows(const KernelArgs& args, int blocks_per_cta, bool programmatic, cudaStream_t stream) {
  using S = Stage<kMode, kWarps, kAligned>;
  static std::atomic<uint64_t> smem_done{0};
  constexpr int kSmem = kStages * static_cast<int>(sizeof(S));
  auto kernel = mxfp4_rows_kernel<T, kMode, kWarps, kAligned>;
  ensure_smem_limit(reinterpret_cast<const void*>(kernel), kSmem, &smem_done);
  const int total_blocks = (args.n + S::kRows - 1) / S::kRows;
  const dim3 grid((total_blocks + blocks_per_cta - 1) / blocks_per_cta, static_cast<unsigned>(args.num_experts));
  launch_kernel("grouped GEMM (mxfp4_rows)", programmatic, kernel, grid, dim3(32 * kWarps), kSmem, stream, args,
                blocks_per_cta);
}

// Weight blocks (of block_rows rows) a CTA takes for an output of n columns and a reduction of k.
int mxfp4_rows_blocks_per_cta(int n, int k, int block_rows) {
  // At least ~16 pipeline steps a CTA where the blocks allow: a short K (Kimi-K3's down at tp-shard 8 has 3
  // steps a block) would otherwise spend most of each CTA filling and draining its ring.
  const int k_steps = (k / kMxfp4Group + kStepGroups - 1) / kStepGroups;
  const int total_blocks = (n + block_rows - 1) / block_rows;
  return std::clamp((16 + k_steps - 1) / k_steps, 1, total_blocks);
}

template <class T, Mode kMode>
void launch_shape(const KernelArgs& args, int warps, bool aligned, bool programmatic, cudaStream_t stream) {
  const int block_rows = 16 * warps;
  const int blocks_per_cta = mxfp4_rows_blocks_per_cta(args.n, args.k, block_rows);
  if (warps == 8) {
    aligned ? launch_rows<T, kMode, 8, true>(args, blocks_per_cta, programmatic, stream)
            : launch_rows<T, kMode, 8, false>(args, blocks_per_cta, programmatic, stream);
  } else {
    aligned ? launch_rows<T, kMode, 4, true>(args, blocks_per_cta, programmatic, stream)
            : launch_rows<T, kMode, 4, false>(args, blocks_per_cta, programmatic, stream);
  }
}

template <class T>
void launch_mode(Mode mode, const KernelArgs& args, int warps, bool aligned, bool programmatic, cudaStream_t stream) {
  switch (mode) {
    case Mode::gated:
      launch_shape<T, Mode::gated>(args, warps, aligned, programmatic, stream);
      return;
    case Mode::relu2:
      launch_shape<T, Mode::relu2>(args, warps, aligned, programmatic, stream);
      return;
    case Mode::plain:
      launch_shape<T, Mode::plain>(args, warps, aligned, programmatic, stream);
      return;
  }
}

bool aligned4(const void* p) { return p == nullptr || (reinterpret_cast<uintptr_t>(p) & 3) == 0; }

}  // namespace

void launch_mxfp4_rows(DType dtype, Mode mode, const KernelArgs& args, int cta_blocks, bool programmatic,
                       cudaStream_t stream) {
  LATENTMOE_CHECK(args.s0 != nullptr && (mode != Mode::gated || args.s1 != nullptr),
                  "grouped GEMM: the mxfp4_rows variant takes MXFP4 weights only");
  LATENTMOE_CHECK(dtype == DType::bf16 || dtype == DType::f16,
                  "grouped GEMM: the mxfp4_rows variant takes bf16 or f16 "
                  "activations, not ",
                  dtype_name(dtype));
  LATENTMOE_CHECK(args.k % kMxfp4Group == 0 && args.n > 0, "grouped GEMM: mxfp4_rows needs K a multiple of ",
                  kMxfp4Group, " (K ", args.k, ", N ", args.n, ")");
  LATENTMOE_CHECK(cta_blocks >= 0 && cta_blocks <= 2,
                  "grouped GEMM: mxfp4_rows takes 1 or 2 blocks of 64 weight rows "
                  "a CTA (0: its choice), not ",
                  cta_blocks);
  // 4 warps unless asked for 8: on an H100 (9bbd3be, grouped_gemm_bench, kimi-k3 tp-shard 8, gate/up + down)
  // the 64-row CTAs (3 per SM) took 788 µs at 64 tokens and 1167 at 256 against 891 and 1320 for the
  // 128-row ones (2 per SM), 12-16% faster at every count from 8 to 256.
  const int warps = cta_blocks == 2 ? 8 : 4;
  const bool aligned = args.k % (kStepGroups * kMxfp4Group) == 0 && aligned4(args.s0) && aligned4(args.s1);
  if (dtype == DType::bf16) {
    launch_mode<__nv_bfloat16>(mode, args, warps, aligned, programmatic, stream);
  } else {
    launch_mode<__half>(mode, args, warps, aligned, programmatic, stream);
  }
}

}  // namespace latentmoe::cuda::gg

// The grouped GEMM variant `mxfp4_rows` (grouped_gemm.h): MXFP4 expert weights decoded straight into
// mma.sync A fragments, for experts that hold few rows each (decode batches from 9 tokens to a few
// hundred). Each expert's weights are read once per pass of up to kPassRows of its rows, however many
// tokens chose it (the decode kernels of mxfp4_decode_mma.cu take at most 8 tokens, and above that
// ran in batches of 8, each reading the weights again).
//
// Why a ring: the decode kernels load their codes into registers, so the bytes in flight per SM are
// bounded by registers and occupancy (they reach 23-48% of the byte floor, docs/MXFP4.md). Here each
// CTA streams the codes, the scale words and its expert's activation rows through a cp.async ring of
// kStages steps in shared memory (one step = 4 scale groups = 128 columns of K), several steps ahead of
// the warps that decode and multiply.
//
// Work: CTA (x, e) owns expert e's 64-row weight blocks [x * blocks_per_cta, ...) and walks the steps
// (pass, block, k-step) in that order through one pipeline; after a block's last k-step its warps store
// that pass's outputs and clear their accumulators.
//   warp w: rows 16 w .. 16 w + 15 of the block; lane (g, t) holds rows g and g + 8 (the A fragment) and,
//   per n8 tile c of the pass, the expert's row 8 c + g (the B fragment, at the same k slots).
// k order: as mxfp4_decode_mma.cu: per scale group two MMAs; lane t takes code bytes 4t..4t+3 of the group
//   for its rows (nibbles i and i + 4 form one register, e2m1_pair) and the activation values at the same
//   eight columns, permuted the same way. Each group's MMAs start from zero, and their fp32 result is
//   multiplied by the row's scale (an exact power of two) and added to the accumulators.
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

#include "cuda/common/convert.cuh"
#include "cuda/common/mma.cuh"
#include "cuda/common/pdl.cuh"
#include "cuda/gemm/grouped_gemm_launch.cuh"
#include "cuda/gemm/grouped_gemm_mma.cuh"
#include "cuda/gemm/mxfp4_device.cuh"
#include "latentmoe/error.h"

namespace latentmoe::cuda::gg {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kBlockRows = 16 * kWarps;  // weight rows per block
constexpr int kStepGroups = 4;           // scale groups per pipeline step
constexpr int kStages = 4;
constexpr int kPassRows = 16;  // expert rows per pass: two n8 tiles
// Shared-memory row strides, padded so that the fragment reads are free of bank conflicts: a code row
// of a step is 64 bytes (+16: the 8 rows g of a warp's LDS.32 fall on 8 distinct 4-bank sets), an
// activation row 256 bytes (+64: rows g and g + 1, which share a phase of an LDS.128, use opposite halves).
constexpr int kCodeStride = kStepGroups * 16 + 16;
constexpr int kActStride = kStepGroups * 64 + 64;

template <Mode kMode>
constexpr int kMats = kMode == Mode::gated ? 2 : 1;

template <Mode kMode>
struct Stage {
  uint8_t codes[kMats<kMode>][kBlockRows * kCodeStride];
  // Per (row, group) the aligned 4-byte word holding the group's scale byte.
  uint32_t scale_words[kMats<kMode>][kBlockRows * kStepGroups];
  uint8_t acts[kPassRows * kActStride];
};

template <Mode kMode>
constexpr int stage_bytes() {
  return static_cast<int>(sizeof(Stage<kMode>));
}

__device__ __forceinline__ uint32_t lds_u32(const void* p) { return *static_cast<const uint32_t*>(p); }

// The CTA's place in the work and the pipeline's step arithmetic.
struct Walk {
  int expert, first_row;  // the expert's first grouped row
  int rows;               // the expert's rows
  int first_block, blocks, k_steps, groups;
  __device__ int steps() const { return ((rows + kPassRows - 1) / kPassRows) * blocks * k_steps; }
};

// Issues the copies of step `i` into `stage` (every thread, its share) and commits them as one group.
template <class T, Mode kMode>
__device__ __forceinline__ void load_step(const KernelArgs& a, const Walk& w, int i, Stage<kMode>& stage) {
  const int ks = i % w.k_steps, rest = i / w.k_steps;
  const int block = w.first_block + rest % w.blocks, pass = rest / w.blocks;
  const int64_t row_bytes = a.k / 2;
  const int tid = threadIdx.x;
#pragma unroll
  for (int m = 0; m < kMats<kMode>; ++m) {
    const uint8_t* codes = static_cast<const uint8_t*>(m == 0 ? a.w0 : a.w1);
    const uint8_t* scales = m == 0 ? a.s0 : a.s1;
#pragma unroll
    for (int j = 0; j < kBlockRows * kStepGroups / kThreads; ++j) {
      const int u = tid + j * kThreads, row = u / kStepGroups, part = u % kStepGroups;
      const int q = ks * kStepGroups + part;
      const bool valid = q < w.groups;
      const int64_t matrix_row =
          static_cast<int64_t>(w.expert) * a.n + min(block * kBlockRows + row, a.n - 1);  // clamped
      cp_async_16(smem_u32(&stage.codes[m][row * kCodeStride + part * 16]),
                  codes + matrix_row * row_bytes + (valid ? q : 0) * 16, valid);
      // The aligned word by absolute address (a scale tensor may start anywhere).
      const uint8_t* scale = scales + matrix_row * w.groups + (valid ? q : 0);
      cp_async_4(smem_u32(&stage.scale_words[m][row * kStepGroups + part]),
                 reinterpret_cast<const uint8_t*>(reinterpret_cast<uintptr_t>(scale) & ~uintptr_t{3}), valid);
    }
  }
  // The pass's activation rows: 16 rows of 256 bytes (4 groups of 32 values), 16 copies each.
#pragma unroll
  for (int j = 0; j < kPassRows * 16 / kThreads; ++j) {
    const int u = tid + j * kThreads, r = u / 16, part = u % 16;
    const int idx = pass * kPassRows + r;
    const int q = ks * kStepGroups + part / 4;
    const bool valid = idx < w.rows && q < w.groups;
    const T* src = static_cast<const T*>(a.a);
    if (valid) {
      const int64_t a_row =
          a.sorted_pairs != nullptr ? a.sorted_pairs[w.first_row + idx] / a.top_k : w.first_row + idx;
      src += a_row * a.k + static_cast<int64_t>(ks) * kStepGroups * 32 + part * 8;
    }
    cp_async_16(smem_u32(&stage.acts[r * kActStride + part * 16]), src, valid);
  }
  cp_async_commit();
}

// One step's MMAs for a warp: kTiles n8 tiles of the pass.
// scale_address[m][h]: the low bits of the address of group 0's scale byte of matrix m, row g + 8 h of the
// warp's tile (the byte's place in its aligned word).
template <class T, Mode kMode, int kTiles>
__device__ __forceinline__ void compute_step(const Stage<kMode>& stage, int warp, int g, int t,
                                             const uint32_t (&scale_address)[2][2], int ks, float (&acc)[2][2][4]) {
  const int row_lo = warp * 16 + g, row_hi = row_lo + 8;
#pragma unroll
  for (int q = 0; q < kStepGroups; ++q) {
    uint32_t lo[2], hi[2];
    float scale_lo[2], scale_hi[2];
#pragma unroll
    for (int m = 0; m < kMats<kMode>; ++m) {
      const uint32_t shift_lo = ((scale_address[m][0] + ks * kStepGroups + q) & 3u) * 8u;
      const uint32_t shift_hi = ((scale_address[m][1] + ks * kStepGroups + q) & 3u) * 8u;
      lo[m] = lds_u32(&stage.codes[m][row_lo * kCodeStride + q * 16 + 4 * t]);
      hi[m] = lds_u32(&stage.codes[m][row_hi * kCodeStride + q * 16 + 4 * t]);
      scale_lo[m] = e8m0_scale((stage.scale_words[m][row_lo * kStepGroups + q] >> shift_lo) & 0xFFu);
      scale_hi[m] = e8m0_scale((stage.scale_words[m][row_hi * kStepGroups + q] >> shift_hi) & 0xFFu);
    }
#pragma unroll
    for (int c = 0; c < kTiles; ++c) {
      const uint4 x = *reinterpret_cast<const uint4*>(&stage.acts[(c * 8 + g) * kActStride + q * 64 + 16 * t]);
      const uint32_t b00 = __byte_perm(x.x, x.z, 0x5410), b01 = __byte_perm(x.x, x.z, 0x7632);
      const uint32_t b10 = __byte_perm(x.y, x.w, 0x5410), b11 = __byte_perm(x.y, x.w, 0x7632);
#pragma unroll
      for (int m = 0; m < kMats<kMode>; ++m) {
        float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        mma_16x8x16<T>(d, e2m1_pair<T, 0>(lo[m]), e2m1_pair<T, 0>(hi[m]), e2m1_pair<T, 1>(lo[m]),
                       e2m1_pair<T, 1>(hi[m]), b00, b01);
        mma_16x8x16<T>(d, e2m1_pair<T, 2>(lo[m]), e2m1_pair<T, 2>(hi[m]), e2m1_pair<T, 3>(lo[m]),
                       e2m1_pair<T, 3>(hi[m]), b10, b11);
        acc[m][c][0] = fmaf(d[0], scale_lo[m], acc[m][c][0]);
        acc[m][c][1] = fmaf(d[1], scale_lo[m], acc[m][c][1]);
        acc[m][c][2] = fmaf(d[2], scale_hi[m], acc[m][c][2]);
        acc[m][c][3] = fmaf(d[3], scale_hi[m], acc[m][c][3]);
      }
    }
  }
}

// Stores a warp's outputs of one (pass, block) and clears its accumulators. C fragment: acc[.][c][0..1]
// weight row g, pass rows 8c + 2t and 8c + 2t + 1; acc[.][c][2..3] weight row g + 8.
template <class T, Mode kMode>
__device__ __forceinline__ void store_pass(const KernelArgs& a, const Walk& w, int pass, int block, int warp, int g,
                                           int t, float (&acc)[2][2][4]) {
  T* out = static_cast<T*>(a.out);
#pragma unroll
  for (int c = 0; c < 2; ++c) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int idx = pass * kPassRows + c * 8 + 2 * t + (i & 1);
      const int row = block * kBlockRows + warp * 16 + g + (i >= 2 ? 8 : 0);
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

template <class T, Mode kMode>
__global__ void __launch_bounds__(kThreads, 4) mxfp4_rows_kernel(KernelArgs a, int blocks_per_cta) {
  extern __shared__ __align__(128) uint8_t smem[];
  Stage<kMode>* stages = reinterpret_cast<Stage<kMode>*>(smem);
  // expert_offsets, sorted_pairs and (down) the act rows come from the kernels before (pdl.cuh).
  pdl_wait();
  pdl_trigger();
  Walk w;
  w.expert = static_cast<int>(blockIdx.y);
  w.first_row = a.expert_offsets[w.expert];
  w.rows = a.expert_offsets[w.expert + 1] - w.first_row;
  const int total_blocks = (a.n + kBlockRows - 1) / kBlockRows;
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
      load_step<T, kMode>(a, w, i, stages[i]);
    } else {
      cp_async_commit();
    }
  }
  uint32_t scale_address[2][2] = {};  // compute_step
  for (int i = 0; i < steps; ++i) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    if (i + kStages - 1 < steps) {
      load_step<T, kMode>(a, w, i + kStages - 1, stages[(i + kStages - 1) % kStages]);
    } else {
      cp_async_commit();
    }
    const int ks = i % w.k_steps, rest = i / w.k_steps;
    const int block = w.first_block + rest % w.blocks, pass = rest / w.blocks;
    if (ks == 0) {
#pragma unroll
      for (int m = 0; m < kMats<kMode>; ++m) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = min(block * kBlockRows + warp * 16 + g + 8 * h, a.n - 1);
          const uint8_t* scales = m == 0 ? a.s0 : a.s1;
          scale_address[m][h] = static_cast<uint32_t>(
              reinterpret_cast<uintptr_t>(scales + (static_cast<int64_t>(w.expert) * a.n + row) * w.groups));
        }
      }
    }
    const Stage<kMode>& stage = stages[i % kStages];
    if (w.rows - pass * kPassRows > 8) {
      compute_step<T, kMode, 2>(stage, warp, g, t, scale_address, ks, acc);
    } else {
      compute_step<T, kMode, 1>(stage, warp, g, t, scale_address, ks, acc);
    }
    if (ks == w.k_steps - 1) store_pass<T, kMode>(a, w, pass, block, warp, g, t, acc);
  }
  cp_async_wait<0>();
}

template <class T, Mode kMode>
void launch_rows(const KernelArgs& args, int blocks_per_cta, bool programmatic, cudaStream_t stream) {
  static std::atomic<uint64_t> smem_done{0};
  constexpr int kSmem = kStages * stage_bytes<kMode>();
  auto kernel = mxfp4_rows_kernel<T, kMode>;
  ensure_smem_limit(reinterpret_cast<const void*>(kernel), kSmem, &smem_done);
  const int total_blocks = (args.n + kBlockRows - 1) / kBlockRows;
  const dim3 grid((total_blocks + blocks_per_cta - 1) / blocks_per_cta, static_cast<unsigned>(args.num_experts));
  launch_kernel("grouped GEMM (mxfp4_rows)", programmatic, kernel, grid, dim3(kThreads), kSmem, stream, args,
                blocks_per_cta);
}

template <class T>
void launch_mode(Mode mode, const KernelArgs& args, int blocks_per_cta, bool programmatic, cudaStream_t stream) {
  switch (mode) {
    case Mode::gated:
      launch_rows<T, Mode::gated>(args, blocks_per_cta, programmatic, stream);
      return;
    case Mode::relu2:
      launch_rows<T, Mode::relu2>(args, blocks_per_cta, programmatic, stream);
      return;
    case Mode::plain:
      launch_rows<T, Mode::plain>(args, blocks_per_cta, programmatic, stream);
      return;
  }
}

}  // namespace

int mxfp4_rows_blocks_per_cta(int n, int k) {
  // At least ~16 pipeline steps a CTA where the blocks allow: a short K (Kimi-K3's down at tp-shard 8 has 3
  // steps a block) would otherwise spend most of each CTA filling and draining its ring.
  const int k_steps = (k / kMxfp4Group + kStepGroups - 1) / kStepGroups;
  const int total_blocks = (n + kBlockRows - 1) / kBlockRows;
  return std::clamp((16 + k_steps - 1) / k_steps, 1, total_blocks);
}

void launch_mxfp4_rows(DType dtype, Mode mode, const KernelArgs& args, bool programmatic, cudaStream_t stream) {
  LATENTMOE_CHECK(args.s0 != nullptr && (mode != Mode::gated || args.s1 != nullptr),
                  "grouped GEMM: the mxfp4_rows variant takes MXFP4 weights only");
  LATENTMOE_CHECK(dtype == DType::bf16 || dtype == DType::f16, "grouped GEMM: the mxfp4_rows variant takes bf16 or f16 "
                  "activations, not ", dtype_name(dtype));
  LATENTMOE_CHECK(args.k % kMxfp4Group == 0 && args.n > 0, "grouped GEMM: mxfp4_rows needs K a multiple of ",
                  kMxfp4Group, " (K ", args.k, ", N ", args.n, ")");
  const int blocks_per_cta = mxfp4_rows_blocks_per_cta(args.n, args.k);
  if (dtype == DType::bf16) {
    launch_mode<__nv_bfloat16>(mode, args, blocks_per_cta, programmatic, stream);
  } else {
    launch_mode<__half>(mode, args, blocks_per_cta, programmatic, stream);
  }
}

}  // namespace latentmoe::cuda::gg

// The Hopper grouped GEMM (sm_90a): warpgroup MMA (wgmma) with the operands swapped. The weights are the
// MMA's M side (64-row blocks) and the expert's rows its N side, N = the tile's rows rounded up to 8: a
// 73-row expert pads to 80, not to 128, and one CTA reads the expert's rows once for all its weight rows.
//
// Three shapes (WgmmaConfig), the same code:
//   WgmmaCfg      tiles of up to 96 rows of one expert against 256 weight rows: two warpgroups, each two
//                 m64 blocks (48 accumulators per block and thread). For experts of up to 96 rows.
//   WgmmaTallCfg  tiles of up to 256 rows against 128 weight rows: two warpgroups, each one m64 block (128
//                 accumulators). For experts of more than 96 rows, which the first shape would split into
//                 several tiles that each read all of the expert's weights again.
//   WgmmaNarrowCfg tiles of up to 96 rows against 128 weight rows (one m64 block per warpgroup), 3 stages,
//                 two CTAs per SM: one CTA's waits, barriers and MXFP4 decode overlap the other's wgmmas.
//                 MXFP4's choice on Hopper (3-8% faster than WgmmaCfg there); bf16 keeps WgmmaCfg.
// Gated mode pairs every gate row with the up row of the same output column inside one thread, so the
// activation is applied in registers: with two blocks per warpgroup, block 0 holds 64 gate rows and block 1
// the 64 up rows of the same columns; with one block, its rows alternate in groups of 8 (rows 16q..16q+7
// gate, 16q+8..16q+15 up, of the same 8 columns), which the m64 accumulator layout gives to the same thread
// (its two rows are r and r + 8). relu2/plain: consecutive weight rows.
// A tile is found by find_tile as in the mma.sync kernel. One CTA computes one tile against
// args.n_tiles_per_cta consecutive n-tiles as one pipeline over (n-tile, k-step) steps, so the tile look-up
// and the pipeline fill are paid once. The grid is 1-D, n-tile groups fastest, sized from the host's row
// bound; CTAs without a tile exit.
//
// Pipeline. kStages shared-memory stages of [weight rows][64 k] and [kBlockM rows][64 k], 128-byte rows
// in the canonical 128B-swizzle layout (16-byte chunk c of row r at r*128 + ((c ^ (r & 7)) * 16), 1024-byte
// aligned 8-row atoms: what the wgmma descriptors below describe). Every thread copies (cp.async, the
// weights evict-first in L2 with 256-byte fetches, or normal where an expert's rows span several tiles:
// weight_policy_for; the rows gathered through sorted_pairs, zero-filled past the edges) and every warpgroup computes.
// Per step: wait for the step's copies, fence.proxy.async (the copies are generic-proxy writes, wgmma reads through the
// async proxy), barrier; issue the step's wgmmas; wait for the previous step's (wgmma.wait_group 1), barrier; then the
// copies of step + kStages - 1 go into the stage the previous step read, while this step's wgmmas run.
//
// N is a compile-time constant of the instruction: the warpgroups dispatch (CTA-uniform) among
// m64n{8..kBlockM}k16. The epilogue pairs lanes (shfl.xor 4) so that each thread stores two consecutive
// output columns of one row (4 bytes), and skips the padded rows.
//
// MXFP4 weights (kMxfp4; docs/MXFP4.md): the weight tile is decoded, not copied. A thread owns whole
// scale groups of each step's weight tile (16 code bytes: 32 values of one weight row, and the aligned
// 4-byte word holding the group's scale byte) and copies them raw with cp.async into a per-thread ring
// of kStages stages, kStages - 1 steps ahead as the bf16 weights go. The wgmmas read a double-buffered
// bf16 tile in the same swizzled layout: at the end of step s, after the barrier that follows
// wgmma.wait_group 1 (every warpgroup is done with step s - 1, the last reader of buffer (s + 1) % 2), each
// thread waits for its own copies of step s + 1 and decodes them there (mxfp4_decode8), while step s's
// wgmmas run; the fence.proxy.async and barrier at the top of step s + 1 publish the tile to the wgmmas.
// The decode of step 0 closes the prologue. Nobody reads another thread's raw groups: no barrier there.
//
// Programmatic dependent launch as in the mma.sync kernel (src/cuda/common/pdl.cuh): unless the tiles come from
// the kernel just before, the first weight stages stream before the wait, and the rows are read and the
// outputs written only after it.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "cuda/common/pdl.cuh"
#include "cuda/gemm/grouped_gemm_common.cuh"
#include "cuda/gemm/grouped_gemm_launch.cuh"
#include "cuda/gemm/grouped_gemm_mma.cuh"           // cp.async copies, the L2 policy, pack2
#include "cuda/gemm/grouped_gemm_wgmma_launch.cuh"  // WgmmaShape
#include "cuda/gemm/grouped_gemm_wgmma_ops.cuh"
#include "cuda/gemm/mxfp4_device.cuh"
#include "latentmoe/error.h"

namespace latentmoe::cuda::gg {

template <int kBlockM_, int kStages_, int kBlocksPerWg_, int kMinBlocks_ = 1>
struct WgmmaConfig {
  static constexpr int kWarpGroups = 2;
  static constexpr int kMinBlocks = kMinBlocks_;  // CTAs per SM the registers and shared memory must allow
  static constexpr int kThreads = kWarpGroups * 128;
  static constexpr int kBlocksPerWg = kBlocksPerWg_;                   // m64 weight blocks per warpgroup
  static constexpr int kWeightRows = kWarpGroups * 64 * kBlocksPerWg;  // weight rows per n-tile
  static constexpr int kBlockM = kBlockM_;                             // expert rows per tile (the MMA's N, at most)
  static constexpr int kAcc = kBlockM / 2;                             // fp32 accumulators per thread and m64 block
  static constexpr int kBlockK = 64;  // one 128-byte swizzled row per weight or expert row
  static constexpr int kStages = kStages_;
  static constexpr int kRowBytes = kBlockK * 2;
  static constexpr int kWeightBytes = kWeightRows * kRowBytes;  // weight tile of one stage
  static constexpr int kStageBytes = kWeightBytes + kBlockM * kRowBytes;
  static constexpr int kSmemBytes = kStages * kStageBytes + 1024;  // + slack to align the stages to 1024
  // MXFP4 weights: the double-buffered decoded weight tile, the row stages, and the raw ring (per scale
  // group of 32 values 16 code bytes and a 4-byte scale word; two groups per weight row and step).
  static constexpr int kRawUnits = kWeightRows * kBlockK / 32;
  static constexpr int kRowStageBytes = kBlockM * kRowBytes;
  static constexpr int kSmemBytesMxfp4 = 2 * kWeightBytes + kStages * kRowStageBytes + kStages * kRawUnits * 20 + 1024;
  static_assert(kRowStageBytes % 1024 == 0, "row stages must keep the 1024-byte alignment of the swizzle atoms");
  static_assert(kStageBytes % 1024 == 0, "stages must keep the 1024-byte alignment of the swizzle atoms");
  static_assert(kBlockM <= kWgmmaMaxN && kBlockM % 32 == 0, "rows per tile: at most the largest N, whole copy rounds");
  static_assert(kBlocksPerWg == 1 || kBlocksPerWg == 2, "one or two m64 blocks per warpgroup");
};

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Shared-memory matrix descriptor of a K-major operand with 128-byte rows in the 128B swizzle: start
// address >> 4 (bits 0-13), leading byte offset unused for swizzled K-major (1, bits 16-29), stride byte
// offset 1024 >> 4 between 8-row atoms (bits 32-45), base offset 0 (atoms 1024-aligned), swizzle mode 1
// = 128B (bits 62-63). Moving 16 elements along k adds 32 bytes, i.e. 2, to the address field.
__device__ __forceinline__ uint64_t sw128_desc(uint32_t smem_addr) {
  return static_cast<uint64_t>((smem_addr & 0x3FFFFu) >> 4) | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_one() { asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); }
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Keeps the compiler from moving accumulator reads or writes across the wgmma issue/wait points.
template <int B, int A>
__device__ __forceinline__ void fence_accumulators(float (&acc)[B][A]) {
#pragma unroll
  for (int b = 0; b < B; ++b) {
#pragma unroll
    for (int i = 0; i < A; ++i) asm volatile("" : "+f"(acc[b][i])::"memory");
  }
}

// One stage (64 of k) of one warpgroup: four k16 steps on each of its m64 blocks, committed by the caller.
// N beyond the tile shape's kBlockM is never dispatched (the switch below); the `if constexpr` only keeps
// those cases from being compiled.
template <class T, int N, int B, int A>
__device__ __forceinline__ void wgmma_stage(float (&acc)[B][A], const uint64_t (&desc_w)[B], uint64_t desc_x,
                                            int accumulate) {
  if constexpr (N / 2 <= A) {
    wgmma_fence();  // orders the epilogue's accumulator reads before these writes
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const int scale_d = kk == 0 ? accumulate : 1;
#pragma unroll
      for (int b = 0; b < B; ++b) wgmma_m64k16<T, N>(acc[b], desc_w[b] + 2 * kk, desc_x + 2 * kk, scale_d);
    }
  }
}

// The epilogue of one warpgroup's accumulators (this kernel and grouped_gemm_wgmma_ws.cuh): acc[b] is m64 block b
// of the warpgroup, whose output columns start at wg_col (gated with two blocks: block 0 the gate rows and block 1
// the up rows of 64 columns; gated with one block: rows 16q..16q+7 gate and 16q+8..16q+15 up of 8 columns;
// otherwise 64 consecutive columns per block); the tile's expert rows are row_begin + [0, rows), N = mma_n.
// Accumulator i of an m64 block: weight row 16*wq + lane/4 + 8*((i >> 1) & 1) of the block, expert row
// 8*(i >> 2) + 2*(lane % 4) + (i & 1) of the tile. Lanes l and l^4 hold adjacent weight rows (adjacent
// output columns) of the same two expert rows: they swap one value so that each stores a column pair.
// Rows past `rows` and columns past args.n are not stored. Every lane of the warp must call it.
template <class T, Mode kMode, int kBlocks, int kAcc>
__device__ __forceinline__ void wgmma_store_tile(const float (&acc)[kBlocks][kAcc], const KernelArgs& args, T* out,
                                                 int row_begin, int rows, int mma_n, int wg_col, int wq, int lane) {
  constexpr bool kGated = kMode == Mode::gated;
  const int n = args.n;
  const int lane_row = lane >> 2;
  const bool odd = lane_row & 1;
  auto store_pair = [&](float v0, float v1, int col, int t0) {
    const float recv = __shfl_xor_sync(0xffffffffu, odd ? v0 : v1, 4);
    const int t = t0 + (odd ? 1 : 0);
    const int c = odd ? col - 1 : col;
    if (t < rows && c < n) {  // n is a multiple of 8 on this path, so c + 1 < n too
      *reinterpret_cast<uint32_t*>(out + static_cast<size_t>(row_begin + t) * n + c) =
          odd ? pack2<T>(recv, v1) : pack2<T>(v0, recv);
    }
  };
#pragma unroll
  for (int j = 0; j < kAcc / 4; ++j) {
    if (8 * j >= mma_n) continue;  // CTA-uniform
    const int t0 = 8 * j + 2 * (lane & 3);
    if constexpr (kGated && kBlocks == 2) {
      // Block 0 gate, block 1 up, rows r and r + 8 of each.
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int i0 = 4 * j + 2 * h;
        store_pair(gated_act<true>(acc[0][i0], acc[1][i0], args), gated_act<true>(acc[0][i0 + 1], acc[1][i0 + 1], args),
                   wg_col + wq * 16 + lane_row + 8 * h, t0);
      }
    } else if constexpr (kGated) {
      // Row r (gate) and row r + 8 (up) of the one block: accumulators 4j + {0, 1} and 4j + {2, 3}.
      const int i0 = 4 * j;
      store_pair(gated_act<true>(acc[0][i0], acc[0][i0 + 2], args),
                 gated_act<true>(acc[0][i0 + 1], acc[0][i0 + 3], args), wg_col + wq * 8 + lane_row, t0);
    } else {
      constexpr bool relu2 = kMode == Mode::relu2;
#pragma unroll
      for (int b = 0; b < kBlocks; ++b) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int i0 = 4 * j + 2 * h;
          const float v0 = relu2 ? act::relu2(acc[b][i0]) : acc[b][i0];
          const float v1 = relu2 ? act::relu2(acc[b][i0 + 1]) : acc[b][i0 + 1];
          store_pair(v0, v1, wg_col + b * 64 + wq * 16 + lane_row + 8 * h, t0);
        }
      }
    }
  }
}

#endif

// Tile row r of n-tile nt of a wgmma tile of kBlocks m64 blocks per warpgroup: its output column, and whether it
// is an up row (gated). Gated, two blocks: tile rows [128 g, 128 g + 64) are the gate rows of output columns
// nt * kOutPerTile + 64 g + [0, 64), the next 64 the up rows of the same columns. Gated, one block: block g
// (rows [64 g, 64 g + 64)) holds columns nt * kOutPerTile + 32 g + [0, 32), its rows 16 q + j (j < 8) the gate
// rows of column 8 q + j, rows 16 q + 8 + j the up rows of the same column (the accumulator rows r and r + 8 of
// one thread). Otherwise consecutive rows. Shared with the warp-specialised kernel (grouped_gemm_wgmma_ws.cuh).
template <bool kGated, int kBlocks, int kOutPerTile>
__host__ __device__ __forceinline__ int wgmma_weight_row(int nt, int r, bool* up) {
  *up = false;
  if constexpr (kGated && kBlocks == 2) {
    *up = (r >> 6) & 1;
    return nt * kOutPerTile + (r >> 7) * 64 + (r & 63);
  } else if constexpr (kGated) {
    const int rr = r & 63;
    *up = (rr >> 3) & 1;
    return nt * kOutPerTile + (r >> 6) * 32 + ((rr >> 4) << 3) + (rr & 7);
  } else {
    return nt * kOutPerTile + r;
  }
}

template <class T, class Cfg, Mode kMode, bool kMxfp4 = false>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocks) grouped_wgmma_kernel(const KernelArgs args) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kThreads = Cfg::kThreads;
  constexpr int kStages = Cfg::kStages;
  constexpr int kBK = Cfg::kBlockK;
  constexpr int kRowBytes = Cfg::kRowBytes;
  constexpr bool kGated = kMode == Mode::gated;
  constexpr int kOutPerTile = kGated ? Cfg::kWeightRows / 2 : Cfg::kWeightRows;  // output columns per n-tile
  constexpr int kOutPerWg = kOutPerTile / Cfg::kWarpGroups;
  constexpr int kBlocks = Cfg::kBlocksPerWg;
  constexpr int kAcc = Cfg::kAcc;
  constexpr int kChunks = kBK / 8;                      // 16-byte chunks per row
  constexpr int kRowStep = kThreads / kChunks;          // rows between one thread's copies
  constexpr int kWIters = Cfg::kWeightRows / kRowStep;  // weight copies per thread and stage
  constexpr int kXIters = Cfg::kBlockM / kRowStep;      // row copies per thread and stage (at most)
  static_assert(kRowStep % 8 == 0, "a thread's rows must share their swizzle phase");

  extern __shared__ unsigned char smem_raw[];
  __shared__ TileInfo s_tile;
  __shared__ int s_scan[kThreads / 32];

  // Programmatic dependent launch (src/cuda/common/pdl.cuh), as in the mma.sync kernel: a kernel whose tiles
  // come from the kernel just before it waits before it looks them up; otherwise the tile look-up and the
  // first weight stages run before the wait. Every CTA waits before it exits, and triggers the next
  // kernel only after its own wait.
  if (args.wait_before_tile) {
    pdl_wait();
    if (args.trigger_dependents) pdl_trigger();
  }

  const int groups = args.n_groups;
  const int entry = blockIdx.x / groups;
  const int group = blockIdx.x - entry * groups;
  if (!find_tile<kThreads>(args.expert_offsets, args.num_experts, Cfg::kBlockM, entry, &s_tile, s_scan)) {
    pdl_wait();
    return;
  }

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int wg = warp >> 2;  // warpgroup
  const int wq = warp & 3;   // warp in the warpgroup: rows 16*wq.. of each m64 block
  const int expert = s_tile.expert;
  const int row_begin = s_tile.row_begin;
  const int rows = s_tile.row_end - row_begin;
  const int mma_n = (rows + 7) & ~7;  // the MMA's N
  const int n = args.n;
  const int k = args.k;
  const int nt_first = group * args.n_tiles_per_cta;
  const int nt_count = min(args.n_tiles_per_cta, args.n_tiles - nt_first);
  const int num_k_steps = (k + kBK - 1) / kBK;
  const int num_steps = nt_count * num_k_steps;

  const T* a_base = static_cast<const T*>(args.a);
  const size_t expert_stride = static_cast<size_t>(n) * k;
  const T* w0 = static_cast<const T*>(args.w0) + expert * expert_stride;
  const T* w1 = kGated ? static_cast<const T*>(args.w1) + expert * expert_stride : w0;

  // Shared memory. bf16 weights: kStages stages of [weight tile][row tile]. MXFP4: the two decoded
  // weight tiles, the kStages row tiles, then the raw ring.
  const uint32_t smem_base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  unsigned char* const smem_aligned = smem_raw + (smem_base - smem_u32(smem_raw));
  auto weight_tile = [&](int step) {
    return kMxfp4 ? smem_base + (step % 2) * Cfg::kWeightBytes : smem_base + (step % kStages) * Cfg::kStageBytes;
  };
  auto row_tile = [&](int stage) {
    return kMxfp4 ? smem_base + 2 * Cfg::kWeightBytes + stage * Cfg::kRowStageBytes
                  : smem_base + stage * Cfg::kStageBytes + Cfg::kWeightBytes;
  };
  // This thread copies chunk `chunk` of tile rows row0, row0 + kRowStep, ...: all congruent mod 8, so one
  // swizzled offset serves every copy of the thread.
  const int chunk = tid % kChunks;
  const int row0 = tid / kChunks;
  const uint32_t copy_offset = row0 * kRowBytes + ((chunk ^ (row0 & 7)) << 4);
  const uint64_t weight_policy = weight_policy_for(s_tile.expert_rows, Cfg::kBlockM);

  // Tile row r of n-tile nt: its output column, and whether it is an up row (gated).
  auto weight_row = [&](int nt, int r, bool* up) { return wgmma_weight_row<kGated, kBlocks, kOutPerTile>(nt, r, up); };

  auto load_weights = [&](int stage, int step) {
    const int nt = nt_first + step / num_k_steps;
    const int kc = (step % num_k_steps) * kBK + chunk * 8;
    const bool k_ok = kc < k;
    const uint32_t dst = smem_base + stage * Cfg::kStageBytes + copy_offset;
#pragma unroll
    for (int i = 0; i < kWIters; ++i) {
      bool up;
      const int col = weight_row(nt, row0 + i * kRowStep, &up);
      const bool ok = k_ok && col < n;
      cp_async_16_stream(dst + i * kRowStep * kRowBytes, ok ? (up ? w1 : w0) + static_cast<size_t>(col) * k + kc : w0,
                         ok, weight_policy);
    }
  };

  // MXFP4 (the file comment): unit u = tid + i * kThreads of a step is scale group u % 2 of tile row u / 2.
  constexpr int kRawUnits = Cfg::kRawUnits;
  constexpr int kRawPerThread = kRawUnits / kThreads;
  static_assert(!kMxfp4 || kRawUnits % kThreads == 0, "the weight tile's scale groups must divide over the threads");
  const uint8_t* codes0 = static_cast<const uint8_t*>(args.w0) + expert * (static_cast<size_t>(n) * (k / 2));
  const uint8_t* codes1 =
      kGated ? static_cast<const uint8_t*>(args.w1) + expert * (static_cast<size_t>(n) * (k / 2)) : codes0;
  const uint8_t* scales0 = args.s0 + expert * (static_cast<size_t>(n) * (k / 32));
  const uint8_t* scales1 = kGated ? args.s1 + expert * (static_cast<size_t>(n) * (k / 32)) : scales0;
  const uint32_t raw_codes = smem_base + 2 * Cfg::kWeightBytes + kStages * Cfg::kRowStageBytes;
  const uint32_t raw_words = raw_codes + kStages * kRawUnits * 16;
  // The scale byte of unit (col, kk): its address (the copy takes the aligned word holding it).
  auto scale_address = [&](bool up, int col, int kk) {
    return reinterpret_cast<uintptr_t>((up ? scales1 : scales0) + static_cast<size_t>(col) * (k / 32) + kk / 32);
  };
  auto copy_raw = [&](int stage, int step) {
    const int nt = nt_first + step / num_k_steps;
    const int k0 = (step % num_k_steps) * kBK;
#pragma unroll
    for (int i = 0; i < kRawPerThread; ++i) {
      const int u = tid + i * kThreads;
      bool up;
      const int col = weight_row(nt, u >> 1, &up);
      const int kk = k0 + (u & 1) * 32;
      const bool ok = kk < k && col < n;
      const uint8_t* codes = (up ? codes1 : codes0) + static_cast<size_t>(col) * (k / 2) + kk / 2;
      // Without the evict-first hint of the bf16 weights: this kernel's LDGSTS with the policy descriptor
      // stopped with an illegal instruction on the H200 (sm_90a, CUDA 13.0, at 2666b91; the same instruction runs in
      // the bf16 kernel).
      cp_async_16(raw_codes + (stage * kRawUnits + u) * 16, ok ? codes : codes0, ok);
      cp_async_4(raw_words + (stage * kRawUnits + u) * 4,
                 ok ? reinterpret_cast<const void*>(scale_address(up, col, kk) & ~uintptr_t{3}) : codes0, ok);
    }
  };
  auto decode_raw = [&](int stage, int step) {
    const int nt = nt_first + step / num_k_steps;
    const int k0 = (step % num_k_steps) * kBK;
    unsigned char* tile = smem_aligned + (step % 2) * Cfg::kWeightBytes;
    const unsigned char* ring = smem_aligned + 2 * Cfg::kWeightBytes + kStages * Cfg::kRowStageBytes;
#pragma unroll
    for (int i = 0; i < kRawPerThread; ++i) {
      const int u = tid + i * kThreads;
      const int r = u >> 1, group = u & 1;
      bool up;
      const int col = weight_row(nt, r, &up);
      const int kk = k0 + group * 32;
      const uint4 codes = *reinterpret_cast<const uint4*>(ring + (stage * kRawUnits + u) * 16);
      const uint32_t word =
          *reinterpret_cast<const uint32_t*>(ring + kStages * kRawUnits * 16 + (stage * kRawUnits + u) * 4);
      // Past n or k the copy zero-filled the codes and the word: every value decodes to 0. No branch:
      // the warps must reach the wgmma instructions converged (.aligned).
      const uint32_t scale_byte = (word >> ((scale_address(up, col, kk) & 3) * 8)) & 0xFFu;
      const uint32_t words[4] = {codes.x, codes.y, codes.z, codes.w};
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int chunk16 = group * 4 + c;  // 16-byte chunk of the 128-byte row
        *reinterpret_cast<uint4*>(tile + r * kRowBytes + ((chunk16 ^ (r & 7)) << 4)) =
            mxfp4_decode8<T>(words[c], scale_byte);
      }
    }
    __syncwarp();  // converged again before any warpgroup instruction the compiler places after the decode
  };
  auto copy_weights = [&](int stage, int step) {
    if constexpr (kMxfp4) {
      copy_raw(stage, step);
    } else {
      load_weights(stage, step);
    }
  };

  // The expert's rows: the source row of each of this thread's tile rows (-1 past the tile's rows, which
  // are zero-filled up to mma_n and never copied beyond). Row numbers, not pointers: half the registers,
  // which the tall shape's 128 accumulators per thread need.
  int x_src[kXIters];
  auto load_rows = [&](int stage, int step) {
    const int kc = (step % num_k_steps) * kBK + chunk * 8;
    const bool k_ok = kc < k;
    const uint32_t dst = row_tile(stage) + copy_offset;
#pragma unroll
    for (int j = 0; j < kXIters; ++j) {
      if (row0 + j * kRowStep < mma_n) {
        const bool ok = k_ok && x_src[j] >= 0;
        cp_async_16(dst + j * kRowStep * kRowBytes, ok ? a_base + static_cast<size_t>(x_src[j]) * k + kc : a_base, ok);
      }
    }
  };

  // Prologue: the weights need only the expert, so their first stages go out before the wait on the
  // previous kernel (one group per stage); then the row indices and the rows' first stages (one group).
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < num_steps) copy_weights(s, s);
    cp_async_commit();
  }
  pdl_wait();
  if (!args.wait_before_tile && args.trigger_dependents) pdl_trigger();
#pragma unroll
  for (int j = 0; j < kXIters; ++j) {
    const int t = row0 + j * kRowStep;
    x_src[j] = -1;
    if (t < rows) {
      const int r = row_begin + t;
      x_src[j] = args.sorted_pairs != nullptr ? __ldg(args.sorted_pairs + r) / args.top_k : r;
    }
  }
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < num_steps) load_rows(s, s);
  }
  cp_async_commit();
  if constexpr (kMxfp4) {
    cp_async_wait<0>();
    decode_raw(0, 0);
  }

  float acc[kBlocks][kAcc];
#pragma unroll
  for (int b = 0; b < kBlocks; ++b) {
#pragma unroll
    for (int i = 0; i < kAcc; ++i) acc[b][i] = 0.0f;
  }

  // Whether this warpgroup holds any output column of n-tile nt (warpgroup-uniform).
  auto wg_active = [&](int nt) { return nt * kOutPerTile + wg * kOutPerWg < n; };

  T* out = static_cast<T*>(args.out);
  auto epilogue = [&](int nt) {
    if (!wg_active(nt)) return;
    wgmma_store_tile<T, kMode>(acc, args, out, row_begin, rows, mma_n, nt * kOutPerTile + wg * kOutPerWg, wq, lane);
  };

  // One pipeline over (n-tile, k-step) steps: the copies run ahead across n-tile boundaries, so the
  // epilogue of one n-tile overlaps the first copies of the next.
  int step = 0;
  for (int ntl = 0; ntl < nt_count; ++ntl) {
    for (int kt = 0; kt < num_k_steps; ++kt, ++step) {
      // Step `step` is complete when at most kStages - 2 later groups are pending; the first waits for
      // the whole prologue (its row group was committed last).
      if (step == 0) {
        cp_async_wait<0>();
      } else {
        cp_async_wait<kStages - 2>();
      }
      fence_proxy_async_smem();
      __syncthreads();  // every thread's copies of this step are visible to the async proxy
      {
        // Every warpgroup issues its wgmmas, also one whose weight rows are all past n (zero-filled; its
        // results are not stored): a warpgroup-uniform branch around them makes ptxas serialize them.
        const uint32_t weights = weight_tile(step);
        uint64_t desc_w[kBlocks];  // this warpgroup's m64 blocks in the weight tile
#pragma unroll
        for (int b = 0; b < kBlocks; ++b) desc_w[b] = sw128_desc(weights + (wg * kBlocks + b) * 64 * kRowBytes);
        const uint64_t desc_x = sw128_desc(row_tile(step % kStages));
        const int accumulate = kt > 0 ? 1 : 0;
        switch (mma_n >> 3) {
#define LATENTMOE_WGMMA_CASE(N)                         \
  case N / 8:                                           \
    wgmma_stage<T, N>(acc, desc_w, desc_x, accumulate); \
    break;
          LATENTMOE_WGMMA_CASE(8)
          LATENTMOE_WGMMA_CASE(16)
          LATENTMOE_WGMMA_CASE(24)
          LATENTMOE_WGMMA_CASE(32)
          LATENTMOE_WGMMA_CASE(40)
          LATENTMOE_WGMMA_CASE(48)
          LATENTMOE_WGMMA_CASE(56)
          LATENTMOE_WGMMA_CASE(64)
          LATENTMOE_WGMMA_CASE(72)
          LATENTMOE_WGMMA_CASE(80)
          LATENTMOE_WGMMA_CASE(88)
          LATENTMOE_WGMMA_CASE(96)
          LATENTMOE_WGMMA_CASE(104)
          LATENTMOE_WGMMA_CASE(112)
          LATENTMOE_WGMMA_CASE(120)
          LATENTMOE_WGMMA_CASE(128)
          LATENTMOE_WGMMA_CASE(136)
          LATENTMOE_WGMMA_CASE(144)
          LATENTMOE_WGMMA_CASE(152)
          LATENTMOE_WGMMA_CASE(160)
          LATENTMOE_WGMMA_CASE(168)
          LATENTMOE_WGMMA_CASE(176)
          LATENTMOE_WGMMA_CASE(184)
          LATENTMOE_WGMMA_CASE(192)
          LATENTMOE_WGMMA_CASE(200)
          LATENTMOE_WGMMA_CASE(208)
          LATENTMOE_WGMMA_CASE(216)
          LATENTMOE_WGMMA_CASE(224)
          LATENTMOE_WGMMA_CASE(232)
          LATENTMOE_WGMMA_CASE(240)
          LATENTMOE_WGMMA_CASE(248)
          LATENTMOE_WGMMA_CASE(256)
#undef LATENTMOE_WGMMA_CASE
          default:
            break;
        }
        static_assert(kWgmmaMaxN == 256, "the dispatch above covers N = 8 .. 256");
        wgmma_commit();
      }
      // The previous step's wgmmas (all warpgroups) have read their stage; this step's run while the
      // copies of step + kStages - 1 are issued into that stage.
      wgmma_wait_one();
      __syncthreads();
      const int next = step + kStages - 1;
      if (next < num_steps) {
        copy_weights(next % kStages, next);
        load_rows(next % kStages, next);
      }
      cp_async_commit();
      if constexpr (kMxfp4) {
        // Step + 1's raw groups were committed at least one group before the last kStages - 2: wait for
        // them and decode them into the buffer step - 1's wgmmas (all done, the barrier above) read.
        if (step + 1 < num_steps) {
          cp_async_wait<kStages - 2>();
          decode_raw((step + 1) % kStages, step + 1);
        }
      }
    }
    wgmma_wait_all();
    fence_accumulators(acc);
    epilogue(nt_first + ntl);
  }
  cp_async_wait<0>();
#endif
}

// n-tiles per CTA: enough k-steps that the CTA's start (tile look-up, the first DRAM round trip: a few
// microseconds that no other CTA hides, one CTA per SM) is a small part of its time, while the grid keeps
// about two CTAs per SM; balanced so that the groups of one tile are about equal.
inline int wgmma_tiles_per_cta(int n_tiles, int num_k_steps, int64_t expected_tiles, int sm_count) {
  constexpr int kMinSteps = 48;
  int per = std::min(n_tiles, std::max(1, (kMinSteps + num_k_steps - 1) / num_k_steps));
  while (per > 1 && expected_tiles * ((n_tiles + per - 1) / per) < 2 * int64_t{sm_count}) --per;
  const int groups = (n_tiles + per - 1) / per;
  return (n_tiles + groups - 1) / groups;
}

template <class T, class Cfg, Mode kMode, bool kMxfp4>
void launch_wgmma_cfg(KernelArgs args, const MmaLaunch& launch, cudaStream_t stream) {
  static std::atomic<uint64_t> done_mask{0};
  auto kernel = grouped_wgmma_kernel<T, Cfg, kMode, kMxfp4>;
  constexpr int kSmem = kMxfp4 ? Cfg::kSmemBytesMxfp4 : Cfg::kSmemBytes;
  ensure_smem_limit(reinterpret_cast<const void*>(kernel), kSmem, &done_mask);
  const int out_per_tile = kMode == Mode::gated ? Cfg::kWeightRows / 2 : Cfg::kWeightRows;
  args.n_tiles = (args.n + out_per_tile - 1) / out_per_tile;
  const int num_k_steps = (args.k + Cfg::kBlockK - 1) / Cfg::kBlockK;
  // Expected tiles: touched experts (at most T*k) times the tiles of an average expert.
  const int64_t touched = std::max<int64_t>(1, std::min<int64_t>(args.num_experts, launch.max_rows));
  const int64_t mean_rows = (launch.max_rows + touched - 1) / touched;
  const int64_t expected_tiles = touched * ((mean_rows + Cfg::kBlockM - 1) / Cfg::kBlockM);
  args.n_tiles_per_cta = launch.n_tiles_per_cta > 0
                             ? std::min(launch.n_tiles_per_cta, args.n_tiles)
                             : wgmma_tiles_per_cta(args.n_tiles, num_k_steps, expected_tiles, launch.sm_count);
  args.n_groups = (args.n_tiles + args.n_tiles_per_cta - 1) / args.n_tiles_per_cta;
  args.trigger_dependents = launch.trigger;
  args.wait_before_tile = launch.wait_before_tile;
  const int64_t entries = tile_entries_bound(launch.max_rows, args.num_experts, Cfg::kBlockM);
  const int64_t blocks = entries * args.n_groups;
  LATENTMOE_CHECK(blocks < (int64_t{1} << 31), "grouped GEMM (wgmma): too many tiles (", blocks, ")");

  launch_kernel("grouped GEMM (wgmma kernel)", launch.programmatic, kernel, dim3(static_cast<unsigned>(blocks)),
                dim3(Cfg::kThreads), kSmem, stream, args);
}

// 96 rows per tile (an expert with more takes several tiles) against 256 weight rows, 5 stages of 44 KB:
// 221 KB of shared memory, one CTA per SM.
using WgmmaCfg = WgmmaConfig<96, 5, 2>;
// 256 rows per tile against 128 weight rows, 4 stages of 48 KB: 193 KB, one CTA per SM.
using WgmmaTallCfg = WgmmaConfig<256, 4, 1>;
// 96 rows per tile against 128 weight rows, 3 stages of 28 KB (MXFP4: two 16 KB decoded tiles, 3 row stages
// of 12 KB and 3 raw stages of 5 KB): 85 KB, two CTAs per SM, so that one CTA's copies, decode and barriers
// overlap the other's wgmmas.
using WgmmaNarrowCfg = WgmmaConfig<96, 3, 1, 2>;
static_assert(2 * (WgmmaNarrowCfg::kSmemBytes + 1024) <= 227 * 1024 &&
                  2 * (WgmmaNarrowCfg::kSmemBytesMxfp4 + 1024) <= 227 * 1024,
              "two narrow CTAs must fit one SM's shared memory");

template <class T, class Cfg, bool kMxfp4>
void launch_wgmma_shape(Mode mode, const KernelArgs& args, const MmaLaunch& launch, cudaStream_t stream) {
  switch (mode) {
    case Mode::gated:
      return launch_wgmma_cfg<T, Cfg, Mode::gated, kMxfp4>(args, launch, stream);
    case Mode::relu2:
      return launch_wgmma_cfg<T, Cfg, Mode::relu2, kMxfp4>(args, launch, stream);
    case Mode::plain:
      return launch_wgmma_cfg<T, Cfg, Mode::plain, kMxfp4>(args, launch, stream);
  }
}

// kMxfp4: args.w0/w1 hold MXFP4 codes and args.s0/s1 their scales (grouped_gemm_wgmma_mxfp4.cu).
template <class T, bool kMxfp4 = false>
void launch_wgmma_typed(WgmmaShape shape, Mode mode, const KernelArgs& args, const MmaLaunch& launch,
                        cudaStream_t stream) {
  switch (shape) {
    case WgmmaShape::wide:
      return launch_wgmma_shape<T, WgmmaCfg, kMxfp4>(mode, args, launch, stream);
    case WgmmaShape::tall:
      return launch_wgmma_shape<T, WgmmaTallCfg, kMxfp4>(mode, args, launch, stream);
    case WgmmaShape::narrow:
      return launch_wgmma_shape<T, WgmmaNarrowCfg, kMxfp4>(mode, args, launch, stream);
  }
}

}  // namespace latentmoe::cuda::gg

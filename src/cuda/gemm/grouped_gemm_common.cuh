// Device pieces shared by the grouped GEMM kernels: the kernel arguments, the on-device tile finder
// and the epilogue's activation (cuda/common/activation.cuh). Internal to src/cuda/gemm/grouped_gemm*.cu.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/comm/lamport.h"
#include "cuda/common/activation.cuh"
#include "cuda/common/convert.cuh"

namespace latentmoe::cuda::gg {

// What the kernel computes from its accumulators.
//   gated: two weight matrices (gate w0, up w1), out = act(g, u) with act silu or situ (runtime);
//   relu2: one matrix (up), out = relu(u)^2;
//   plain: one matrix (down), out = acc.
enum class Mode { gated, relu2, plain };

struct KernelArgs {
  const void* a = nullptr;   // rows of A: z [T, K] (gathered through sorted_pairs) or act_rows [R, K]
  const void* w0 = nullptr;  // [E, N, K]: gate (gated), up (relu2) or down (plain)
  const void* w1 = nullptr;  // [E, N, K]: up (gated only)
  // MXFP4 weights (latentmoe/mxfp4.h; the tensor-core kernel's kMxfp4 instances only): w0 and w1 hold
  // the packed E2M1 codes [E, N, K/2] and these their E8M0 scales [E, N, K/32].
  const uint8_t* s0 = nullptr;
  const uint8_t* s1 = nullptr;
  void* out = nullptr;  // [R, N]
  const int32_t* expert_offsets = nullptr;
  const int32_t* sorted_pairs = nullptr;  // nullptr: A row = grouped row (down)
  int top_k = 1;
  int num_experts = 0;
  int n = 0;          // output columns (I_r for gate/up, l for down)
  int k = 0;          // reduction length (l for gate/up, I_r for down)
  bool situ = false;  // gated: situ instead of silu
  float situ_beta = 4.0f;
  float situ_linear_beta = 25.0f;
  // Tensor-core kernel only (set by its launcher): n-tiles of the output, n-tiles per CTA, CTAs per
  // m-tile (ceil(n_tiles / n_tiles_per_cta)), and whether to let the next kernel launch early.
  int n_tiles = 1;
  int n_tiles_per_cta = 1;
  int n_groups = 1;
  bool trigger_dependents = false;
  // Programmatic launch after the kernel that wrote expert_offsets (gate/up after the layout): wait
  // for it before looking up the tile (src/cuda/common/pdl.cuh). Otherwise the tile look-up and the first
  // weight stages run before the wait.
  bool wait_before_tile = false;
  // The persistent kernel (wgmma_ws, wgmma_ws_tall): its epilogue's stores, 0 staged through shared memory
  // (16 bytes a thread), 1 from registers (4 bytes a thread, the wgmma kernel's wgmma_store_tile).
  int ws_register_epilogue = 0;
  // The persistent kernel: 1 loads the rows A by TMA (contiguous rows: sorted_pairs null, A [max_rows, k]), 0 by
  // cp.async through the pair table.
  int ws_x_tma = 0;
  // The persistent kernel: the weights at normal L2 priority even where an expert's rows fit one tile
  // (weight_policy_for marks those evict-first); detail::ws_weight_l2 decides (short reductions, option bit 4).
  int ws_weights_normal = 0;

  // Split-K (tensor-core kernel only; then n_tiles_per_cta is 1): the k_splits CTAs of one output tile
  // each cover k_tiles_per_split k-tiles and store their fp32 sums in `partials`; the last of them to
  // arrive (counted in tile_counters, which it resets to 0) adds all of them in split order and runs the
  // epilogue, so the result does not depend on which CTA finishes last.
  int k_splits = 1;
  int k_tiles_per_split = 0;
  float* partials = nullptr;     // [tiles][k_splits][kBlockM * kBlockN]
  int* tile_counters = nullptr;  // [tiles], zero between launches

  // The pushing dense GEMM only (the mma.sync kernel's kPush instances; dense_push_gemm.h): one
  // "expert" of dense_rows rows (no expert_offsets, no sorted_pairs), and the epilogue adds
  // addend [dense_rows, n] (row stride ld_addend) and stores each result into every rank's receive
  // region of the group's next all-gather (lamport::push_all_gather_pair) instead of into `out`.
  int dense_rows = 0;
  const void* addend = nullptr;
  int64_t ld_addend = 0;
  LamportPeers push;
};

struct TileInfo {
  int expert;
  int row_begin;
  int row_end;
  int expert_rows;  // all of the expert's rows: more than block_m, and several m-tiles read its weights
};

// The m-tiles of all experts are numbered expert by expert: expert e owns ceil(rows_e / block_m) of
// them. Finds which expert and rows the tile `entry` covers, block-wide (every thread must call it).
// Returns false for entries past the last tile (the surplus of the host's upper-bound grid).
// All loads of one round are issued before any is used, so the cost is about one L2 round trip plus a
// block scan.
template <int kThreads>
__device__ __forceinline__ bool find_tile(const int32_t* __restrict__ offsets, int num_experts, int block_m, int entry,
                                          TileInfo* s_tile, int* s_scan) {
  constexpr int kWarps = kThreads / 32;
  constexpr int kPerThread = 8;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  if (tid == 0) s_tile->expert = -1;
  int base = 0;
  for (int round = 0; round < num_experts; round += kThreads * kPerThread) {
    const int remaining = num_experts - round;
    const int per = min(kPerThread, (remaining + kThreads - 1) / kThreads);
    const int e0 = round + tid * per;
    int off[kPerThread + 1];
#pragma unroll
    for (int i = 0; i <= kPerThread; ++i) {
      off[i] = (i <= per && e0 + i <= num_experts) ? __ldg(offsets + e0 + i) : 0;
    }
    int local = 0;
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      if (i < per && e0 + i < num_experts) local += (off[i + 1] - off[i] + block_m - 1) / block_m;
    }
    int inclusive = local;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      int v = __shfl_up_sync(0xffffffffu, inclusive, d);
      if (lane >= d) inclusive += v;
    }
    if (lane == 31) s_scan[warp] = inclusive;
    __syncthreads();
    int warp_prefix = 0;
    int total = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      int v = s_scan[w];
      if (w < warp) warp_prefix += v;
      total += v;
    }
    const int exclusive = base + warp_prefix + inclusive - local;
    if (entry >= exclusive && entry < exclusive + local) {
      int p = exclusive;
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) {
        if (i < per && e0 + i < num_experts) {
          int count = (off[i + 1] - off[i] + block_m - 1) / block_m;
          if (entry >= p && entry < p + count) {
            s_tile->expert = e0 + i;
            s_tile->row_begin = off[i] + (entry - p) * block_m;
            s_tile->row_end = min(off[i + 1], s_tile->row_begin + block_m);
            s_tile->expert_rows = off[i + 1] - off[i];
          }
          p += count;
        }
      }
    }
    base += total;
    __syncthreads();          // s_scan is reused by the next round; s_tile is visible after this
    if (entry < base) break;  // uniform: every thread has the same base
  }
  return s_tile->expert >= 0;
}

// The gated activation of the kernel arguments (cuda/common/activation.cuh); kFast in the 16-bit
// tensor-core epilogues, whose outputs are rounded to bf16/f16.
template <bool kFast = false>
__device__ __forceinline__ float gated_act(float g, float u, const KernelArgs& args) {
  return act::gated<kFast>(g, u, args.situ, args.situ_beta, args.situ_linear_beta);
}

}  // namespace latentmoe::cuda::gg

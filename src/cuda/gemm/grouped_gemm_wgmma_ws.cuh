// The persistent, warp-specialised Hopper grouped GEMM (sm_90a; GemmVariant::wgmma_ws, wgmma_ws_tall): the wgmma
// kernel's math (grouped_gemm_wgmma.cuh: weights as the MMA's M side in m64 blocks, the expert's rows as its N side, N
// = the tile's rows rounded up to 8, 128B-swizzled stages, the same epilogue), with the copies taken out of the threads
// that multiply.
//
// Threads and tiles. 3 warpgroups (384 threads), one CTA per SM, grid = min(SMs, a bound on the tiles).
// Warpgroup 0 is the producer (setmaxnreg.dec to producer_regs), warpgroups 1 and 2 the consumers
// (setmaxnreg.inc to consumer_regs: 128 * 56 + 256 * 224 = 64512 = 384 * 168, the registers the CTA starts with;
// the tall shape 128 * 64 + 256 * 216 = 63488, MXFP4 128 * 72 + 256 * 208 = 62464). A tile is up to kBlockM rows of one
// expert against kWeightRows weight rows, in two shapes (WgmmaWsConfig; the same code):
//   WgmmaWsCfg      (wgmma_ws)      160 rows x 256 weight rows: consumer c owns weight rows [128 c, 128 c + 128) as
//                   two m64 blocks (gated: 64 gate rows and the 64 up rows of the same output columns; otherwise
//                   128 consecutive rows), 2 x 80 accumulators per thread. 160 rows hold Kimi-K3's experts at 8192
//                   tokens (146 on average) in one tile, so that their weights are read once (at 128 most took two).
//   WgmmaWsTallCfg  (wgmma_ws_tall) 256 rows x 128 weight rows: consumer c owns weight rows [64 c, 64 c + 64) as one
//                   m64 block (gated: rows 16 q .. 16 q + 7 the gate rows and 16 q + 8 .. 16 q + 15 the up rows of
//                   the same 8 columns, as in the wgmma kernel's one-block shapes; otherwise 64 consecutive rows),
//                   128 accumulators per thread. An expert of up to 256 rows reads its weights once, and the n-tiles
//                   are half as wide (less padding past N: 336 = 3 x 128 - 48 rather than 2 x 256 - 176).
// Tiles are numbered row tile by row tile, n-tiles fastest:
// tile = row_tile * n_tiles + nt, row tiles numbered expert by expert (expert e owns ceil(rows_e / kBlockM)).
// At the start every CTA computes the prefix of the experts' row-tile counts from expert_offsets into shared
// memory (s_prefix[e] = row tiles of experts < e; s_prefix[E] = all), then walks tile = blockIdx.x,
// blockIdx.x + gridDim.x, ... < s_prefix[E] * n_tiles; every warpgroup finds each tile's expert by a binary
// search of s_prefix. Nothing is read on the host: CTAs past the last tile exit at once. Tile look-ahead (TileRef):
// the consumers load the next tile's expert offsets before a tile's k-loop, the producer the next tile's pair
// indices and the offsets of the one after, so that no tile boundary waits on a global load; it changes what is
// loaded when, not the walk (invariant 1).
//
// Ring. kStages stages, each [kWeightRows weight rows][64 k] then [kBlockM rows][64 k], 128-byte rows in the
// canonical 128B swizzle (16-byte chunk c of row r at r * 128 + ((c ^ (r & 7)) * 16), stages 1024-aligned):
// what TMA's SWIZZLE_128B writes for a box of 64 k x 64 (or 8) rows at a 1024-aligned address and what sw128_desc
// describes. Per stage a "full" and an "empty" mbarrier.
//   full[s]:  count kProducerThreads + 1. Per fill: producer thread 0 does arrive.expect_tx of the weight bytes
//             (kWeightRows rows of 64 k: boxes of 64 k x 64 rows, or of 8 rows for the tall shape's gated
//             interleave; counted whole even where a box runs past the tensor: TMA fills those elements with zeros
//             and still delivers the full box; with rows by TMA, below, the rows' bytes too); after a __syncwarp,
//             lane b of warp 0 issues the TMA load of box b (complete_tx on full[s]); every producer thread issues
//             its cp.async copies of the gathered rows (16 B, swizzled, zero-filled past k and past the tile's rows
//             up to N) and then cp.async.mbarrier.arrive.noinc on full[s] (one arrival per thread, made when all of
//             its earlier cp.async copies have landed).
//   empty[s]: count kConsumerWarps. Per use: each consumer warp, after wgmma.wait_group has retired the wgmmas
//             that read the stage, arrives once (lane 0).
// Step i of a CTA (its k-steps over all of its tiles, counted the same way by both roles) uses stage
// i % kStages in phase i / kStages. The consumers wait full[s] with parity (i / kStages) & 1; the producer waits
// empty[s] with parity ((i / kStages) & 1) ^ 1, which a fresh barrier passes at once (its preceding phase
// counts as complete), so the first kStages fills need no consumer.
// Invariants:
//   1. Both roles walk the same tiles in the same order with the same k-steps (ceil(k / 64) per tile): step
//      numbers, stages and parities agree.
//   2. Every producer thread makes exactly one noinc arrival per fill and thread 0 exactly one expect_tx
//      arrival (MXFP4: every producer thread one more arrival, after its decode), whatever it copies; every consumer
//      warp makes exactly one empty arrival per step, whether or not its weight rows hold valid columns (its wgmmas run
//      on zeros or the next expert's rows, not stored).
//   3. A stage is written only after the empty phase of its previous use completed (all 8 consumer warps
//      retired its wgmmas), and read only after its full phase completed (TMA bytes landed, every producer
//      thread's copies landed). cp.async writes are generic-proxy writes and wgmma reads through the async
//      proxy: the consumers issue fence.proxy.async after the full wait, before their wgmmas.
//   4. The consumers keep at most two wgmma groups in flight (wait_group 1 after each commit) and release a
//      stage only after the group that read it retired; the last stage of a tile is released after
//      wait_group 0, before the epilogue, so the producer fills the next tile's stages while the epilogue
//      stores (from registers, or through each consumer warp's own 512 bytes of s_epilogue, outside the ring:
//      the epilogue reads no stage).
//   5. Every mbarrier wait is bounded (%globaltimer): a stuck protocol traps (the launch fails) instead of hanging
//      the GPU. The producer outlives every consumer wait (after its last fill it waits for the consumers' last
//      releases), so when anything is stuck its wait times out, after kWaitTimeoutNs; a consumer traps
//      2 s after its own deadline in case the producer did not. Built with LATENTMOE_WGMMA_WS_REPORT=1 the producer
//      first prints one line (block, barrier, stage, parity, its step and the consumers' last steps); not by
//      default, since any printf in the kernel makes ptxas serialize its wgmmas (C7510).
// Rows by TMA (KernelArgs::ws_x_tma: contiguous rows, the down projection's A = act_rows [max_rows][k], bf16/f16
// weights; GemmChoice option bit 2 turns it off): no row copies; per fill lane 0 of warp 0 counts the rows' bytes in
// its arrive.expect_tx with the weight bytes, and lane b < ceil(N / 32) loads box b (64 k x 32 rows from row_begin +
// 32 b, 4 KB, zeros past k and past max_rows) into the stage's row tile. Rows past the tile's (the next expert's) land
// too and are multiplied, never stored. Every producer thread still makes its noinc arrival (invariant 2), with no
// copy pending.
// MXFP4 weights (kMxfp4; docs/MXFP4.md): no TMA. 3 stages (the same layout), and a raw ring of kRawStages slots
// per producer thread's units: unit u = tid + 128 i (i < kWeightRows / 64) of a step is scale group u % 2 of tile row u
// / 2 (16 code bytes and the aligned 4-byte word holding its scale byte, cp.async, zero-filled past n and k). Per step
// i a producer thread: waits empty; copies its rows of step i and arrives noinc on full (as above); copies its raw
// units of step i + kRawStages - 1 (a cursor that walks the tiles ahead) and commits them as one cp.async group
// with those rows; waits until at most kRawStages - 1 groups are pending (its raw units of step i landed: they
// were committed that many groups earlier); decodes them (mxfp4_decode8) into the stage's weight tile in the
// swizzled layout; fence.proxy.async; arrives on full. full[s] counts 2 * 128 arrivals, no transaction bytes.
// Nobody reads another thread's raw units (no barrier there); the noinc arrival also waits for the raw copies
// issued in earlier steps (a cp.async arrival tracks all of the thread's earlier copies), one step ahead of
// need at least, which the kStages - 1 steps the producer runs ahead cover.
// Programmatic dependent launch: every CTA waits for the previous kernel (griddepcontrol.wait) before it reads
// anything, then lets the next kernel launch (a persistent grid holds every SM, so nothing is gained by
// streaming weights before the wait).
#pragma once

#include <cuda.h>  // CUtensorMap (the type only: the encoder comes through cudaGetDriverEntryPointByVersion)

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "cuda/common/pdl.cuh"
#include "cuda/gemm/grouped_gemm_common.cuh"
#include "cuda/gemm/grouped_gemm_launch.cuh"
#include "cuda/gemm/grouped_gemm_mma.cuh"    // smem_u32, cp_async_16, pack2
#include "cuda/gemm/grouped_gemm_wgmma.cuh"  // sw128_desc, wgmma_stage, wgmma_store_tile, the fences
#include "cuda/gemm/grouped_gemm_wgmma_ops.cuh"
#include "cuda/gemm/mxfp4_device.cuh"  // mxfp4_decode8
#include "latentmoe/dtype.h"
#include "latentmoe/error.h"

namespace latentmoe::cuda::gg {

// The tile shapes (the file comment): kBlockM expert rows against kConsumers * 64 * kBlocksPerWg weight rows,
// kStages stages with bf16/f16 weights and kStagesMxfp4 with MXFP4 ones (whose raw ring takes the rest).
template <int kBlockM_, int kBlocksPerWg_, int kStages_, int kStagesMxfp4_>
struct WgmmaWsConfig {
  static constexpr int kConsumers = 2;
  static constexpr int kProducerThreads = 128;
  static constexpr int kThreads = kProducerThreads + kConsumers * 128;  // 384
  static constexpr int kConsumerWarps = kConsumers * 4;
  static constexpr int kBlocksPerWg = kBlocksPerWg_;                  // m64 weight blocks per consumer
  static constexpr int kWeightRows = kConsumers * 64 * kBlocksPerWg;  // 256 or 128
  static constexpr int kBlockM = kBlockM_;                            // expert rows per tile (N at most)
  static constexpr int kAcc = kBlockM / 2;                            // accumulators per thread and m64 block
  static constexpr int kBlockK = 64;
  static constexpr int kRowBytes = kBlockK * 2;
  // TMA boxes: 64 k x 64 weight rows (8 KB), except gated with one m64 block per consumer, whose gate and up rows
  // alternate by 8 (grouped_gemm_wgmma.cuh): boxes of 64 k x 8 rows (1 KB, one swizzle atom each).
  static constexpr int box_rows(bool gated) { return gated && kBlocksPerWg == 1 ? 8 : 64; }
  static constexpr int kWeightBytes = kWeightRows * kRowBytes;  // 32 KB or 16 KB
  static constexpr int kRowTileBytes = kBlockM * kRowBytes;     // 16, 20 or 32 KB
  // The rows by TMA (contiguous rows, KernelArgs::ws_x_tma): boxes of 64 k x 32 rows (4 KB), ceil(N / 32) a stage.
  static constexpr int kXBoxRows = 32;
  static constexpr int kStageBytes = kWeightBytes + kRowTileBytes;
  static constexpr int kStages = kStages_;
  static constexpr int kStagesMxfp4 = kStagesMxfp4_;
  static constexpr int kRawUnits = kWeightRows * kBlockK / 32;  // scale groups per step
  static constexpr int kRawStageBytes = kRawUnits * 20;         // 16 code bytes and a 4-byte scale word each
  static constexpr int kRawStages = 4;                          // raw copies run kRawStages - 1 steps ahead
  // The row-tile prefix over experts follows the ring (and the raw ring) in dynamic shared memory.
  static constexpr int kMaxExperts = kWgmmaWsMaxExperts;  // grouped_gemm_wgmma_launch.cuh
  static constexpr int ring_bytes(bool mxfp4) {
    return mxfp4 ? kStagesMxfp4 * kStageBytes + kRawStages * kRawStageBytes : kStages * kStageBytes;
  }
  static constexpr int smem_bytes(bool mxfp4, int num_experts) {
    return ring_bytes(mxfp4) + 1024 + ((num_experts + 1) * 4 + 15) / 16 * 16;
  }
  // setmaxnreg: the producer's and the consumers' registers per thread, no spills in any instance (ptxas -v, CUDA
  // 13.0). The producer's tile look-ahead spilled at 40 (bf16) and, with MXFP4's decode and raw cursor, at 56; the
  // consumers' 160 accumulators (wide, bf16) fit 224.
  // The producer's per-tile row addresses (row_unit) took 8 more in the tall shape (gated: 16 TMA boxes a stage) and
  // with MXFP4, whose consumers hold 128 accumulators in 208.
  static constexpr int producer_regs(bool mxfp4) { return mxfp4 || kBlocksPerWg == 1 ? (mxfp4 ? 72 : 64) : 56; }
  static constexpr int consumer_regs(bool mxfp4) { return mxfp4 || kBlocksPerWg == 1 ? (mxfp4 ? 208 : 216) : 224; }
  static_assert(kBlockM <= kWgmmaMaxN && kBlockM % 16 == 0, "rows per tile: at most the largest N");
  static_assert(kBlockM % kXBoxRows == 0 && kBlockM / kXBoxRows <= 32, "whole row boxes, one lane of warp 0 each");
  static_assert(kBlocksPerWg == 1 || kBlocksPerWg == 2, "one or two m64 blocks per consumer");
  static_assert(kBlocksPerWg * kAcc <= 160, "at most 160 accumulators per consumer thread");
  static_assert(kStageBytes % 1024 == 0 && kWeightBytes % 1024 == 0,
                "swizzle atoms and TMA boxes must stay 1024-byte aligned");
  static_assert(kRawStageBytes % 16 == 0, "raw slots keep the 16-byte alignment of the code copies");
  static_assert(producer_regs(false) % 8 == 0 && consumer_regs(false) % 8 == 0 && producer_regs(true) % 8 == 0 &&
                    consumer_regs(true) % 8 == 0,
                "setmaxnreg takes multiples of 8");
  static_assert(kProducerThreads * producer_regs(false) + kConsumers * 128 * consumer_regs(false) <= kThreads * 168 &&
                    kProducerThreads * producer_regs(true) + kConsumers * 128 * consumer_regs(true) <= kThreads * 168,
                "the warpgroups' registers must fit what the CTA starts with (168 per thread at 384 threads)");
  static_assert(smem_bytes(false, kMaxExperts) <= 227 * 1024 - 8192 &&
                    smem_bytes(true, kMaxExperts) <= 227 * 1024 - 8192,
                "the ring and the prefix must fit one SM's shared memory (beside the static barriers, tables and the "
                "epilogue's 4 KB)");
};
// GemmVariant::wgmma_ws: up to 160 expert rows against 256 weight rows (each consumer two m64 blocks), 3 stages of
// 52 KB (4 would not leave room for the prefix; MXFP4: 3, and 4 raw slots of 10 KB).
using WgmmaWsCfg = WgmmaWsConfig<160, 2, 3, 3>;
// The same with MXFP4 weights: 128 expert rows (160 accumulators spilled beside the decode's registers), 3 stages of
// 48 KB and 4 raw slots of 10 KB.
using WgmmaWsMxfp4Cfg = WgmmaWsConfig<128, 2, 4, 3>;
// GemmVariant::wgmma_ws_tall: up to 256 expert rows against 128 weight rows (each consumer one m64 block), 4 stages
// of 48 KB (MXFP4: 3, and 4 raw slots of 5 KB): an expert of up to 256 rows reads its weights once, and the n-tiles
// are 128 weight rows (64 output columns gated), so that N = 336 wastes 48 rows, not 176.
using WgmmaWsTallCfg = WgmmaWsConfig<256, 1, 4, 3>;

inline constexpr uint64_t kWaitTimeoutNs = 5'000'000'000ull;

#ifndef LATENTMOE_WGMMA_WS_REPORT
#define LATENTMOE_WGMMA_WS_REPORT 0
#endif
#if LATENTMOE_WGMMA_WS_REPORT
// Set by the first waiter of the grid that times out (protocol invariant 5), so that one line is printed, not one
// per thread. Never reset: the trap ends the CUDA context.
static __device__ int g_wgmma_ws_timeout_reported = 0;
#endif

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)

namespace ws {

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Arrives on `bar` once every cp.async this thread issued before has landed; counts as one of the barrier's
// expected arrivals (.noinc).
__device__ __forceinline__ void cp_async_arrive_noinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}
__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  return now;
}

// The producer's bounded wait (protocol invariant 5): traps after kWaitTimeoutNs. Built with
// LATENTMOE_WGMMA_WS_REPORT=1, the first waiter of the grid to time out first prints one line (its block, the
// barrier, stage, parity and step, and the consumers' last steps, s_consumer_step) and the others give that line a
// second to reach the buffer. Off by default: any call in the kernel (printf's too, wherever it is) makes ptxas
// serialize every wgmma of it (C7510), so the report is a debugging build. Inlined: a call in the producer's path
// also made ptxas ignore setmaxnreg (C7507).
__device__ __forceinline__ void producer_wait(uint32_t bar, uint32_t parity, int stage, int step,
                                              const volatile int* s_consumer_step) {
  if (mbar_try_wait(bar, parity)) return;
  const uint64_t start = global_timer_ns();
  while (!mbar_try_wait(bar, parity)) {
    if (global_timer_ns() - start > kWaitTimeoutNs) {
#if LATENTMOE_WGMMA_WS_REPORT
      if (atomicCAS(&g_wgmma_ws_timeout_reported, 0, 1) == 0) {
        printf(
            "latentmoe: grouped GEMM wgmma_ws kernel: block %d: the producer warpgroup waited %d s on the empty "
            "barrier of stage %d (parity %u) at its step %d; the consumer warpgroups were last at steps %d and %d: "
            "protocol stuck, trapping\n",
            static_cast<int>(blockIdx.x), static_cast<int>(kWaitTimeoutNs / 1'000'000'000ull), stage, parity, step,
            s_consumer_step[0], s_consumer_step[1]);
      } else {
        const uint64_t now = global_timer_ns();
        while (global_timer_ns() - now < 1'000'000'000ull) __nanosleep(1000000);
      }
#endif
      __trap();
    }
  }
}

// The consumers' bounded wait: no printf (a call while wgmmas are in flight makes ptxas serialize every wgmma,
// C7510). The producer always outlives the consumers' last wait (its tail waits for their last releases), so
// when a consumer is stuck the producer's wait times out too and prints; the consumer traps 2 s after its own
// deadline in case it does not.
__device__ __forceinline__ void consumer_wait(uint32_t bar, uint32_t parity) {
  if (mbar_try_wait(bar, parity)) return;
  const uint64_t start = global_timer_ns();
  while (!mbar_try_wait(bar, parity)) {
    if (global_timer_ns() - start > kWaitTimeoutNs + 2'000'000'000ull) __trap();
  }
}

// 2-D TMA load of one box into shared memory, completing `bytes` of the transaction count of `bar`.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int c0, int c1, uint32_t bar,
                                            uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, {%2, "
      "%3}], [%4], %5;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar), "l"(policy)
      : "memory");
}
// The same without an L2 hint (the rows: read by every n-tile's CTA of their row tile, at normal priority).
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int c0, int c1, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

struct Tile {
  int expert;
  int row_begin;
  int rows;
  int nt;
  int expert_rows;  // all of the expert's rows (more than kBlockM: other tiles read the same weights)
};

// A tile looked up but not resolved: its expert's offsets are loaded, and nothing is computed from them until
// resolve_ws_tile, so that their latency overlaps whatever runs in between (the tile before's k-loop).
struct TileRef {
  int expert;
  int nt;
  int first_row;  // of the tile within its expert
  int begin;      // expert_offsets[expert], expert_offsets[expert + 1]
  int end;
};

// Tile `tile` of the schedule (the file comment): its expert by binary search of the row-tile prefix.
template <int kBlockM>
__device__ __forceinline__ TileRef lookup_ws_tile(const int* s_prefix, const int32_t* __restrict__ offsets,
                                                  int num_experts, int n_tiles, int tile) {
  TileRef t;
  const int row_tile = tile / n_tiles;
  t.nt = tile - row_tile * n_tiles;
  // The last expert e with s_prefix[e] <= row_tile (s_prefix[0] = 0): its tiles hold row_tile.
  int lo = 0, hi = num_experts;
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (s_prefix[mid] <= row_tile) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  t.expert = lo;
  t.first_row = (row_tile - s_prefix[lo]) * kBlockM;
  t.begin = __ldg(offsets + lo);
  t.end = __ldg(offsets + lo + 1);
  return t;
}

template <int kBlockM>
__device__ __forceinline__ Tile resolve_ws_tile(const TileRef& ref) {
  Tile t;
  t.expert = ref.expert;
  t.nt = ref.nt;
  t.row_begin = ref.begin + ref.first_row;
  t.rows = min(ref.end - t.row_begin, kBlockM);
  t.expert_rows = ref.end - ref.begin;
  return t;
}

template <int kBlockM>
__device__ __forceinline__ Tile find_ws_tile(const int* s_prefix, const int32_t* __restrict__ offsets, int num_experts,
                                             int n_tiles, int tile) {
  return resolve_ws_tile<kBlockM>(lookup_ws_tile<kBlockM>(s_prefix, offsets, num_experts, n_tiles, tile));
}

// The consumers' k-loop over one tile with the MMA's N fixed (protocol: the file comment). `step` is the CTA's
// step counter, advanced by num_k_steps. full/empty: the barriers of stage 0 (stage s at + 8 s).
template <class T, class Cfg, int N, int kStages, int kBlocks, int kAcc>
__device__ __forceinline__ void consume_tile(float (&acc)[kBlocks][kAcc], uint32_t ring, uint32_t full, uint32_t empty,
                                             int& step, int num_k_steps, int consumer, int lane,
                                             volatile int* s_consumer_step) {
  for (int kt = 0; kt < num_k_steps; ++kt, ++step) {
    const int s = step % kStages;
    const uint32_t phase = static_cast<uint32_t>(step / kStages) & 1u;
    if ((threadIdx.x & 127) == 0) s_consumer_step[consumer] = step;
    consumer_wait(full + 8 * s, phase);
    fence_proxy_async_smem();  // the producer's cp.async rows and decoded weights (generic proxy) before the wgmmas
    const uint32_t stage = ring + s * Cfg::kStageBytes;
    uint64_t desc_w[kBlocks];
#pragma unroll
    for (int b = 0; b < kBlocks; ++b) desc_w[b] = sw128_desc(stage + (consumer * kBlocks + b) * 64 * Cfg::kRowBytes);
    const uint64_t desc_x = sw128_desc(stage + Cfg::kWeightBytes);
    wgmma_stage<T, N>(acc, desc_w, desc_x, kt > 0 ? 1 : 0);
    wgmma_commit();
    // The previous step's wgmmas have retired: release its stage (one arrival per warp).
    wgmma_wait_one();
    if (kt > 0 && lane == 0) mbar_arrive(empty + 8 * ((step - 1) % kStages));
  }
  wgmma_wait_all();
  if (lane == 0) mbar_arrive(empty + 8 * ((step - 1) % kStages));
}

// Four 8x8 b16 matrices (register i of every lane: matrix i's fragment, row lane / 4, columns 2 (lane % 4) and + 1)
// stored transposed: lane t gives the address of row t % 8 of matrix t / 8, which receives the matrix's column t % 8.
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}

// The epilogue through shared memory (the default; KernelArgs::ws_register_epilogue selects wgmma_store_tile): the
// same outputs as wgmma_store_tile (grouped_gemm_wgmma.cuh: the accumulator layout, the gated pairs, rows past
// `rows` and columns past n not stored), but each warp transposes its accumulators through its own 512 bytes of
// shared memory (`buf`) with stmatrix.trans, so that every lane stores 16 bytes: 8 consecutive output columns of
// one row (n and the columns multiples of 8, `out` 16-byte aligned), a warp instruction 16 or 32 whole rows' 32-
// or 16-byte pieces instead of 8 rows' 16-byte pieces from 4-byte stores. Every lane of the warp must call it.
template <class T, Mode kMode, int kBlocks, int kAcc>
__device__ __forceinline__ void store_tile_smem(const float (&acc)[kBlocks][kAcc], const KernelArgs& args, T* out,
                                                int row_begin, int rows, int mma_n, int wg_col, int wq, int lane,
                                                uint32_t buf, unsigned char* buf_ptr) {
  constexpr bool kGated = kMode == Mode::gated;
  const int n = args.n;
  auto store16 = [&](int row, int col, const unsigned char* src) {
    if (row < rows && col < n) {
      *reinterpret_cast<uint4*>(out + static_cast<size_t>(row_begin + row) * n + col) =
          *reinterpret_cast<const uint4*>(src);
    }
  };
  if constexpr (kGated && kBlocks == 1) {
    // Rows 16 q .. 16 q + 7 of the block the gate rows and 16 q + 8 .. the up rows of columns 8 q + [0, 8): one
    // 8 x 8 matrix (8 columns x 8 expert rows) per 8 expert rows; four at a time give 32 rows of 16 bytes, lane t
    // reading row t.
    static_assert(kAcc % 16 == 0, "four 8-row groups at a time");
#pragma unroll
    for (int j = 0; j < kAcc / 4; j += 4) {
      if (8 * j >= mma_n) continue;  // CTA-uniform
      uint32_t r[4];
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const int i0 = 4 * (j + m);
        r[m] = pack2<T>(gated_act<true>(acc[0][i0], acc[0][i0 + 2], args),
                        gated_act<true>(acc[0][i0 + 1], acc[0][i0 + 3], args));
      }
      stmatrix_x4_trans(buf + lane * 16, r[0], r[1], r[2], r[3]);
      __syncwarp();
      store16(8 * j + lane, wg_col + wq * 8, buf_ptr + lane * 16);
      __syncwarp();  // read before the next group overwrites it
    }
  } else {
    // Per m64 block b: warp wq holds columns 16 wq + [0, 16) (gated: gate in block 0, up in block 1, one column
    // block); two 8-row groups (j, j + 1) x two 8-column halves h are the four matrices, stored as 16 rows of 32
    // bytes (matrix 2 jj + h at rows 8 jj.., bytes 16 h..); lane t reads row t / 2, half t % 2.
    static_assert(kAcc % 8 == 0, "two 8-row groups at a time");
    constexpr int kOut = kGated ? 1 : kBlocks;
    constexpr bool relu2 = kMode == Mode::relu2;
    const uint32_t addr = buf + ((lane >> 4) * 8 + (lane & 7)) * 32 + ((lane >> 3) & 1) * 16;
#pragma unroll
    for (int b = 0; b < kOut; ++b) {
#pragma unroll
      for (int j = 0; j < kAcc / 4; j += 2) {
        if (8 * j >= mma_n) continue;  // CTA-uniform
        uint32_t r[4];
#pragma unroll
        for (int m = 0; m < 4; ++m) {
          const int i0 = 4 * (j + (m >> 1)) + 2 * (m & 1);
          float v0, v1;
          if constexpr (kGated) {
            v0 = gated_act<true>(acc[0][i0], acc[1][i0], args);
            v1 = gated_act<true>(acc[0][i0 + 1], acc[1][i0 + 1], args);
          } else {
            v0 = relu2 ? act::relu2(acc[b][i0]) : acc[b][i0];
            v1 = relu2 ? act::relu2(acc[b][i0 + 1]) : acc[b][i0 + 1];
          }
          r[m] = pack2<T>(v0, v1);
        }
        stmatrix_x4_trans(addr, r[0], r[1], r[2], r[3]);
        __syncwarp();
        store16(8 * j + (lane >> 1), wg_col + b * 64 + wq * 16 + (lane & 1) * 8, buf_ptr + lane * 16);
        __syncwarp();  // read before the next group overwrites it
      }
    }
  }
}

}  // namespace ws

#endif

// kMxfp4: args.w0/w1 hold MXFP4 codes [E, N, K/2] and args.s0/s1 their E8M0 scales [E, N, K/32] (the weights'
// tensor maps are unused); the producer decodes them into the weight stages (the file comment, "MXFP4").
// map_x: the rows A [max_rows][k] when args.ws_x_tma (contiguous rows; unused otherwise).
template <class T, class Cfg, Mode kMode, bool kMxfp4 = false>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    grouped_wgmma_ws_kernel(const __grid_constant__ CUtensorMap map_w0, const __grid_constant__ CUtensorMap map_w1,
                            const __grid_constant__ CUtensorMap map_x, const KernelArgs args) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kStages = kMxfp4 ? Cfg::kStagesMxfp4 : Cfg::kStages;
  constexpr int kThreads = Cfg::kThreads;
  constexpr int kBK = Cfg::kBlockK;
  constexpr bool kGated = kMode == Mode::gated;
  constexpr int kOutPerTile = kGated ? Cfg::kWeightRows / 2 : Cfg::kWeightRows;  // output columns per n-tile
  constexpr int kOutPerWg = kOutPerTile / Cfg::kConsumers;
  // Arrivals that complete a fill: bf16, every producer thread's noinc arrival and the expect_tx arrival; MXFP4,
  // every producer thread's noinc arrival (rows) and its arrival after decoding (weights).
  constexpr uint32_t kFullArrivals = kMxfp4 ? 2 * Cfg::kProducerThreads : Cfg::kProducerThreads + 1;

  extern __shared__ unsigned char smem_raw[];
  __shared__ alignas(8) uint64_t full_bar[kStages];  // consume_tile addresses stage s at full_bar + 8 s bytes
  __shared__ alignas(8) uint64_t empty_bar[kStages];
  __shared__ int s_scan[kThreads / 32];
  __shared__ int s_src[2 * Cfg::kBlockM];                    // the producer's source-row tables (two tiles)
  __shared__ volatile int s_consumer_step[Cfg::kConsumers];  // each consumer's last step (for the timeout report)
  __shared__ alignas(16) unsigned char s_epilogue[Cfg::kConsumerWarps][512];  // each consumer warp's transpose

  pdl_wait();
  if (args.trigger_dependents) pdl_trigger();

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const uint32_t ring = (smem_u32(smem_raw) + 1023u) & ~1023u;
  unsigned char* const ring_ptr = smem_raw + (ring - smem_u32(smem_raw));
  int* const s_prefix = reinterpret_cast<int*>(ring_ptr + Cfg::ring_bytes(kMxfp4));
  const int num_experts = args.num_experts;

  if (tid < Cfg::kConsumers) s_consumer_step[tid] = -1;
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      ws::mbar_init(smem_u32(&full_bar[s]), kFullArrivals);
      ws::mbar_init(smem_u32(&empty_bar[s]), Cfg::kConsumerWarps);
    }
    // The inits must be visible to the async proxy (TMA's complete_tx) and to the other threads (the barrier
    // below).
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    fence_proxy_async_smem();
  }

  // The row-tile prefix over experts (all threads; rounds of kThreads experts).
  {
    int carry = 0;
    for (int round = 0; round < num_experts; round += kThreads) {
      const int e = round + tid;
      int count = 0;
      if (e < num_experts) {
        const int rows = __ldg(args.expert_offsets + e + 1) - __ldg(args.expert_offsets + e);
        count = (max(rows, 0) + Cfg::kBlockM - 1) / Cfg::kBlockM;
      }
      int inclusive = count;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, inclusive, d);
        if (lane >= d) inclusive += v;
      }
      if (lane == 31) s_scan[warp] = inclusive;
      __syncthreads();
      int warp_prefix = 0, total = 0;
#pragma unroll
      for (int w = 0; w < kThreads / 32; ++w) {
        const int v = s_scan[w];
        if (w < warp) warp_prefix += v;
        total += v;
      }
      if (e < num_experts) s_prefix[e] = carry + warp_prefix + inclusive - count;
      carry += total;
      __syncthreads();  // s_scan is rewritten by the next round
    }
    if (tid == 0) s_prefix[num_experts] = carry;
  }
  __syncthreads();  // the prefix and the barrier inits

  const int n_tiles = args.n_tiles;
  // The tile count: read from shared memory by each role after its setmaxnreg (a value live across it was spilled).
  auto tile_count_of_cta = [&]() { return *reinterpret_cast<volatile const int*>(s_prefix + num_experts) * n_tiles; };
  const int n = args.n;
  const int k = args.k;
  const int num_k_steps = (k + kBK - 1) / kBK;

  if (warp < 4) {
    // ---------------------------------------------------------------- producer
    ws::setmaxnreg_dec<Cfg::producer_regs(kMxfp4)>();
    const int num_tiles = tile_count_of_cta();
    // Row copies: a thread copies 16-byte chunks c and c + 4 of rows row0, row0 + kRowStep, ... (two chunks a row,
    // so that it keeps half as many rows' addresses: row_unit below).
    constexpr int kThreadsPerRow = kBK / 8 / 2;                       // 4
    constexpr int kRowStep = Cfg::kProducerThreads / kThreadsPerRow;  // 32: rows between one thread's copies
    constexpr int kXIters = Cfg::kBlockM / kRowStep;                  // 5 or 8
    static_assert(kRowStep % 8 == 0, "a thread's rows must share their swizzle phase");
    static_assert(Cfg::kBlockM % kRowStep == 0, "whole rounds of row copies");
    // TMA boxes per stage (lanes 0.. of warp 0 issue one each) and their weight rows.
    constexpr int kBoxRows = Cfg::box_rows(kGated);
    constexpr int kBoxes = Cfg::kWeightRows / kBoxRows;  // 4, 2 or 16
    static_assert(kBoxes <= 32 && Cfg::kWeightRows % kBoxRows == 0, "one lane of warp 0 per box");
    const int chunk = tid % kThreadsPerRow;
    const int row0 = tid / kThreadsPerRow;
    const uint32_t copy_offset = row0 * Cfg::kRowBytes + ((chunk ^ (row0 & 7)) << 4);
    const uint32_t copy_offset_hi = row0 * Cfg::kRowBytes + (((chunk + 4) ^ (row0 & 7)) << 4);
    const T* a_base = static_cast<const T*>(args.a);
    // Contiguous rows (the down projection's) come by TMA, boxes of kXBoxRows rows issued by warp 0 beside the
    // weights' (the file comment, "Rows by TMA"); gathered ones by every producer thread's cp.async.
    // (Only the down projection's plain mode has contiguous rows: the gated and relu2 instances compile without it,
    // and so do the MXFP4 ones, whose producer spilled with it at 72 and at 88 registers.)
    const bool x_tma = !kMxfp4 && kMode == Mode::plain && args.ws_x_tma != 0;
    if (tid == 0) {
      if constexpr (!kMxfp4) {
        ws::prefetch_tensor_map(&map_w0);
        if constexpr (kGated) ws::prefetch_tensor_map(&map_w1);
      }
      if (x_tma) ws::prefetch_tensor_map(&map_x);
    }

    // MXFP4: unit u = tid + i * kProducerThreads of a step is scale group u % 2 (32 k) of tile row u / 2, whose
    // 16 code bytes and the aligned 4-byte word holding its scale byte this thread copies (cp.async) into raw slot
    // step % kRawStages, kRawStages - 1 steps ahead, and decodes itself: no other thread reads its raw units.
    constexpr int kRawAhead = Cfg::kRawStages - 1;
    constexpr int kRawPerThread = Cfg::kRawUnits / Cfg::kProducerThreads;  // 4 (wide) or 2 (tall)
    static_assert(Cfg::kRawUnits % Cfg::kProducerThreads == 0, "the scale groups must divide over the producer");
    const uint32_t raw_base = ring + kStages * Cfg::kStageBytes;  // codes [slot][unit][16], then words [slot][unit][4]
    const unsigned char* const raw_ptr = ring_ptr + kStages * Cfg::kStageBytes;
    const size_t code_row = static_cast<size_t>(k / 2);    // code bytes per weight row
    const size_t scale_row = static_cast<size_t>(k / 32);  // scale bytes per weight row
    // Tile row r of n-tile nt: its column and whether it is an up row (wgmma_weight_row, grouped_gemm_wgmma.cuh).
    auto weight_row = [&](int nt, int r, bool* up) {
      return wgmma_weight_row<kGated, Cfg::kBlocksPerWg, kOutPerTile>(nt, r, up);
    };
    // The raw copies of step `raw_step` (tile `raw_tile` of expert raw_expert, n-tile raw_nt, k-step raw_kt):
    // zero-filled past n and k, so that those values decode to 0.
    auto copy_raw = [&](int raw_step, int raw_expert, int raw_nt, int raw_kt) {
      const int slot = raw_step % Cfg::kRawStages;
      const uint8_t* codes0 = static_cast<const uint8_t*>(args.w0) + static_cast<size_t>(raw_expert) * n * code_row;
      const uint8_t* codes1 =
          kGated ? static_cast<const uint8_t*>(args.w1) + static_cast<size_t>(raw_expert) * n * code_row : codes0;
      const uint8_t* scales0 = args.s0 + static_cast<size_t>(raw_expert) * n * scale_row;
      const uint8_t* scales1 = kGated ? args.s1 + static_cast<size_t>(raw_expert) * n * scale_row : scales0;
#pragma unroll
      for (int i = 0; i < kRawPerThread; ++i) {
        const int u = tid + i * Cfg::kProducerThreads;
        bool up;
        const int col = weight_row(raw_nt, u >> 1, &up);
        const int kk = raw_kt * kBK + (u & 1) * 32;
        const bool ok = kk < k && col < n;
        const uint8_t* codes = (up ? codes1 : codes0) + col * code_row + kk / 2;
        const uint8_t* scale = (up ? scales1 : scales0) + col * scale_row + kk / 32;
        // Without an L2 policy: the MXFP4 wgmma kernel's cp.async with one stopped with an illegal instruction
        // (grouped_gemm_wgmma.cuh).
        cp_async_16(raw_base + (slot * Cfg::kRawUnits + u) * 16, ok ? codes : codes0, ok);
        cp_async_4(raw_base + Cfg::kRawStages * Cfg::kRawUnits * 16 + (slot * Cfg::kRawUnits + u) * 4,
                   ok ? reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(scale) & ~uintptr_t{3}) : codes0, ok);
      }
    };
    // Decodes this thread's units of step `step` (expert, n-tile nt, k-step kt) from its raw slot into the stage's
    // weight tile, in the swizzled layout the TMA writes in the bf16 path.
    auto decode_raw = [&](int step, int expert, int nt, int kt, uint32_t stage) {
      const int slot = step % Cfg::kRawStages;
      const uint8_t* scales0 = args.s0 + static_cast<size_t>(expert) * n * scale_row;
      const uint8_t* scales1 = kGated ? args.s1 + static_cast<size_t>(expert) * n * scale_row : scales0;
      unsigned char* const tile = ring_ptr + (stage - ring);
#pragma unroll
      for (int i = 0; i < kRawPerThread; ++i) {
        const int u = tid + i * Cfg::kProducerThreads;
        const int r = u >> 1, group = u & 1;
        bool up;
        const int col = weight_row(nt, r, &up);
        const int kk = kt * kBK + group * 32;
        const uint4 codes = *reinterpret_cast<const uint4*>(raw_ptr + (slot * Cfg::kRawUnits + u) * 16);
        const uint32_t word = *reinterpret_cast<const uint32_t*>(raw_ptr + Cfg::kRawStages * Cfg::kRawUnits * 16 +
                                                                 (slot * Cfg::kRawUnits + u) * 4);
        // Past n or k the copy zero-filled the codes and the word: every value decodes to 0.
        const uintptr_t scale_address =
            reinterpret_cast<uintptr_t>((up ? scales1 : scales0) + col * scale_row + kk / 32);
        const uint32_t scale_byte = (word >> ((scale_address & 3) * 8)) & 0xFFu;
        const uint32_t words[4] = {codes.x, codes.y, codes.z, codes.w};
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int chunk16 = group * 4 + c;  // 16-byte chunk of the 128-byte row
          *reinterpret_cast<uint4*>(tile + r * Cfg::kRowBytes + ((chunk16 ^ (r & 7)) << 4)) =
              mxfp4_decode8<T>(words[c], scale_byte);
        }
      }
    };
    // MXFP4: the lookahead cursor, the tile and k-step of the raw copies (kRawAhead steps past the fill).
    int raw_tile = blockIdx.x, raw_kt = 0, raw_step = 0;
    ws::Tile raw_t{};
    auto advance_raw = [&]() {
      if (raw_tile < num_tiles) {
        if (raw_kt == 0)
          raw_t = ws::find_ws_tile<Cfg::kBlockM>(s_prefix, args.expert_offsets, num_experts, n_tiles, raw_tile);
        copy_raw(raw_step, raw_t.expert, raw_t.nt, raw_kt);
        if (++raw_kt == num_k_steps) {
          raw_kt = 0;
          raw_tile += gridDim.x;
        }
      }
      ++raw_step;
      cp_async_commit();  // one group per step, empty past the last tile: the waits below count groups
    };
    if constexpr (kMxfp4) {
      for (int i = 0; i < kRawAhead; ++i) advance_raw();
    }

    // Tile look-ahead: while tile i's k-steps are issued, the pair indices of tile i + 1 (this thread's
    // ceil(kBlockM / 128) rows, loaded raw: nothing waits for them before tile i + 1) and the expert offsets of tile
    // i + 2 (TileRef) are in flight, so the tile boundary waits on no global load.
    constexpr int kSrcPerThread = (Cfg::kBlockM + Cfg::kProducerThreads - 1) / Cfg::kProducerThreads;
    const int grid = gridDim.x;
    auto lookup = [&](int tile) {
      return ws::lookup_ws_tile<Cfg::kBlockM>(s_prefix, args.expert_offsets, num_experts, n_tiles, tile);
    };
    int pair_next[kSrcPerThread];  // sorted_pairs entries (or rows, without sorted_pairs) of next's rows; -1 past
    auto load_pairs = [&](const ws::Tile& tt) {
      if (x_tma) return;  // no table: the rows are the tile's own, by TMA
#pragma unroll
      for (int i = 0; i < kSrcPerThread; ++i) {
        const int r = tid + i * Cfg::kProducerThreads;
        pair_next[i] = r < tt.rows ? (args.sorted_pairs != nullptr ? __ldg(args.sorted_pairs + tt.row_begin + r)
                                                                   : tt.row_begin + r)
                                   : -1;
      }
    };
    ws::Tile next{};
    ws::TileRef ref{};
    if (static_cast<int>(blockIdx.x) < num_tiles) {
      next = ws::resolve_ws_tile<Cfg::kBlockM>(lookup(blockIdx.x));
      load_pairs(next);
      if (static_cast<int>(blockIdx.x) + grid < num_tiles) ref = lookup(blockIdx.x + grid);
    }

    int step = 0;
    int tile_count = 0;
    for (int tile = blockIdx.x; tile < num_tiles; tile += grid, ++tile_count) {
      const ws::Tile t = next;
      const int mma_n = (t.rows + 7) & ~7;
      // The source row of each tile row (-1: past the tile's rows, zero-filled up to mma_n), ceil(kBlockM / 128) per
      // producer thread, double-buffered by tile: the named barrier publishes this tile's table to the producer
      // warpgroup, and a thread that passes it has finished reading the table of two tiles back (its k-loop precedes).
      int row_unit[kXIters];  // gathered rows only (x_tma: unused)
      if (!x_tma) {
        int* const src = s_src + (tile_count & 1) * Cfg::kBlockM;
#pragma unroll
        for (int i = 0; i < kSrcPerThread; ++i) {
          const int x = pair_next[i];
          if (tid + i * Cfg::kProducerThreads < Cfg::kBlockM) {
            src[tid + i * Cfg::kProducerThreads] = x >= 0 && args.sorted_pairs != nullptr ? x / args.top_k : x;
          }
        }
        asm volatile("bar.sync 1, %0;\n" ::"n"(Cfg::kProducerThreads) : "memory");
        // This thread's rows of the tile (row0 + j kRowStep), read once per tile: where each starts in A, in 16-byte
        // units (-1: zero-filled). Kept in registers, so that a k-step's copies are an add, a select and the copy each
        // (with the table read and a 64-bit multiply per copy, the producer issued ~28 instructions a copy and fed its
        // consumers too slowly: ncu, Nemotron tp-shard 8 at 4096 tokens, session 18).
#pragma unroll
        for (int j = 0; j < kXIters; ++j) {
          const int x = src[row0 + j * kRowStep];
          row_unit[j] = x >= 0 ? x * (k / 8) : -1;
        }
      }
      if (tile + grid < num_tiles) {
        next = ws::resolve_ws_tile<Cfg::kBlockM>(ref);  // its offsets were loaded during the tile before
        load_pairs(next);
        if (tile + 2 * grid < num_tiles) ref = lookup(tile + 2 * grid);
      }
      // The weights' tensor maps' row coordinates: t.expert * n + the box's first column (rows past the expert's n
      // read the next expert's, or zeros past the last: never stored). The rows' boxes: the tile's rows from
      // row_begin, ceil(mma_n / kXBoxRows) of them (rows past the tile's: the next expert's, or zeros past max_rows;
      // their outputs are not stored).
      // (x_boxes > 0 exactly when x_tma: a tile has at least one row.)
      const int x_boxes = x_tma ? (mma_n + Cfg::kXBoxRows - 1) / Cfg::kXBoxRows : 0;
      constexpr int kXBoxBytes = Cfg::kXBoxRows * Cfg::kRowBytes;
      for (int kt = 0; kt < num_k_steps; ++kt, ++step) {
        const int s = step % kStages;
        const uint32_t phase = static_cast<uint32_t>(step / kStages) & 1u;
        const uint32_t full = smem_u32(&full_bar[s]);
        ws::producer_wait(smem_u32(&empty_bar[s]), phase ^ 1u, s, step, s_consumer_step);
        const uint32_t stage = ring + s * Cfg::kStageBytes;
        const uint32_t dst = stage + Cfg::kWeightBytes;
        if constexpr (!kMxfp4) {
          if (warp == 0) {
            // Lane 0 announces the stage's weight bytes (and the rows' with x_tma), then lane b loads box b (tile
            // rows [b kBoxRows, ..), the rows weight_row gives: gate or up rows of the same columns, or consecutive
            // rows).
            if (lane == 0) ws::mbar_arrive_expect_tx(full, Cfg::kWeightBytes + x_boxes * kXBoxBytes);
            __syncwarp();
            if (lane < kBoxes) {
              bool up;
              const int col = weight_row(t.nt, lane * kBoxRows, &up);
              // The weights' L2 priority: evict-first, normal for an expert split over several row tiles
              // (weight_policy_for) and for a short reduction (ws_weights_normal, the launcher); created here,
              // where it is used: the producer has registers for little.
              ws::tma_load_2d(
                  stage + lane * kBoxRows * Cfg::kRowBytes, up ? &map_w1 : &map_w0, kt * kBK, t.expert * n + col, full,
                  weight_policy_for(args.ws_weights_normal ? Cfg::kBlockM + 1 : t.expert_rows, Cfg::kBlockM));
            }
            if (lane < x_boxes) {
              ws::tma_load_2d(dst + lane * kXBoxBytes, &map_x, kt * kBK, t.row_begin + lane * Cfg::kXBoxRows, full);
            }
          }
        }
        const int kc = kt * kBK + chunk * 8;  // chunk + 4: kc + 32 (k is a multiple of 8: a chunk is in or out)
        const bool k_ok = kc < k;
        const bool k_ok_hi = kc + 32 < k;
        const unsigned char* const a_bytes = reinterpret_cast<const unsigned char*>(a_base);
#pragma unroll
        for (int j = 0; j < kXIters; ++j) {
          // Rows past the tile's are zero-filled (row_unit -1) up to mma_n; past mma_n nothing reads them, so whole
          // rounds past it are skipped (a CTA-uniform test). The chunk's 16-byte unit is a 32-bit add a step (an
          // address computed per row once per tile would take two registers a row).
          if (x_boxes == 0 && j * kRowStep < mma_n) {
            const bool row_ok = row_unit[j] >= 0;
            const uint32_t unit = static_cast<uint32_t>(row_ok ? row_unit[j] : 0) + static_cast<uint32_t>(kc / 8);
            const unsigned char* const src_row = a_bytes + static_cast<size_t>(unit) * 16;
            const uint32_t dst_row = dst + j * kRowStep * Cfg::kRowBytes;
            cp_async_16(dst_row + copy_offset, row_ok && k_ok ? src_row : a_bytes, row_ok && k_ok);
            cp_async_16(dst_row + copy_offset_hi, row_ok && k_ok_hi ? src_row + 64 : a_bytes, row_ok && k_ok_hi);
          }
        }
        // Counts when this thread's row copies (and every earlier cp.async of it, MXFP4's raw copies of the steps
        // before included) have landed.
        ws::cp_async_arrive_noinc(full);
        if constexpr (kMxfp4) {
          // The raw copies of step + kRawAhead (after the arrival above, which would wait for them too), then this
          // step's: committed kRawAhead groups before the one just committed.
          advance_raw();
          cp_async_wait<kRawAhead>();
          decode_raw(step, t.expert, t.nt, kt, stage);
          fence_proxy_async_smem();  // the decoded weights (generic-proxy stores) before the consumers' wgmmas
          ws::mbar_arrive(full);
        }
      }
    }
    // Tail: wait until the consumers have released every stage's last use, so that the producer outlives every
    // consumer wait (and reports a stuck one: protocol invariant 5). A stage never used passes at once.
    for (int i = 0; i < kStages; ++i, ++step) {
      const int s = step % kStages;
      ws::producer_wait(smem_u32(&empty_bar[s]), (static_cast<uint32_t>(step / kStages) & 1u) ^ 1u, s, step,
                        s_consumer_step);
    }
    if constexpr (kMxfp4) cp_async_wait<0>();  // the empty raw groups past the last tile
  } else {
    // ---------------------------------------------------------------- consumers
    ws::setmaxnreg_inc<Cfg::consumer_regs(kMxfp4)>();
    const int num_tiles = tile_count_of_cta();
    const int c = warp / 4 - 1;  // consumer 0 or 1
    const int wq = warp & 3;     // warp in the warpgroup: rows 16 wq.. of each m64 block
    constexpr int kBlocks = Cfg::kBlocksPerWg;
    T* out = static_cast<T*>(args.out);
    float acc[kBlocks][Cfg::kAcc];
#pragma unroll
    for (int b = 0; b < kBlocks; ++b) {
#pragma unroll
      for (int i = 0; i < Cfg::kAcc; ++i) acc[b][i] = 0.0f;
    }
    int step = 0;
    // Tile look-ahead: the next tile's expert offsets load during this tile's k-loop (TileRef).
    ws::TileRef ref{};
    if (static_cast<int>(blockIdx.x) < num_tiles) {
      ref = ws::lookup_ws_tile<Cfg::kBlockM>(s_prefix, args.expert_offsets, num_experts, n_tiles, blockIdx.x);
    }
    for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
      const ws::Tile t = ws::resolve_ws_tile<Cfg::kBlockM>(ref);
      if (tile + static_cast<int>(gridDim.x) < num_tiles) {
        ref = ws::lookup_ws_tile<Cfg::kBlockM>(s_prefix, args.expert_offsets, num_experts, n_tiles, tile + gridDim.x);
      }
      const int mma_n = (t.rows + 7) & ~7;
      // N is an operand of the instruction: one k-loop per N (the switch outside the loop: a switch among the
      // wgmmas after each barrier wait made ptxas serialize them, C7520).
      switch (mma_n >> 3) {
#define LATENTMOE_WGMMA_WS_CASE(N)                                                                           \
  case N / 8:                                                                                                \
    if constexpr (N <= Cfg::kBlockM) {                                                                       \
      ws::consume_tile<T, Cfg, N, kStages>(acc, ring, smem_u32(&full_bar[0]), smem_u32(&empty_bar[0]), step, \
                                           num_k_steps, c, lane, s_consumer_step);                           \
    }                                                                                                        \
    break;
        LATENTMOE_WGMMA_WS_CASE(8)
        LATENTMOE_WGMMA_WS_CASE(16)
        LATENTMOE_WGMMA_WS_CASE(24)
        LATENTMOE_WGMMA_WS_CASE(32)
        LATENTMOE_WGMMA_WS_CASE(40)
        LATENTMOE_WGMMA_WS_CASE(48)
        LATENTMOE_WGMMA_WS_CASE(56)
        LATENTMOE_WGMMA_WS_CASE(64)
        LATENTMOE_WGMMA_WS_CASE(72)
        LATENTMOE_WGMMA_WS_CASE(80)
        LATENTMOE_WGMMA_WS_CASE(88)
        LATENTMOE_WGMMA_WS_CASE(96)
        LATENTMOE_WGMMA_WS_CASE(104)
        LATENTMOE_WGMMA_WS_CASE(112)
        LATENTMOE_WGMMA_WS_CASE(120)
        LATENTMOE_WGMMA_WS_CASE(128)
        LATENTMOE_WGMMA_WS_CASE(136)
        LATENTMOE_WGMMA_WS_CASE(144)
        LATENTMOE_WGMMA_WS_CASE(152)
        LATENTMOE_WGMMA_WS_CASE(160)
        LATENTMOE_WGMMA_WS_CASE(168)
        LATENTMOE_WGMMA_WS_CASE(176)
        LATENTMOE_WGMMA_WS_CASE(184)
        LATENTMOE_WGMMA_WS_CASE(192)
        LATENTMOE_WGMMA_WS_CASE(200)
        LATENTMOE_WGMMA_WS_CASE(208)
        LATENTMOE_WGMMA_WS_CASE(216)
        LATENTMOE_WGMMA_WS_CASE(224)
        LATENTMOE_WGMMA_WS_CASE(232)
        LATENTMOE_WGMMA_WS_CASE(240)
        LATENTMOE_WGMMA_WS_CASE(248)
        LATENTMOE_WGMMA_WS_CASE(256)
#undef LATENTMOE_WGMMA_WS_CASE
        default:
          break;
      }
      static_assert(kWgmmaMaxN == 256 && Cfg::kBlockM <= kWgmmaMaxN, "the dispatch above covers N = 8 .. 256");
      fence_accumulators(acc);
      if (t.nt * kOutPerTile + c * kOutPerWg < n) {
        const int wg_col = t.nt * kOutPerTile + c * kOutPerWg;
        if (args.ws_register_epilogue) {
          wgmma_store_tile<T, kMode>(acc, args, out, t.row_begin, t.rows, mma_n, wg_col, wq, lane);
        } else {
          unsigned char* const buf = s_epilogue[warp - 4];
          ws::store_tile_smem<T, kMode>(acc, args, out, t.row_begin, t.rows, mma_n, wg_col, wq, lane, smem_u32(buf),
                                        buf);
        }
      }
    }
  }
#endif
}

// --- Host side (grouped_gemm_wgmma_ws.cu, grouped_gemm_wgmma_ws_mxfp4.cu).

// A 2-D TMA map over a bf16/f16 matrix [rows][k] (the stacked weights [E * N][k], or the rows A), boxes of 64 k x
// box_rows rows in the 128B swizzle (grouped_gemm_wgmma_ws.cu), fetched 256 bytes per L2 miss where `promote`.
// Throws latentmoe::Error naming `what` when the driver refuses it.
CUtensorMap wgmma_ws_tensor_map(DType dtype, const void* base, int64_t rows, int64_t k, int box_rows, bool promote,
                                const char* what);

template <class T, class Cfg, Mode kMode, bool kMxfp4>
void launch_wgmma_ws_mode(DType dtype, KernelArgs args, const MmaLaunch& launch, cudaStream_t stream) {
  static std::atomic<uint64_t> done_mask{0};
  auto kernel = grouped_wgmma_ws_kernel<T, Cfg, kMode, kMxfp4>;
  ensure_smem_limit(reinterpret_cast<const void*>(kernel), Cfg::smem_bytes(kMxfp4, Cfg::kMaxExperts), &done_mask);
  const int out_per_tile = kMode == Mode::gated ? Cfg::kWeightRows / 2 : Cfg::kWeightRows;
  args.n_tiles = (args.n + out_per_tile - 1) / out_per_tile;
  args.n_tiles_per_cta = 1;
  args.n_groups = args.n_tiles;
  args.trigger_dependents = launch.trigger;
  args.wait_before_tile = true;  // the kernel waits before it reads anything
  // GemmChoice::option bits, for comparison: 1 the register epilogue, 2 the rows by cp.async even where they are
  // contiguous; 4, 8 and 16 the weights' L2 handling (detail::ws_weight_l2, grouped_gemm_wgmma_ws.cu).
  const int option = launch.variant_option;
  const detail::WsWeightL2 weight_l2 = detail::ws_weight_l2(option, args.k);
  args.ws_register_epilogue = (option & 1) != 0 ? 1 : 0;
  args.ws_weights_normal = weight_l2.normal_priority ? 1 : 0;
  // Exactly the instances that compile the rows by TMA (the kernel's x_tma): plain mode, bf16/f16 weights.
  args.ws_x_tma = kMode == Mode::plain && !kMxfp4 && args.sorted_pairs == nullptr && (option & 2) == 0 ? 1 : 0;
  const int64_t stacked_rows = static_cast<int64_t>(args.num_experts) * args.n;
  LATENTMOE_CHECK(stacked_rows + Cfg::kWeightRows < (int64_t{1} << 31), "grouped GEMM (wgmma_ws): ", args.num_experts,
                  " experts x ", args.n, " weight rows exceed the kernel's 32-bit row coordinates");
  CUtensorMap map0{}, map1{};  // MXFP4: unused (the producer copies and decodes the codes)
  if constexpr (!kMxfp4) {
    constexpr int kBoxRows = Cfg::box_rows(kMode == Mode::gated);
    map0 = wgmma_ws_tensor_map(dtype, args.w0, stacked_rows, args.k, kBoxRows, weight_l2.promote, "weights");
    map1 = kMode == Mode::gated
               ? wgmma_ws_tensor_map(dtype, args.w1, stacked_rows, args.k, kBoxRows, weight_l2.promote, "weights")
               : map0;
  }
  // The contiguous rows: A holds max_rows rows (act_rows [T * top_k, k]; grouped_gemm.h); rows past them read as
  // zeros.
  CUtensorMap map_x{};
  if (args.ws_x_tma) map_x = wgmma_ws_tensor_map(dtype, args.a, launch.max_rows, args.k, Cfg::kXBoxRows, true, "rows");
  // Tiles: at most the host bound on row tiles times the n-tiles; one CTA per SM, fewer when the bound is smaller,
  // or when launch.n_tiles_per_cta asks for at least that many tiles per CTA (the tests' many-tiles-per-CTA case).
  const int64_t tiles_bound = tile_entries_bound(launch.max_rows, args.num_experts, Cfg::kBlockM) * args.n_tiles;
  LATENTMOE_CHECK(tiles_bound < (int64_t{1} << 31), "grouped GEMM (wgmma_ws): too many tiles (", tiles_bound, ")");
  int64_t grid = std::min<int64_t>(tiles_bound, std::max(1, launch.sm_count));
  if (launch.n_tiles_per_cta > 0) {
    grid = std::min<int64_t>(grid, (tiles_bound + launch.n_tiles_per_cta - 1) / launch.n_tiles_per_cta);
  }
  grid = std::max<int64_t>(grid, 1);
  launch_kernel("grouped GEMM (wgmma_ws kernel)", launch.programmatic, kernel, dim3(static_cast<unsigned>(grid)),
                dim3(Cfg::kThreads), Cfg::smem_bytes(kMxfp4, args.num_experts), stream, map0, map1, map_x, args);
}

template <class T, class Cfg, bool kMxfp4>
void launch_wgmma_ws_typed(DType dtype, Mode mode, const KernelArgs& args, const MmaLaunch& launch,
                           cudaStream_t stream) {
  switch (mode) {
    case Mode::gated:
      return launch_wgmma_ws_mode<T, Cfg, Mode::gated, kMxfp4>(dtype, args, launch, stream);
    case Mode::relu2:
      return launch_wgmma_ws_mode<T, Cfg, Mode::relu2, kMxfp4>(dtype, args, launch, stream);
    case Mode::plain:
      return launch_wgmma_ws_mode<T, Cfg, Mode::plain, kMxfp4>(dtype, args, launch, stream);
  }
}

// Per tile shape (the arguments checked by launch_wgmma_ws): bf16/f16 weights in grouped_gemm_wgmma_ws.cu (wide)
// and grouped_gemm_wgmma_ws_tall.cu (tall); MXFP4 weights in grouped_gemm_wgmma_ws_mxfp4.cu (both shapes).
void launch_wgmma_ws_wide(DType dtype, Mode mode, const KernelArgs& args, const MmaLaunch& launch, cudaStream_t stream);
void launch_wgmma_ws_tall(DType dtype, Mode mode, const KernelArgs& args, const MmaLaunch& launch, cudaStream_t stream);
void launch_wgmma_ws_mxfp4(DType dtype, WgmmaWsShape shape, Mode mode, const KernelArgs& args, const MmaLaunch& launch,
                           cudaStream_t stream);

}  // namespace latentmoe::cuda::gg

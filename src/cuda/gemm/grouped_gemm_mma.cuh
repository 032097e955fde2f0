// The tensor-core grouped GEMM (sm_80 and later): mma.sync m16n8k16 with fp32 accumulators, operands
// staged through a cp.async pipeline of kStages shared-memory buffers (16-byte copies, zero-filled past
// the edges), XOR-swizzled so that ldmatrix reads are free of bank conflicts.
//
// Tiles. An m-tile is up to kBlockM rows of one expert (found on the device by find_tile); an n-tile is
// kBlockN weight rows (gated: kBlockN/2 gate rows and the kBlockN/2 up rows of the same output columns).
// One CTA computes one m-tile against args.n_tiles_per_cta consecutive n-tiles, as one pipeline over
// (n-tile, k-tile) steps: with a short k (the down projection) the copies of the next n-tile are in flight
// while the current one is finished. The grid is 1-D, n-tile groups fastest: the CTAs that read the same
// activation rows run together and find them in L2, and so do those that read the same expert's weights
// for its several m-tiles. The grid is the host's upper bound; CTAs without a tile exit.
//
// Warps tile the CTA kWarpsM x kWarpsN. Each warp skips the 16-row sub-tiles that hold no valid row,
// so a CTA with one row does 1/8 of the tensor work of a full one: small-M tiles stay weight-streaming.
// Every warp holds the gate and up accumulators of the same output columns and applies the activation
// in registers.
//
// MXFP4 weights (kMxfp4): the B operand is the experts' packed E2M1 codes and E8M0 scales. A thread
// owns whole scale groups of the B tile (16 code bytes, 32 values of one weight row): it copies each
// one's codes (16 bytes) and the aligned 4-byte word holding its scale byte with cp.async into a ring
// of kStages raw stages, as the bf16 kernel copies its weights, kStages - 1 steps ahead. At the end of
// step s, once its own copies of step s + 1 have landed (a thread's cp.async data is visible to it
// after its own wait, so no barrier), it decodes them (mxfp4_decode8: exact values times the group's
// power of two) into the swizzled bf16 tile (s + 1) % 2 of a double buffer, which every warp finished
// reading in step s - 1; the barrier at the top of step s + 1 publishes it. From there on the MMAs are
// the bf16 kernel's. The decode of step 0 runs at the end of the prologue. The raw ring is per
// thread (nobody reads another's groups), so it needs no barrier either.
//
// The pushing dense GEMM (kPush; tier 0's up-projection above the skinny kernels, dense_push_gemm.h): one
// matrix of args.dense_rows rows instead of experts (m-tile e covers rows [e kBlockM, (e + 1) kBlockM)),
// and an epilogue that adds the shared shard (args.addend) to each pair of results and stores the pair
// into every rank's receive region of the group's next all-gather, in the slot the rank's epoch names
// (read after the wait on the previous kernel, the collective that advanced it). With split-K only the
// last CTA of a tile pushes, once, the sum of all splits in split order: every element is stored once
// per peer, as the all-gather's send step would, and the bits do not depend on which CTA came last.
//
// Programmatic dependent launch (sm_90): the gate/up kernel lets the down kernel launch early; the down
// kernel finds its tile and starts streaming its weights (which no earlier kernel writes) before
// griddepcontrol.wait, and reads activation rows and writes its output only after it. Without the
// launch attribute both instructions are no-ops.
#pragma once

#include "cuda/comm/lamport_device.cuh"
#include "cuda/common/pdl.cuh"
#include "cuda/gemm/grouped_gemm_common.cuh"
#include "cuda/gemm/mxfp4_device.cuh"

namespace latentmoe::cuda::gg {

template <int kBlockM_, int kBlockN_, int kBlockK_, int kWarpsM_, int kWarpsN_, int kStages_, int kMinBlocks_>
struct MmaConfig {
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;  // weight rows per CTA (gated: half gate, half up)
  static constexpr int kBlockK = kBlockK_;
  static constexpr int kWarpsM = kWarpsM_;
  static constexpr int kWarpsN = kWarpsN_;
  static constexpr int kStages = kStages_;
  static constexpr int kMinBlocks = kMinBlocks_;  // CTAs per SM the register budget must allow
  static constexpr int kThreads = kWarpsM * kWarpsN * 32;
  static constexpr int kSmemBytes = kStages * (kBlockM + kBlockN) * kBlockK * 2;
  // MXFP4 weights: A's stages, a double-buffered bf16 B tile, and the raw ring (per scale group 16 code
  // bytes and a 4-byte scale word).
  static constexpr int kSmemBytesMxfp4 =
      kStages * kBlockM * kBlockK * 2 + 2 * kBlockN * kBlockK * 2 + kStages * (kBlockN * kBlockK / 32) * 20;
  static_assert(kBlockK % 64 == 0, "the swizzle needs rows of at least 8 16-byte chunks");
  static_assert(kBlockM % (16 * kWarpsM) == 0, "warp rows must be whole 16-row sub-tiles");
  static_assert(kBlockN % (16 * kWarpsN) == 0, "warp columns must be whole pairs of 8-column tiles");
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}
// Weights: streamed once, so marked evict-first in L2 (the activation rows that every n-tile CTA of an
// m-tile re-reads stay cached instead), and fetched 256 bytes per L2 miss (longer DRAM bursts).
__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}
// The weights of an expert whose rows span several m-tiles are read by each of those tiles' CTAs, which the
// grids run side by side (the m-tiles of one expert are numbered consecutively): at normal priority, so that
// the L2 still holds them when the sibling tile asks, instead of a second read from DRAM.
__device__ __forceinline__ uint64_t weight_policy_for(int expert_rows, int block_m) {
  if (expert_rows <= block_m) return evict_first_policy();
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}
__device__ __forceinline__ void cp_async_16_stream(uint32_t dst, const void* src, bool valid, uint64_t policy) {
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::256B [%0], [%1], 16, %2, %3;\n" ::"r"(dst), "l"(src),
               "r"(bytes), "l"(policy));
}
// 16 bytes of weights (the decode GEMV, gemv.cu; the MXFP4 pair kernels, mxfp4_pairs.cu): not allocated in L1,
// evict-first in L2. A weak ld.global, not ld.global.nc: with .nc (LDG.CONSTANT) ptxas scheduled the wait (ACQBULK)
// above these loads, which would start the stream only after the previous kernel; weak loads keep their place before it
// (checked in the SASS of every instance). volatile: the compiler keeps them before pdl_wait() (whose asm clobbers
// memory).
__device__ __forceinline__ uint4 stream_load(const uint4* pointer, uint64_t policy) {
  uint4 v;
  asm volatile("ld.global.L1::no_allocate.L2::cache_hint.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4], %5;\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(pointer), "l"(policy));
  return v;
}
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, bool valid) {
  const int bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}
// The same copies with an L2 prefetch size: on an L2 miss the L2 fetches kL2Bytes (0: no hint, 128 or 256)
// around the copied bytes from DRAM, so a warp reading a few bytes of many rows gets longer DRAM bursts.
template <int kL2Bytes>
__device__ __forceinline__ void cp_async_16_prefetch(uint32_t dst, const void* src, bool valid) {
  static_assert(kL2Bytes == 0 || kL2Bytes == 128 || kL2Bytes == 256, "L2 prefetch sizes: 0, 128, 256");
  const int bytes = valid ? 16 : 0;
  if constexpr (kL2Bytes == 256) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
  } else if constexpr (kL2Bytes == 128) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
  } else {
    cp_async_16(dst, src, valid);
  }
}
template <int kL2Bytes>
__device__ __forceinline__ void cp_async_4_prefetch(uint32_t dst, const void* src, bool valid) {
  static_assert(kL2Bytes == 0 || kL2Bytes == 128 || kL2Bytes == 256, "L2 prefetch sizes: 0, 128, 256");
  const int bytes = valid ? 4 : 0;
  if constexpr (kL2Bytes == 256) {
    asm volatile("cp.async.ca.shared.global.L2::256B [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
  } else if constexpr (kL2Bytes == 128) {
    asm volatile("cp.async.ca.shared.global.L2::128B [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
  } else {
    cp_async_4(dst, src, valid);
  }
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

template <class T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16816<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats rounded to T, the first in the low half (the lower address).
template <class T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Element offset of 16-byte chunk `chunk` of row `row` in a [rows][kBlockK] swizzled tile.
template <int kBlockK>
__device__ __forceinline__ int swizzle(int row, int chunk) {
  return row * kBlockK + ((chunk ^ (row & 7)) << 3);
}

// kPush (Mode::plain, bf16/f16 weights only): the pushing dense GEMM of dense_push_gemm.h (the file comment).
template <class T, class Cfg, Mode kMode, bool kMxfp4 = false, bool kPush = false>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocks) grouped_mma_kernel(const KernelArgs args) {
  static_assert(!kPush || (kMode == Mode::plain && !kMxfp4), "the push epilogue is the dense plain GEMM's");
  constexpr int kBM = Cfg::kBlockM;
  constexpr int kBN = Cfg::kBlockN;
  constexpr int kBK = Cfg::kBlockK;
  constexpr int kThreads = Cfg::kThreads;
  constexpr int kStages = Cfg::kStages;
  constexpr int kChunksK = kBK / 8;
  constexpr int kWarpM = kBM / Cfg::kWarpsM;  // rows per warp
  constexpr int kWarpN = kBN / Cfg::kWarpsN;  // weight rows per warp
  constexpr int kMt = kWarpM / 16;            // 16-row sub-tiles per warp
  constexpr int kNt = kWarpN / 8;             // 8-column tiles per warp (gated: first half gate, then up)
  constexpr bool kGated = kMode == Mode::gated;
  constexpr int kOutPerTile = kGated ? kBN / 2 : kBN;  // output columns per n-tile

  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* s_a = reinterpret_cast<T*>(smem_raw);  // [kStages][kBM][kBK]
  T* s_b = s_a + kStages * kBM * kBK;       // [kStages][kBN][kBK] (MXFP4: [2][kBN][kBK])
  // MXFP4 only: the raw ring, [kStages][kBN * kBK / 32] groups of 16 code bytes, then as many scale words.
  constexpr int kGroupsK = kBK / 32;
  constexpr int kUnits = kBN * kGroupsK;  // scale groups per B tile
  unsigned char* s_raw = reinterpret_cast<unsigned char*>(s_b + (kMxfp4 ? 2 : kStages) * kBN * kBK);
  __shared__ TileInfo s_tile;
  __shared__ int s_scan[kThreads / 32];
  __shared__ int s_row_src[kBM];
  __shared__ int s_is_last;

  // Programmatic dependent launch (src/cuda/common/pdl.cuh). A kernel whose tiles come from the kernel just
  // before it (gate/up after the layout) waits before it looks them up; the other (down) finds
  // their tile and stream their first weight stages first. Every CTA waits before it exits, and
  // triggers the next kernel only after its own wait.
  if (args.wait_before_tile) {
    pdl_wait();
    if (args.trigger_dependents) pdl_trigger();
  }

  // blockIdx.x = (entry * n_groups + group) * k_splits + split: the splits of one output tile and the
  // n-tile groups of one m-tile run together.
  const int split = blockIdx.x % args.k_splits;
  const int tile_index = blockIdx.x / args.k_splits;
  const int groups = args.n_groups;
  const int entry = tile_index / groups;
  const int group = tile_index - entry * groups;
  bool found;
  if constexpr (kPush) {
    // Dense: m-tile `entry` of the one matrix of dense_rows rows.
    found = entry * kBM < args.dense_rows;
    if (threadIdx.x == 0) s_tile = TileInfo{0, entry * kBM, min(args.dense_rows, (entry + 1) * kBM), args.dense_rows};
    __syncthreads();
  } else {
    found = find_tile<kThreads>(args.expert_offsets, args.num_experts, kBM, entry, &s_tile, s_scan);
  }
  if (!found) {
    pdl_wait();
    return;
  }

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int warp_m = warp / Cfg::kWarpsN;
  const int warp_n = warp % Cfg::kWarpsN;
  const int expert = s_tile.expert;
  const int row_begin = s_tile.row_begin;
  const int rows = s_tile.row_end - row_begin;
  const int rows16 = (rows + 15) & ~15;
  const int n = args.n;
  const int k = args.k;
  const int nt_first = group * args.n_tiles_per_cta;
  const int nt_count = min(args.n_tiles_per_cta, args.n_tiles - nt_first);
  // This CTA's k-tiles: [kt_first, kt_first + num_k_tiles) (all of them without split-K).
  const int total_k_tiles = (k + kBK - 1) / kBK;
  const int kt_first = args.k_splits > 1 ? split * args.k_tiles_per_split : 0;
  const int num_k_tiles = args.k_splits > 1 ? min(args.k_tiles_per_split, total_k_tiles - kt_first) : total_k_tiles;
  const int num_steps = nt_count * num_k_tiles;

  const T* a_base = static_cast<const T*>(args.a);
  const size_t expert_stride = static_cast<size_t>(n) * k;
  const T* w0 = static_cast<const T*>(args.w0) + expert * expert_stride;
  const T* w1 = kGated ? static_cast<const T*>(args.w1) + expert * expert_stride : nullptr;

  // Per-thread B copies: a fixed 16-byte chunk of tile rows row0, row0 + kRowStep, ...; the n-tile
  // moves the weight row, the k-tile the offset along it.
  constexpr int kBChunks = kBN * kChunksK;
  static_assert(kBChunks % kThreads == 0 && kThreads % kChunksK == 0, "B tile copies must divide evenly");
  constexpr int kBIters = kBChunks / kThreads;
  constexpr int kRowStep = kThreads / kChunksK;
  const int b_row0 = tid / kChunksK;
  const int b_chunk = tid % kChunksK;
  const T* b_gate_or_w = w0 + b_chunk * 8;
  const T* b_up = kGated ? w1 + b_chunk * 8 : nullptr;
  const int b_k_offset = b_chunk * 8;
  const uint32_t s_a_u32 = smem_u32(s_a);
  const uint32_t s_b_u32 = smem_u32(s_b);
  const uint64_t weight_policy = weight_policy_for(s_tile.expert_rows, kBM);

  // MXFP4 (the file comment): this thread's scale groups of the B tile, copied raw, decoded later.
  const uint8_t* c_gate_or_w = nullptr;
  const uint8_t* c_up = nullptr;
  const uint8_t* sc_gate_or_w = nullptr;
  const uint8_t* sc_up = nullptr;
  if constexpr (kMxfp4) {
    static_assert(kUnits % kThreads == 0, "B tile scale groups must divide evenly over the threads");
    const size_t codes_stride = static_cast<size_t>(n) * (k / 2), scales_stride = static_cast<size_t>(n) * (k / 32);
    c_gate_or_w = static_cast<const uint8_t*>(args.w0) + expert * codes_stride;
    sc_gate_or_w = args.s0 + expert * scales_stride;
    if (kGated) {
      c_up = static_cast<const uint8_t*>(args.w1) + expert * codes_stride;
      sc_up = args.s1 + expert * scales_stride;
    }
  }
  const uint32_t s_raw_u32 = smem_u32(s_raw);
  // Unit u = tid + i * kThreads: tile row u / kGroupsK, scale group u % kGroupsK of the k-tile. Calls
  // f(i, row, group, col, kk, ok) for step `step`'s units of this thread.
  auto for_each_unit = [&](int step, auto&& f) {
    const int nt = step / num_k_tiles;
    const int k0 = (kt_first + step - nt * num_k_tiles) * kBK;
    const int n0 = (nt_first + nt) * kOutPerTile;
#pragma unroll
    for (int i = 0; i < kUnits / kThreads; ++i) {
      const int u = tid + i * kThreads;
      const int row = u / kGroupsK, group = u % kGroupsK;
      const bool is_up = kGated && row >= kBN / 2;
      const int col = n0 + (is_up ? row - kBN / 2 : row);
      const int kk = k0 + group * 32;
      f(i, row, group, is_up, col, kk, kk < k && col < n);
    }
  };
  auto copy_raw = [&](int stage, int step) {
    for_each_unit(step, [&](int i, int, int, bool is_up, int col, int kk, bool ok) {
      const int u = tid + i * kThreads;
      const uint8_t* codes = (is_up ? c_up : c_gate_or_w) + static_cast<size_t>(col) * (k / 2) + kk / 2;
      cp_async_16_stream(s_raw_u32 + (stage * kUnits + u) * 16, ok ? codes : c_gate_or_w, ok, weight_policy);
      // The scale byte's aligned word (it never reaches past the byte, so never past the array).
      const uintptr_t scale =
          reinterpret_cast<uintptr_t>((is_up ? sc_up : sc_gate_or_w) + static_cast<size_t>(col) * (k / 32) + kk / 32);
      cp_async_4(s_raw_u32 + kStages * kUnits * 16 + (stage * kUnits + u) * 4,
                 ok ? reinterpret_cast<const void*>(scale & ~uintptr_t{3}) : c_gate_or_w, ok);
    });
  };
  auto decode_raw = [&](int stage, int step) {
    for_each_unit(step, [&](int i, int row, int group, bool is_up, int col, int kk, bool) {
      const int u = tid + i * kThreads;
      const uint4 codes = *reinterpret_cast<const uint4*>(s_raw + (stage * kUnits + u) * 16);
      const uint32_t word =
          *reinterpret_cast<const uint32_t*>(s_raw + kStages * kUnits * 16 + (stage * kUnits + u) * 4);
      const uintptr_t scale =
          reinterpret_cast<uintptr_t>((is_up ? sc_up : sc_gate_or_w) + static_cast<size_t>(col) * (k / 32) + kk / 32);
      const uint32_t scale_byte = (word >> ((scale & 3) * 8)) & 0xFFu;
      T* tile = s_b + (step % 2) * kBN * kBK;
      const uint32_t words[4] = {codes.x, codes.y, codes.z, codes.w};
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        *reinterpret_cast<uint4*>(tile + swizzle<kBK>(row, group * 4 + c)) = mxfp4_decode8<T>(words[c], scale_byte);
      }
    });
  };
  auto load_b = [&](int stage, int step) {
    const int nt = step / num_k_tiles;
    const int k0 = (kt_first + step - nt * num_k_tiles) * kBK;
    const int n0 = (nt_first + nt) * kOutPerTile;
    const bool k_ok = k0 + b_k_offset < k;
#pragma unroll
    for (int it = 0; it < kBIters; ++it) {
      const int row = b_row0 + it * kRowStep;
      const bool is_up = kGated && row >= kBN / 2;
      const int col = n0 + (is_up ? row - kBN / 2 : row);
      const bool ok = k_ok && col < n;
      const T* src = (is_up ? b_up : b_gate_or_w) + static_cast<size_t>(col) * k + k0;
      cp_async_16_stream(s_b_u32 + (stage * kBN * kBK + swizzle<kBK>(row, b_chunk)) * 2, ok ? src : w0, ok,
                         weight_policy);
    }
  };
  // A: only rows of 16-row sub-tiles that hold valid rows (the others are never read).
  auto load_a = [&](int stage, int step) {
    const int k0 = (kt_first + step % num_k_tiles) * kBK;
    for (int c = tid; c < rows16 * kChunksK; c += kThreads) {
      const int row = c / kChunksK;
      const int chunk = c % kChunksK;
      const int src = s_row_src[row];
      const int kk = k0 + chunk * 8;
      const bool ok = src >= 0 && kk < k;
      cp_async_16(s_a_u32 + (stage * kBM * kBK + swizzle<kBK>(row, chunk)) * 2,
                  ok ? a_base + static_cast<size_t>(src) * k + kk : a_base, ok);
    }
  };

  // Prologue. The weights need only the expert, so their first stages go out before the row indices
  // are read and before the wait on the previous kernel (one group per stage); then the rows and the
  // A stages (one group).
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < num_steps) {
      if constexpr (kMxfp4) {
        copy_raw(s, s);
      } else {
        load_b(s, s);
      }
    }
    cp_async_commit();
  }
  if (!args.wait_before_tile) {
    pdl_wait();
    if (args.trigger_dependents) pdl_trigger();
  }
  // The push's slot: the previous collective of the stream (complete after the wait) advanced the epoch.
  const int push_slot = kPush ? lamport::next_slot(args.push) : 0;
  for (int i = tid; i < kBM; i += kThreads) {
    int src = -1;
    if (i < rows) {
      const int r = row_begin + i;
      src = args.sorted_pairs != nullptr ? __ldg(args.sorted_pairs + r) / args.top_k : r;
    }
    s_row_src[i] = src;
  }
  __syncthreads();
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < num_steps) load_a(s, s);
  }
  cp_async_commit();
  if constexpr (kMxfp4) {
    // Step 0's weights, decoded by the threads that copied them; the first barrier publishes them.
    if (num_steps > 0) {
      cp_async_wait<0>();
      decode_raw(0, 0);
    }
  }

  float acc[kMt][kNt][4];
  auto zero_accumulators = [&] {
#pragma unroll
    for (int i = 0; i < kMt; ++i)
#pragma unroll
      for (int j = 0; j < kNt; ++j)
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.0f;
  };
  zero_accumulators();

  // Sub-tiles of this warp that hold valid rows (warp-uniform).
  const int warp_row0 = warp_m * kWarpM;
  const int mt_valid = max(0, min(kMt, (rows - warp_row0 + 15) / 16));

  // Smem row of this warp's 8-column tile j (gated: tiles [0, kNt/2) gate, [kNt/2, kNt) up).
  auto b_tile_row = [&](int j) {
    if (kGated) {
      constexpr int kHalf = kNt / 2;
      return j < kHalf ? warp_n * (kWarpN / 2) + j * 8 : kBN / 2 + warp_n * (kWarpN / 2) + (j - kHalf) * 8;
    }
    return warp_n * kWarpN + j * 8;
  };

  T* out = static_cast<T*>(args.out);
  constexpr int kOutTiles = kGated ? kNt / 2 : kNt;
  // Byte offsets of the smem rows this lane's ldmatrix addresses point at (before the column chunk).
  const uint32_t a_lane_row = (warp_row0 + (lane & 15)) * kBK * 2;
  uint32_t b_lane_row[kNt / 2];
#pragma unroll
  for (int j = 0; j < kNt; j += 2) b_lane_row[j / 2] = (b_tile_row(j + (lane >> 4)) + (lane & 7)) * kBK * 2;

  for (int nt = 0; nt < nt_count; ++nt) {
    for (int kt = 0; kt < num_k_tiles; ++kt) {
      const int step = nt * num_k_tiles + kt;
      // Step `step` is complete when at most kStages - 2 later groups are pending; the first waits for
      // the whole prologue (its A group was committed last).
      if (step == 0) {
        cp_async_wait<0>();
      } else {
        cp_async_wait<kStages - 2>();
      }
      __syncthreads();
      {
        const int next = step + kStages - 1;
        if (next < num_steps) {
          if constexpr (kMxfp4) {
            copy_raw(next % kStages, next);
          } else {
            load_b(next % kStages, next);
          }
          load_a(next % kStages, next);
        }
        cp_async_commit();
      }
      if (mt_valid > 0) {
        const int stage = step % kStages;
        const uint32_t a_stage = s_a_u32 + stage * kBM * kBK * 2 + a_lane_row;
        const uint32_t b_stage = s_b_u32 + (kMxfp4 ? step % 2 : stage) * kBN * kBK * 2;
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk) {
          // Every row a lane addresses is congruent to lane mod 8, so the swizzled chunk depends on kk and
          // the lane only: one XOR per operand and k-step.
          const uint32_t a_col = static_cast<uint32_t>(((kk * 2) | (lane >> 4)) ^ (lane & 7)) << 4;
          const uint32_t b_col = static_cast<uint32_t>(((kk * 2) | ((lane >> 3) & 1)) ^ (lane & 7)) << 4;
          uint32_t bfrag[kNt][2];
#pragma unroll
          for (int j = 0; j < kNt; j += 2) {
            // Two 8-column tiles: matrices (j, k0-7), (j, k8-15), (j+1, k0-7), (j+1, k8-15).
            ldmatrix_x4(b_stage + b_lane_row[j / 2] + b_col, bfrag[j][0], bfrag[j][1], bfrag[j + 1][0],
                        bfrag[j + 1][1]);
          }
#pragma unroll
          for (int i = 0; i < kMt; ++i) {
            if (i < mt_valid) {
              uint32_t afrag[4];
              ldmatrix_x4(a_stage + i * 16 * kBK * 2 + a_col, afrag[0], afrag[1], afrag[2], afrag[3]);
#pragma unroll
              for (int j = 0; j < kNt; ++j) mma_16816<T>(acc[i][j], afrag, bfrag[j][0], bfrag[j][1]);
            }
          }
        }
      }
      if constexpr (kMxfp4) {
        // Step + 1's raw groups were committed kStages - 2 groups ago: wait for them, decode them.
        if (step + 1 < num_steps) {
          cp_async_wait<kStages - 2>();
          decode_raw((step + 1) % kStages, step + 1);
        }
      }
    }
    // After the last k-tile of n-tile nt: accumulator (i, j, q) is row warp_row0 + 16i + lane/4 (+8 for q >= 2),
    // column 8j + 2(lane%4) (+1 for odd q) of the warp's tile. Stored while the next n-tile's copies fly.
    const int out_col_warp = (nt_first + nt) * kOutPerTile + warp_n * (kGated ? kWarpN / 2 : kWarpN);
    if (args.k_splits > 1) {
      // Split-K: publish this split's sums; the last CTA of the tile adds all splits in order.
      constexpr int kAccPerThread = kMt * kNt * 4;
      const size_t tile_base = static_cast<size_t>(tile_index) * args.k_splits;
      float* mine = args.partials + (tile_base + split) * (kAccPerThread * kThreads);
#pragma unroll
      for (int i = 0; i < kMt; ++i)
#pragma unroll
        for (int j = 0; j < kNt; ++j)
#pragma unroll
          for (int q = 0; q < 4; ++q) __stcg(mine + ((i * kNt + j) * 4 + q) * kThreads + tid, acc[i][j][q]);
      __threadfence();
      __syncthreads();
      if (tid == 0) {
        const int arrived = atomicAdd(args.tile_counters + tile_index, 1);
        s_is_last = arrived == args.k_splits - 1;
        if (s_is_last) args.tile_counters[tile_index] = 0;  // ready for the next launch
      }
      __syncthreads();
      if (!s_is_last) break;  // uniform; nt_count is 1 with split-K
      __threadfence();
      zero_accumulators();
      // Unrolled so that the loads of four splits are in flight at once: one at a time, each split cost an
      // L2 round trip, and this CTA's reduction is the kernel's tail. The adds keep split order.
#pragma unroll 4
      for (int sp = 0; sp < args.k_splits; ++sp) {
        const float* part = args.partials + (tile_base + sp) * (kAccPerThread * kThreads);
#pragma unroll
        for (int i = 0; i < kMt; ++i)
#pragma unroll
          for (int j = 0; j < kNt; ++j)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[i][j][q] += __ldcg(part + ((i * kNt + j) * 4 + q) * kThreads + tid);
      }
    }
#pragma unroll
    for (int i = 0; i < kMt; ++i) {
      if (i >= mt_valid) continue;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = warp_row0 + i * 16 + (lane >> 2) + half * 8;
        if (row >= rows) continue;
        T* out_row = out + static_cast<size_t>(row_begin + row) * n;
#pragma unroll
        for (int j = 0; j < kOutTiles; ++j) {
          const int col = out_col_warp + j * 8 + 2 * (lane & 3);
          if (col >= n) continue;  // n is a multiple of 8 on this path, so col + 1 < n too
          float v0, v1;
          if (kMode == Mode::gated) {
            v0 = gated_act<true>(acc[i][j][half * 2 + 0], acc[i][j + kOutTiles][half * 2 + 0], args);
            v1 = gated_act<true>(acc[i][j][half * 2 + 1], acc[i][j + kOutTiles][half * 2 + 1], args);
          } else if (kMode == Mode::relu2) {
            v0 = act::relu2(acc[i][j][half * 2 + 0]);
            v1 = act::relu2(acc[i][j][half * 2 + 1]);
          } else {
            v0 = acc[i][j][half * 2 + 0];
            v1 = acc[i][j][half * 2 + 1];
          }
          if constexpr (kPush) {
            const T* addend =
                static_cast<const T*>(args.addend) + static_cast<int64_t>(row_begin + row) * args.ld_addend;
            v0 += to_float(addend[col]);
            v1 += to_float(addend[col + 1]);
            lamport::push_all_gather_pair<T>(args.push, push_slot, n, row_begin + row, col, from_float<T>(v0),
                                             from_float<T>(v1));
            continue;
          }
          *reinterpret_cast<uint32_t*>(out_row + col) = pack2<T>(v0, v1);
        }
      }
    }
    zero_accumulators();
  }
  cp_async_wait<0>();
}

}  // namespace latentmoe::cuda::gg

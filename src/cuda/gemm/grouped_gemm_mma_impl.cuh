// Instantiates the tensor-core variants for one element type (grouped_gemm_mma_{bf16,f16}.cu).
#pragma once

#include <algorithm>
#include <atomic>

#include "cuda/gemm/grouped_gemm_launch.cuh"
#include "cuda/gemm/grouped_gemm_mma.cuh"
#include "latentmoe/error.h"

namespace latentmoe::cuda::gg {

// The variants (block M, weight rows N, block K, warps M x N, stages). Shared memory per CTA in
// parentheses; docs/GROUPED_GEMM.md has the measurements that picked them.
using CfgS = MmaConfig<16, 64, 64, 1, 4, 6, 3>;       // 4 warps (60 KB, 3 CTAs/SM)
using CfgSWide = MmaConfig<16, 128, 64, 1, 4, 4, 3>;  // 4 warps (72 KB, 3 CTAs/SM)
using CfgSK128 = MmaConfig<16, 64, 128, 1, 4, 5, 2>;  // 4 warps (100 KB, 2 CTAs/SM)
using CfgM32 = MmaConfig<32, 128, 64, 2, 4, 5, 2>;    // 8 warps (100 KB, 2 CTAs/SM)
using CfgM = MmaConfig<64, 128, 64, 2, 4, 4, 2>;      // 8 warps (96 KB, 2 CTAs/SM)
using CfgL4 = MmaConfig<96, 128, 64, 2, 4, 4, 2>;     // 8 warps (112 KB, 2 CTAs/SM)
using CfgL = MmaConfig<128, 128, 64, 2, 4, 3, 2>;     // 8 warps (96 KB, 2 CTAs/SM)
using CfgXL = MmaConfig<128, 256, 64, 2, 4, 3, 1>;    // 8 warps (144 KB, 1 CTA/SM)

template <class T, class Cfg, Mode kMode, bool kMxfp4 = false, bool kPush = false>
void launch_cfg(KernelArgs args, const MmaLaunch& launch, cudaStream_t stream) {
  static std::atomic<uint64_t> done_mask{0};
  auto kernel = grouped_mma_kernel<T, Cfg, kMode, kMxfp4, kPush>;
  constexpr int kSmem = kMxfp4 ? Cfg::kSmemBytesMxfp4 : Cfg::kSmemBytes;
  ensure_smem_limit(reinterpret_cast<const void*>(kernel), kSmem, &done_mask);
  const int out_per_tile = kMode == Mode::gated ? Cfg::kBlockN / 2 : Cfg::kBlockN;
  args.n_tiles = (args.n + out_per_tile - 1) / out_per_tile;
  const int num_k_tiles = (args.k + Cfg::kBlockK - 1) / Cfg::kBlockK;
  const int64_t entries = tile_entries_bound(launch.max_rows, args.num_experts, Cfg::kBlockM);

  // Split-K when the output tiles alone leave SMs idle (decode-sized batches).
  int k_splits = 1;
  if (launch.k_splits != 1 && launch.partials != nullptr) {
    // Expected CTAs: touched experts times the m-tiles of an average one, times the n-tiles.
    const int64_t touched = std::max<int64_t>(1, std::min<int64_t>(args.num_experts, launch.max_rows));
    const int64_t mean_rows = (launch.max_rows + touched - 1) / touched;
    const int64_t expected_ctas = touched * ((mean_rows + Cfg::kBlockM - 1) / Cfg::kBlockM) * args.n_tiles;
    const int64_t resident = int64_t{Cfg::kMinBlocks} * launch.sm_count;
    k_splits = launch.k_splits > 1 ? std::min(launch.k_splits, num_k_tiles)
                                   : detail::choose_k_splits(expected_ctas, num_k_tiles, resident);
    auto fits = [&](int splits) {
      const int64_t tiles = entries * args.n_tiles;
      return tiles <= launch.num_tile_counters &&
             static_cast<size_t>(tiles * splits) * Cfg::kBlockM * Cfg::kBlockN <= launch.partial_floats;
    };
    if (launch.k_splits > 1) {
      LATENTMOE_CHECK(fits(k_splits), "grouped GEMM: the split-K workspace is too small for ", k_splits, " splits of ",
                      entries * args.n_tiles, " tiles");
    } else {
      while (k_splits > 1 && !fits(k_splits)) --k_splits;
    }
  }
  if (k_splits > 1) {
    args.k_tiles_per_split = (num_k_tiles + k_splits - 1) / k_splits;
    args.k_splits = (num_k_tiles + args.k_tiles_per_split - 1) / args.k_tiles_per_split;  // none empty
    args.partials = launch.partials;
    args.tile_counters = launch.tile_counters;
    args.n_tiles_per_cta = 1;
  } else {
    args.k_splits = 1;
    args.n_tiles_per_cta = launch.n_tiles_per_cta > 0 ? std::min(launch.n_tiles_per_cta, args.n_tiles)
                                                      : choose_tiles_per_cta(args.n_tiles, num_k_tiles, Cfg::kStages,
                                                                             Cfg::kBlockM, launch, args.num_experts);
  }
  args.n_groups = (args.n_tiles + args.n_tiles_per_cta - 1) / args.n_tiles_per_cta;
  args.trigger_dependents = launch.trigger;
  args.wait_before_tile = launch.wait_before_tile;
  const int64_t blocks = entries * args.n_groups * args.k_splits;
  LATENTMOE_CHECK(blocks < (int64_t{1} << 31), "grouped GEMM: too many tiles (", blocks, ")");

  launch_kernel("grouped GEMM (tensor-core kernel)", launch.programmatic, kernel, dim3(static_cast<unsigned>(blocks)),
                dim3(Cfg::kThreads), kSmem, stream, args);
}

// kMxfp4: MXFP4 weights, instantiated for the three tile shapes the automatic choice maps every problem
// to (grouped_gemm.cu; the 128-row mma_l spilled with the MXFP4 copies, the 96-row mma_l4 does not).
template <class T, Mode kMode, bool kMxfp4>
void launch_variant(detail::GemmVariant variant, const KernelArgs& args, const MmaLaunch& launch, cudaStream_t stream) {
  using V = detail::GemmVariant;
  if constexpr (kMxfp4) {
    switch (variant) {
      case V::mma_s_wide:
        return launch_cfg<T, CfgSWide, kMode, true>(args, launch, stream);
      case V::mma_m:
        return launch_cfg<T, CfgM, kMode, true>(args, launch, stream);
      case V::mma_l4:
        return launch_cfg<T, CfgL4, kMode, true>(args, launch, stream);
      default:
        break;
    }
    ::latentmoe::detail::throw_error("grouped GEMM: variant ", detail::to_string(variant),
                                     " has no MXFP4 instance (mma_s_wide, mma_m, mma_l4)");
  } else {
    switch (variant) {
      case V::mma_s:
        return launch_cfg<T, CfgS, kMode>(args, launch, stream);
      case V::mma_s_wide:
        return launch_cfg<T, CfgSWide, kMode>(args, launch, stream);
      case V::mma_s_k128:
        return launch_cfg<T, CfgSK128, kMode>(args, launch, stream);
      case V::mma_m32:
        return launch_cfg<T, CfgM32, kMode>(args, launch, stream);
      case V::mma_l4:
        return launch_cfg<T, CfgL4, kMode>(args, launch, stream);
      case V::mma_m:
        return launch_cfg<T, CfgM, kMode>(args, launch, stream);
      case V::mma_l:
        return launch_cfg<T, CfgL, kMode>(args, launch, stream);
      case V::mma_xl:
        return launch_cfg<T, CfgXL, kMode>(args, launch, stream);
      default:
        break;
    }
    ::latentmoe::detail::throw_error("grouped GEMM: variant ", detail::to_string(variant),
                                     " is not a tensor-core variant");
  }
}

template <class T, bool kMxfp4 = false>
void launch_mma(detail::GemmVariant variant, Mode mode, const KernelArgs& args, const MmaLaunch& launch,
                cudaStream_t stream) {
  switch (mode) {
    case Mode::gated:
      return launch_variant<T, Mode::gated, kMxfp4>(variant, args, launch, stream);
    case Mode::relu2:
      return launch_variant<T, Mode::relu2, kMxfp4>(variant, args, launch, stream);
    case Mode::plain:
      return launch_variant<T, Mode::plain, kMxfp4>(variant, args, launch, stream);
  }
}

}  // namespace latentmoe::cuda::gg

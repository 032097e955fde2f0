// Instantiates the tensor-core variants for one element type (grouped_gemm_mma_{bf16,f16}.cu).
#pragma once

#include <atomic>

#include "cuda/grouped_gemm_launch.h"
#include "cuda/grouped_gemm_mma.cuh"
#include "latentmoe/error.h"

namespace latentmoe::cuda::gg {

// The variants (block M, weight rows N, block K, warps M x N, stages). Shared memory per CTA in
// parentheses; docs/GROUPED_GEMM.md has the measurements that picked them.
using CfgS = MmaConfig<16, 64, 64, 1, 4, 6>;       // 4 warps (60 KB, 3 CTAs/SM)
using CfgSWide = MmaConfig<16, 128, 64, 1, 4, 4>;  // 4 warps (72 KB, 3 CTAs/SM)
using CfgSK128 = MmaConfig<16, 64, 128, 1, 4, 4>;  // 4 warps (80 KB, 2 CTAs/SM)
using CfgM = MmaConfig<64, 128, 64, 2, 4, 4>;      // 8 warps (96 KB, 2 CTAs/SM)
using CfgL = MmaConfig<128, 128, 64, 2, 4, 3>;     // 8 warps (96 KB, 2 CTAs/SM)
using CfgXL = MmaConfig<128, 256, 64, 2, 4, 3>;    // 8 warps (144 KB, 1 CTA/SM)

template <class T, class Cfg, Mode kMode>
void launch_cfg(const KernelArgs& args, int64_t max_rows, cudaStream_t stream) {
  static std::atomic<uint64_t> done_mask{0};
  auto kernel = grouped_mma_kernel<T, Cfg, kMode>;
  ensure_smem_limit(reinterpret_cast<const void*>(kernel), Cfg::kSmemBytes, &done_mask);
  const int out_per_cta = kMode == Mode::gated ? Cfg::kBlockN / 2 : Cfg::kBlockN;
  const int64_t entries = tile_entries_bound(max_rows, args.num_experts, Cfg::kBlockM);
  const dim3 grid(static_cast<unsigned>(entries), static_cast<unsigned>((args.n + out_per_cta - 1) / out_per_cta));
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(args);
  check_launch("grouped GEMM (tensor-core kernel)");
}

template <class T, Mode kMode>
void launch_variant(detail::GemmVariant variant, const KernelArgs& args, int64_t max_rows, cudaStream_t stream) {
  using V = detail::GemmVariant;
  switch (variant) {
    case V::mma_s: return launch_cfg<T, CfgS, kMode>(args, max_rows, stream);
    case V::mma_s_wide: return launch_cfg<T, CfgSWide, kMode>(args, max_rows, stream);
    case V::mma_s_k128: return launch_cfg<T, CfgSK128, kMode>(args, max_rows, stream);
    case V::mma_m: return launch_cfg<T, CfgM, kMode>(args, max_rows, stream);
    case V::mma_l: return launch_cfg<T, CfgL, kMode>(args, max_rows, stream);
    case V::mma_xl: return launch_cfg<T, CfgXL, kMode>(args, max_rows, stream);
    default: break;
  }
  ::latentmoe::detail::throw_error("grouped GEMM: variant ", detail::to_string(variant), " is not a tensor-core variant");
}

template <class T>
void launch_mma(detail::GemmVariant variant, Mode mode, const KernelArgs& args, int64_t max_rows,
                cudaStream_t stream) {
  switch (mode) {
    case Mode::gated: return launch_variant<T, Mode::gated>(variant, args, max_rows, stream);
    case Mode::relu2: return launch_variant<T, Mode::relu2>(variant, args, max_rows, stream);
    case Mode::plain: return launch_variant<T, Mode::plain>(variant, args, max_rows, stream);
  }
}

}  // namespace latentmoe::cuda::gg

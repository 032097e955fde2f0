// The persistent, warp-specialised Hopper grouped GEMM (grouped_gemm_wgmma_ws.cuh) in its tall shape
// (GemmVariant::wgmma_ws_tall: up to 256 expert rows against 128 weight rows), bf16/f16 weights. Arguments checked
// by launch_wgmma_ws (grouped_gemm_wgmma_ws.cu). A file of its own so that the shapes compile in parallel.
#include "cuda/gemm/grouped_gemm_wgmma_ws.cuh"

namespace latentmoe::cuda::gg {

void launch_wgmma_ws_tall(DType dtype, Mode mode, const KernelArgs& args, const MmaLaunch& launch,
                          cudaStream_t stream) {
  if (dtype == DType::bf16) {
    launch_wgmma_ws_typed<__nv_bfloat16, WgmmaWsTallCfg, false>(dtype, mode, args, launch, stream);
  } else {
    launch_wgmma_ws_typed<__half, WgmmaWsTallCfg, false>(dtype, mode, args, launch, stream);
  }
}

}  // namespace latentmoe::cuda::gg

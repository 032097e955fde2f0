// The persistent, warp-specialised Hopper grouped GEMM (grouped_gemm_wgmma_ws.cuh) with MXFP4 weights: the producer
// warpgroup decodes the codes into the bf16/f16 weight stages. Both tile shapes. Arguments checked by
// launch_wgmma_ws.
#include "cuda/gemm/grouped_gemm_wgmma_ws.cuh"

namespace latentmoe::cuda::gg {

void launch_wgmma_ws_mxfp4(DType dtype, WgmmaWsShape shape, Mode mode, const KernelArgs& args, const MmaLaunch& launch,
                           cudaStream_t stream) {
  if (shape == WgmmaWsShape::tall) {
    if (dtype == DType::bf16) {
      launch_wgmma_ws_typed<__nv_bfloat16, WgmmaWsTallCfg, true>(dtype, mode, args, launch, stream);
    } else {
      launch_wgmma_ws_typed<__half, WgmmaWsTallCfg, true>(dtype, mode, args, launch, stream);
    }
  } else if (dtype == DType::bf16) {
    launch_wgmma_ws_typed<__nv_bfloat16, WgmmaWsMxfp4Cfg, true>(dtype, mode, args, launch, stream);
  } else {
    launch_wgmma_ws_typed<__half, WgmmaWsMxfp4Cfg, true>(dtype, mode, args, launch, stream);
  }
}

}  // namespace latentmoe::cuda::gg

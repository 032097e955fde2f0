// The Hopper grouped GEMM (sm_90a, warpgroup MMA) with MXFP4 weights: the weight tile decoded into shared
// memory each step (grouped_gemm_wgmma.cuh), bf16 and f16 activations.
#include "cuda/gemm/grouped_gemm_wgmma.cuh"
#include "cuda/gemm/grouped_gemm_wgmma_launch.cuh"
#include "latentmoe/error.h"

namespace latentmoe::cuda::gg {

void launch_wgmma_mxfp4(DType dtype, WgmmaShape shape, Mode mode, KernelArgs args, const MmaLaunch& launch,
                        cudaStream_t stream) {
  LATENTMOE_CHECK(dtype == DType::bf16 || dtype == DType::f16, "grouped GEMM (wgmma, MXFP4): dtype ", dtype_name(dtype),
                  " is not bf16 or f16");
  LATENTMOE_CHECK(detail::wgmma_available(), "grouped GEMM: the wgmma variant needs an sm_90 device and sm_90a code");
  LATENTMOE_CHECK(args.expert_offsets != nullptr && args.s0 != nullptr,
                  "grouped GEMM (wgmma, MXFP4): ", args.expert_offsets == nullptr ? "expert_offsets" : "the scales",
                  " missing");
  if (dtype == DType::bf16) {
    launch_wgmma_typed<__nv_bfloat16, true>(shape, mode, args, launch, stream);
  } else {
    launch_wgmma_typed<__half, true>(shape, mode, args, launch, stream);
  }
}

}  // namespace latentmoe::cuda::gg

// The tensor-core grouped GEMM variants with MXFP4 weights (bf16 and f16 activations).
#include "cuda/gemm/grouped_gemm_mma_impl.cuh"

namespace latentmoe::cuda::gg {

void launch_mma_mxfp4(DType dtype, detail::GemmVariant variant, Mode mode, KernelArgs args, const MmaLaunch& launch,
                      cudaStream_t stream) {
  if (dtype == DType::bf16) {
    launch_mma<__nv_bfloat16, true>(variant, mode, args, launch, stream);
  } else {
    launch_mma<__half, true>(variant, mode, args, launch, stream);
  }
}

}  // namespace latentmoe::cuda::gg

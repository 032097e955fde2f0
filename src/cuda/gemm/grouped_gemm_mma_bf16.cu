// The tensor-core grouped GEMM variants for bf16.
#include "cuda/gemm/grouped_gemm_mma_impl.cuh"

namespace latentmoe::cuda::gg {

void launch_mma_bf16(detail::GemmVariant variant, Mode mode, KernelArgs args, const MmaLaunch& launch,
                     cudaStream_t stream) {
  launch_mma<__nv_bfloat16>(variant, mode, args, launch, stream);
}

}  // namespace latentmoe::cuda::gg

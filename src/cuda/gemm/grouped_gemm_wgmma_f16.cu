// The Hopper grouped GEMM for f16 (grouped_gemm_wgmma.cuh).
#include "cuda/gemm/grouped_gemm_wgmma.cuh"
#include "cuda/gemm/grouped_gemm_wgmma_launch.cuh"

namespace latentmoe::cuda::gg {

void launch_wgmma_f16(WgmmaShape shape, Mode mode, const KernelArgs& args, const MmaLaunch& launch,
                      cudaStream_t stream) {
  launch_wgmma_typed<__half>(shape, mode, args, launch, stream);
}

}  // namespace latentmoe::cuda::gg

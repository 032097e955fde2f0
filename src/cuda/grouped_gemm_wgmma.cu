// The Hopper grouped GEMM (sm_90a). Placeholder until the kernel lands: reports itself unavailable.
#include "cuda/grouped_gemm_wgmma.h"
#include "latentmoe/error.h"

namespace latentmoe::cuda {
namespace detail {

bool wgmma_available() { return false; }

}  // namespace detail

namespace gg {

void launch_wgmma(DType dtype, Mode mode, KernelArgs args, const MmaLaunch& launch, cudaStream_t stream) {
  ::latentmoe::detail::throw_error("grouped GEMM: the wgmma variant is not built yet");
}

}  // namespace gg
}  // namespace latentmoe::cuda

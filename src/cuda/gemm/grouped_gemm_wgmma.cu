// The Hopper grouped GEMM (sm_90a): availability, the dtype dispatch and the bf16 kernels
// (grouped_gemm_wgmma.cuh; f16 in grouped_gemm_wgmma_f16.cu).
#include <array>
#include <atomic>

#include "cuda/common/device.h"
#include "cuda/gemm/grouped_gemm_wgmma.cuh"
#include "cuda/gemm/grouped_gemm_wgmma_launch.cuh"
#include "latentmoe/error.h"

namespace latentmoe::cuda {
namespace detail {

bool wgmma_available() {
  // Per device: 0 not yet known, 1 available, 2 not (the kernel's binary is checked once per device).
  static std::array<std::atomic<int>, 64> cache{};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= static_cast<int>(cache.size())) return false;
  int state = cache[device].load(std::memory_order_relaxed);
  if (state == 0) {
    bool ok = current_compute_capability() == 90;  // the device attribute cache of cuda/common/device.h
    if (ok) {
      // The kernel this device would run must be sm_90a machine code: code JIT-compiled from the portable
      // PTX (compute_80) has an empty body there.
      cudaFuncAttributes attr = {};
      const cudaError_t err = cudaFuncGetAttributes(
          &attr, reinterpret_cast<const void*>(gg::grouped_wgmma_kernel<__nv_bfloat16, gg::WgmmaCfg, gg::Mode::plain>));
      if (err != cudaSuccess) cudaGetLastError();  // not sticky: clear it so that no later check reports it
      ok = err == cudaSuccess && attr.binaryVersion == 90 && attr.ptxVersion >= 90;
    }
    state = ok ? 1 : 2;
    cache[device].store(state, std::memory_order_relaxed);
  }
  return state == 1;
}

}  // namespace detail

namespace gg {

void launch_wgmma_bf16(WgmmaShape shape, Mode mode, const KernelArgs& args, const MmaLaunch& launch,
                       cudaStream_t stream) {
  launch_wgmma_typed<__nv_bfloat16>(shape, mode, args, launch, stream);
}

void launch_wgmma(DType dtype, WgmmaShape shape, Mode mode, KernelArgs args, const MmaLaunch& launch,
                  cudaStream_t stream) {
  LATENTMOE_CHECK(dtype == DType::bf16 || dtype == DType::f16, "grouped GEMM (wgmma): dtype ", dtype_name(dtype),
                  " is not bf16 or f16");
  LATENTMOE_CHECK(detail::wgmma_available(), "grouped GEMM: the wgmma variant needs an sm_90 device and sm_90a code");
  LATENTMOE_CHECK(args.expert_offsets != nullptr, "grouped GEMM (wgmma): expert_offsets is null");
  if (dtype == DType::bf16) {
    launch_wgmma_bf16(shape, mode, args, launch, stream);
  } else {
    launch_wgmma_f16(shape, mode, args, launch, stream);
  }
}

}  // namespace gg
}  // namespace latentmoe::cuda

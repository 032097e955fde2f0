// The SIMT grouped GEMM launchers (f32, and the fallback for every dtype).
#include "cuda/gemm/grouped_gemm_launch.cuh"
#include "cuda/gemm/grouped_gemm_simt.cuh"
#include "latentmoe/error.h"

namespace latentmoe::cuda::gg {
namespace {

template <class T, Mode kMode>
void launch_simt_typed(const KernelArgs& args, int64_t max_rows, cudaStream_t stream) {
  const int64_t entries = tile_entries_bound(max_rows, args.num_experts, kSimtBlockM);
  const dim3 grid(static_cast<unsigned>(entries), static_cast<unsigned>((args.n + kSimtBlockN - 1) / kSimtBlockN));
  grouped_simt_kernel<T, kMode><<<grid, kSimtThreads, 0, stream>>>(args);
  check_launch("grouped GEMM (SIMT kernel)");
}

template <class T>
void launch_simt_mode(Mode mode, const KernelArgs& args, int64_t max_rows, cudaStream_t stream) {
  switch (mode) {
    case Mode::gated:
      return launch_simt_typed<T, Mode::gated>(args, max_rows, stream);
    case Mode::relu2:
      return launch_simt_typed<T, Mode::relu2>(args, max_rows, stream);
    case Mode::plain:
      return launch_simt_typed<T, Mode::plain>(args, max_rows, stream);
  }
}

}  // namespace

void launch_simt(DType dtype, Mode mode, const KernelArgs& args, int64_t max_rows, cudaStream_t stream) {
  switch (dtype) {
    case DType::f32:
      return launch_simt_mode<float>(mode, args, max_rows, stream);
    case DType::bf16:
      return launch_simt_mode<__nv_bfloat16>(mode, args, max_rows, stream);
    case DType::f16:
      return launch_simt_mode<__half>(mode, args, max_rows, stream);
    default:
      break;
  }
  ::latentmoe::detail::throw_error("grouped GEMM: dtype ", dtype_name(dtype),
                                   " is not a compute dtype (f32, bf16, f16)");
}

}  // namespace latentmoe::cuda::gg

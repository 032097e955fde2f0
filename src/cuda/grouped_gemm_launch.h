// Internal launchers of the grouped GEMM kernels (one per engine and dtype), used by grouped_gemm.cu.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "cuda/grouped_gemm.h"
#include "cuda/grouped_gemm_common.cuh"

namespace latentmoe::cuda::gg {

// max_rows: the host-known bound on grouped rows (T * top_k); the grid covers every tile that many
// rows can make, and CTAs without a tile exit.
void launch_mma_bf16(detail::GemmVariant variant, Mode mode, const KernelArgs& args, int64_t max_rows,
                     cudaStream_t stream);
void launch_mma_f16(detail::GemmVariant variant, Mode mode, const KernelArgs& args, int64_t max_rows,
                    cudaStream_t stream);
void launch_simt(DType dtype, Mode mode, const KernelArgs& args, int64_t max_rows, cudaStream_t stream);

// Throws latentmoe::Error naming `what` if the last launch failed.
void check_launch(const char* what);

// Sets a kernel's dynamic shared-memory limit once per device.
void ensure_smem_limit(const void* kernel, int bytes, std::atomic<uint64_t>* done_mask);

inline int64_t tile_entries_bound(int64_t max_rows, int num_experts, int block_m) {
  return (max_rows + block_m - 1) / block_m + (max_rows < num_experts ? max_rows : num_experts);
}

}  // namespace latentmoe::cuda::gg

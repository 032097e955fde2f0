// Internal launchers of the grouped GEMM kernels (one per engine and dtype), used by grouped_gemm.cu.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "cuda/gemm/grouped_gemm.h"
#include "cuda/gemm/grouped_gemm_common.cuh"

namespace latentmoe::cuda::gg {

struct MmaLaunch {
  int64_t max_rows = 0;           // host-known bound on grouped rows (T * top_k): the grid covers every tile
                                  // that many rows can make, and CTAs without a tile exit
  int64_t num_tokens = 0;         // T (an expert has at most T rows when top-k ids are distinct)
  int n_tiles_per_cta = 0;        // 0: chosen from the shape (choose_tiles_per_cta)
  bool programmatic = false;      // launch with programmatic stream serialization (sm_90)
  bool wait_before_tile = false;  // programmatic, and expert_offsets come from the kernel just before
  bool trigger = false;           // let the next kernel launch early (sm_90)
  bool prefer_two_tiles = false;  // the down projection: two n-tiles per CTA where the grid stays full
  int sm_count = 0;
  int variant_option = 0;  // GemmChoice::option
  // Split-K (tensor-core kernels): 0 chosen from the shape, 1 off, > 1 forced; the workspace (null: off).
  int k_splits = 0;
  float* partials = nullptr;
  size_t partial_floats = 0;
  int* tile_counters = nullptr;
  int64_t num_tile_counters = 0;
};

// The split-K workspace (grouped_gemm_workspace_bytes): tile counters, then fp32 partial sums.
constexpr int64_t kSplitKCounters = 16384;
constexpr size_t kSplitKPartialBytes = size_t{12} << 20;
constexpr size_t kSplitKWorkspaceBytes = kSplitKCounters * sizeof(int) + kSplitKPartialBytes;

void launch_mma_bf16(detail::GemmVariant variant, Mode mode, KernelArgs args, const MmaLaunch& launch,
                     cudaStream_t stream);
void launch_mma_f16(detail::GemmVariant variant, Mode mode, KernelArgs args, const MmaLaunch& launch,
                    cudaStream_t stream);
// MXFP4 weights (args.s0 set), dtype bf16 or f16, variant mma_s_wide, mma_m or mma_l4.
void launch_mma_mxfp4(DType dtype, detail::GemmVariant variant, Mode mode, KernelArgs args, const MmaLaunch& launch,
                      cudaStream_t stream);

// The mxfp4_rows variant (grouped_gemm_mxfp4_rows.cu): MXFP4 weights, dtype bf16 or f16, any K that is a
// multiple of 32; cta_blocks: 0 or 1 (one 64-row weight block at a time, 4 warps);
// launch: max_rows, sm_count, the split-K request (k_splits: 0 its choice, 1 none, more forced) and
// workspace, variant_option (the L2 prefetch size of the copies: 0 default, 1 none, 2 128 bytes for codes,
// 3 256 bytes for codes, 4 128 bytes for codes and scales); programmatic: launched as a programmatic dependent (it
// waits before reading anything).
void launch_mxfp4_rows(DType dtype, Mode mode, const KernelArgs& args, int cta_blocks, const MmaLaunch& launch,
                       bool programmatic, cudaStream_t stream);

// n-tiles per CTA (1 or 2), from the shape and the expected number of m-tiles.
int choose_tiles_per_cta(int n_tiles, int num_k_tiles, int stages, int block_m, const MmaLaunch& launch,
                         int num_experts);
void launch_simt(DType dtype, Mode mode, const KernelArgs& args, int64_t max_rows, cudaStream_t stream);

// Points `launch` at a split-K workspace of `counters` tile counters followed by `partial_bytes` of fp32
// partial sums (none when workspace is null). Throws Error naming `what` when the workspace is smaller than
// that or not 16-byte aligned.
void attach_split_k(MmaLaunch& launch, void* workspace, size_t workspace_bytes, int64_t counters, size_t partial_bytes,
                    const char* what);

// Throws latentmoe::Error naming `what` if the last launch failed.
void check_launch(const char* what);

// Sets a kernel's dynamic shared-memory limit once per device.
void ensure_smem_limit(const void* kernel, int bytes, std::atomic<uint64_t>* done_mask);

inline int64_t tile_entries_bound(int64_t max_rows, int num_experts, int block_m) {
  return (max_rows + block_m - 1) / block_m + (max_rows < num_experts ? max_rows : num_experts);
}

}  // namespace latentmoe::cuda::gg

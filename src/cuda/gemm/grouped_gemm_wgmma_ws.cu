// The persistent, warp-specialised Hopper grouped GEMM (GemmVariant::wgmma_ws; grouped_gemm_wgmma_ws.cuh): the
// weights' TMA descriptors, the grid, the launch, for bf16 and f16.
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled_v12000

#include <algorithm>
#include <atomic>
#include <mutex>

#include "cuda/gemm/grouped_gemm_wgmma_launch.cuh"
#include "cuda/gemm/grouped_gemm_wgmma_ws.cuh"
#include "latentmoe/error.h"

namespace latentmoe::cuda::gg {
namespace {

// cuTensorMapEncodeTiled from the driver the runtime loaded (the library does not link libcuda).
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static std::once_flag once;
  static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  static cudaError_t error = cudaSuccess;
  static cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSuccess;
  std::call_once(once, [] {
    void* fn = nullptr;
    error = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &status);
    if (error == cudaSuccess && status == cudaDriverEntryPointSuccess) {
      encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
    } else {
      cudaGetLastError();  // not sticky: clear it
    }
  });
  LATENTMOE_CHECK(encode != nullptr, "grouped GEMM (wgmma_ws): the driver has no cuTensorMapEncodeTiled (",
                  cudaGetErrorString(error), ", entry point status ", static_cast<int>(status), ")");
  return encode;
}

// A 2-D map over the stacked weights [E * N rows][K] (bf16/f16), boxes of 64 k x 64 rows in the 128B swizzle:
// the layout the kernel's stages and sw128_desc describe. Past K and past E * N the box is zero-filled.
CUtensorMap weight_map(DType dtype, const void* weights, int64_t rows, int64_t k) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(k), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(k) * 2};  // bytes between rows
  const cuuint32_t box[2] = {WgmmaWsCfg::kBlockK, WgmmaWsCfg::kBoxRows};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult result = tensor_map_encoder()(
      &map, dtype == DType::bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2,
      const_cast<void*>(weights), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  LATENTMOE_CHECK(result == CUDA_SUCCESS, "grouped GEMM (wgmma_ws): cuTensorMapEncodeTiled failed (CUresult ",
                  static_cast<int>(result), ") for weights of ", rows, " rows x ", k, " at ", weights);
  return map;
}

template <class T, Mode kMode>
void launch_ws_mode(DType dtype, KernelArgs args, const MmaLaunch& launch, cudaStream_t stream) {
  using Cfg = WgmmaWsCfg;
  static std::atomic<uint64_t> done_mask{0};
  auto kernel = grouped_wgmma_ws_kernel<T, kMode>;
  ensure_smem_limit(reinterpret_cast<const void*>(kernel), Cfg::kMaxSmemBytes, &done_mask);
  const int out_per_tile = kMode == Mode::gated ? Cfg::kWeightRows / 2 : Cfg::kWeightRows;
  args.n_tiles = (args.n + out_per_tile - 1) / out_per_tile;
  args.n_tiles_per_cta = 1;
  args.n_groups = args.n_tiles;
  args.trigger_dependents = launch.trigger;
  args.wait_before_tile = true;  // the kernel waits before it reads anything
  const int64_t stacked_rows = static_cast<int64_t>(args.num_experts) * args.n;
  LATENTMOE_CHECK(stacked_rows + Cfg::kWeightRows < (int64_t{1} << 31), "grouped GEMM (wgmma_ws): ", args.num_experts,
                  " experts x ", args.n, " weight rows exceed the TMA's 32-bit coordinates");
  const CUtensorMap map0 = weight_map(dtype, args.w0, stacked_rows, args.k);
  const CUtensorMap map1 = kMode == Mode::gated ? weight_map(dtype, args.w1, stacked_rows, args.k) : map0;
  // Tiles: at most the host bound on row tiles times the n-tiles; one CTA per SM, fewer when the bound is smaller,
  // or when launch.n_tiles_per_cta asks for at least that many tiles per CTA (the tests' many-tiles-per-CTA case).
  const int64_t tiles_bound = tile_entries_bound(launch.max_rows, args.num_experts, Cfg::kBlockM) * args.n_tiles;
  LATENTMOE_CHECK(tiles_bound < (int64_t{1} << 31), "grouped GEMM (wgmma_ws): too many tiles (", tiles_bound, ")");
  int64_t grid = std::min<int64_t>(tiles_bound, std::max(1, launch.sm_count));
  if (launch.n_tiles_per_cta > 0) {
    grid = std::min<int64_t>(grid, (tiles_bound + launch.n_tiles_per_cta - 1) / launch.n_tiles_per_cta);
  }
  grid = std::max<int64_t>(grid, 1);
  launch_kernel("grouped GEMM (wgmma_ws kernel)", launch.programmatic, kernel, dim3(static_cast<unsigned>(grid)),
                dim3(Cfg::kThreads), wgmma_ws_smem_bytes(args.num_experts), stream, map0, map1, args);
}

template <class T>
void launch_ws_typed(DType dtype, Mode mode, const KernelArgs& args, const MmaLaunch& launch, cudaStream_t stream) {
  switch (mode) {
    case Mode::gated:
      return launch_ws_mode<T, Mode::gated>(dtype, args, launch, stream);
    case Mode::relu2:
      return launch_ws_mode<T, Mode::relu2>(dtype, args, launch, stream);
    case Mode::plain:
      return launch_ws_mode<T, Mode::plain>(dtype, args, launch, stream);
  }
}

}  // namespace

void launch_wgmma_ws(DType dtype, Mode mode, const KernelArgs& args, const MmaLaunch& launch, cudaStream_t stream) {
  LATENTMOE_CHECK(dtype == DType::bf16 || dtype == DType::f16, "grouped GEMM (wgmma_ws): dtype ", dtype_name(dtype),
                  " is not bf16 or f16");
  LATENTMOE_CHECK(detail::wgmma_available(),
                  "grouped GEMM: the wgmma_ws variant needs an sm_90 device and sm_90a code");
  LATENTMOE_CHECK(args.expert_offsets != nullptr, "grouped GEMM (wgmma_ws): expert_offsets is null");
  LATENTMOE_CHECK(args.num_experts >= 1 && args.num_experts <= WgmmaWsCfg::kMaxExperts,
                  "grouped GEMM (wgmma_ws): ", args.num_experts,
                  " experts; this kernel keeps a per-expert prefix in shared memory and takes 1 to ",
                  WgmmaWsCfg::kMaxExperts);
  // The TMA's rules: a 16-byte aligned base and rows whose byte stride is a multiple of 16 (k a multiple of 8).
  LATENTMOE_CHECK(args.k % 8 == 0 && args.n % 8 == 0, "grouped GEMM (wgmma_ws): n ", args.n, " and k ", args.k,
                  " must be multiples of 8");
  LATENTMOE_CHECK((reinterpret_cast<uintptr_t>(args.w0) & 15) == 0 &&
                      (args.w1 == nullptr || (reinterpret_cast<uintptr_t>(args.w1) & 15) == 0),
                  "grouped GEMM (wgmma_ws): the weights are not 16-byte aligned");
  if (dtype == DType::bf16) {
    launch_ws_typed<__nv_bfloat16>(dtype, mode, args, launch, stream);
  } else {
    launch_ws_typed<__half>(dtype, mode, args, launch, stream);
  }
}

}  // namespace latentmoe::cuda::gg

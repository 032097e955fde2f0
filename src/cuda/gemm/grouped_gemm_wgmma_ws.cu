// The persistent, warp-specialised Hopper grouped GEMM (GemmVariant::wgmma_ws, wgmma_ws_tall;
// grouped_gemm_wgmma_ws.cuh): the weights' TMA descriptors, the argument checks, and the bf16/f16 instances of the
// wide shape (the tall shape's in grouped_gemm_wgmma_ws_tall.cu, MXFP4's in grouped_gemm_wgmma_ws_mxfp4.cu).
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled_v12000

#include <cstdint>
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
    if (error == cudaSuccess && status == cudaDriverEntryPointSuccess && fn != nullptr) {
      encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
    } else {
      cudaGetLastError();  // not sticky: clear it
    }
  });
  LATENTMOE_CHECK(encode != nullptr, "grouped GEMM (wgmma_ws): the driver has no cuTensorMapEncodeTiled (",
                  cudaGetErrorString(error), ", entry point status ", static_cast<int>(status), ")");
  return encode;
}

}  // namespace

// The layout the kernel's stages and sw128_desc describe: 128-byte rows (64 k of one weight row or one row of A) in
// the 128B swizzle, boxes of box_rows rows (weights 64, or 8: one swizzle atom; rows 32). Past k and past `rows` the
// box is zero-filled (and still counted whole by the transaction).
CUtensorMap wgmma_ws_tensor_map(DType dtype, const void* base, int64_t rows, int64_t k, int box_rows, bool promote,
                                const char* what) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(k), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(k) * 2};  // bytes between rows: a multiple of 16
  const cuuint32_t box[2] = {WgmmaWsCfg::kBlockK, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult result = tensor_map_encoder()(
      &map, dtype == DType::bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2,
      const_cast<void*>(base), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, promote ? CU_TENSOR_MAP_L2_PROMOTION_L2_256B : CU_TENSOR_MAP_L2_PROMOTION_NONE,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  LATENTMOE_CHECK(result == CUDA_SUCCESS, "grouped GEMM (wgmma_ws): cuTensorMapEncodeTiled failed (CUresult ",
                  static_cast<int>(result), ") for the ", what, ", ", rows, " rows x ", k, " at ", base);
  return map;
}

}  // namespace latentmoe::cuda::gg

namespace latentmoe::cuda::detail {

// Measured on an H100 (session 20, bench/results/issue32_h100_6f0c3a7.json; option bits against the default in one
// binary): normal priority without the promotion made Nemotron's down (K = 336) on wgmma_ws_tall 1.40x faster at 2048
// and 4096 tokens and 1.07x at 8192, and Kimi-K3's (K = 384) on wgmma_ws 1.13-1.18x (either bit) at 8192; Nemotron's
// gate/up (K = 1024) got 2-7% slower with bit 4 and up to 14% with bit 8, so longer reductions keep evict-first with
// the promotion.
WsWeightL2 ws_weight_l2(int option, int64_t k) {
  const bool short_reduction = k <= kWsShortReductionK && (option & 16) == 0;
  return WsWeightL2{short_reduction || (option & 4) != 0, !short_reduction && (option & 8) == 0};
}

}  // namespace latentmoe::cuda::detail

namespace latentmoe::cuda::gg {

void launch_wgmma_ws_wide(DType dtype, Mode mode, const KernelArgs& args, const MmaLaunch& launch,
                          cudaStream_t stream) {
  if (dtype == DType::bf16) {
    launch_wgmma_ws_typed<__nv_bfloat16, WgmmaWsCfg, false>(dtype, mode, args, launch, stream);
  } else {
    launch_wgmma_ws_typed<__half, WgmmaWsCfg, false>(dtype, mode, args, launch, stream);
  }
}

void launch_wgmma_ws(DType dtype, WgmmaWsShape shape, Mode mode, const KernelArgs& args, const MmaLaunch& launch,
                     cudaStream_t stream) {
  const bool mxfp4 = args.s0 != nullptr;
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
  // MXFP4: whole scale groups, and 16-byte aligned code rows (k a multiple of 32).
  const int multiple = mxfp4 ? 32 : 8;
  LATENTMOE_CHECK(args.k % multiple == 0 && args.n % multiple == 0, "grouped GEMM (wgmma_ws): n ", args.n, " and k ",
                  args.k, " must be multiples of ", multiple, mxfp4 ? " with MXFP4 weights" : "");
  LATENTMOE_CHECK((reinterpret_cast<uintptr_t>(args.w0) & 15) == 0 &&
                      (args.w1 == nullptr || (reinterpret_cast<uintptr_t>(args.w1) & 15) == 0),
                  "grouped GEMM (wgmma_ws): the weights are not 16-byte aligned");
  LATENTMOE_CHECK(mode != Mode::gated || (args.w1 != nullptr && (!mxfp4 || args.s1 != nullptr)),
                  "grouped GEMM (wgmma_ws): the gated mode's up weights are missing");
  // The producer keeps where each of its rows starts in A in 16-byte units, as an int (grouped_gemm_wgmma_ws.cuh).
  LATENTMOE_CHECK(launch.max_rows * (args.k / 8) <= INT32_MAX, "grouped GEMM (wgmma_ws): ", launch.max_rows,
                  " rows of ", args.k, " elements are more than this kernel addresses (2^31 16-byte units)");
  static_assert(
      WgmmaWsCfg::kMaxExperts == WgmmaWsTallCfg::kMaxExperts && WgmmaWsCfg::kMaxExperts == WgmmaWsMxfp4Cfg::kMaxExperts,
      "one expert bound for every shape");
  if (mxfp4) {
    launch_wgmma_ws_mxfp4(dtype, shape, mode, args, launch, stream);
  } else if (shape == WgmmaWsShape::tall) {
    launch_wgmma_ws_tall(dtype, mode, args, launch, stream);
  } else {
    launch_wgmma_ws_wide(dtype, mode, args, launch, stream);
  }
}

}  // namespace latentmoe::cuda::gg

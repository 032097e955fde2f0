// The CUDA backend's private state and the helpers its operations share (src/cuda/backend/*.cpp: one
// file a job). Host-only; included by the backend's own files and nothing else.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <memory>
#include <string_view>

#include "cuda/backend/cuda_backend.h"
#include "cuda/backend/decode_dispatch.h"
#include "cuda/common/cuda_check.h"
#include "cuda/common/debug_check.h"
#include "cuda/common/device.h"
#include "cuda/common/matrix.h"
#include "cuda/gemm/blas.h"
#include "cuda/gemm/mxfp4_decode.h"
#include "cuda/gemm/mxfp4_pairs.h"
#include "latentmoe/error.h"

namespace latentmoe::cuda {

using ::latentmoe::detail::ActivationParams;
using ::latentmoe::detail::DeviceBuffer;
using ::latentmoe::detail::MlpWeights;
using ::latentmoe::detail::RoutingParams;

inline constexpr size_t kAlignment = 256;

inline size_t align_up(size_t bytes) { return (bytes + kAlignment - 1) / kAlignment * kAlignment; }

// A tensor as rows x cols with a row stride: rank 1 is one row, rank 2 keeps its row stride (a
// column block), higher ranks must be contiguous and fold their leading dimensions into rows.
inline RowMatrix as_rows(const TensorView& view, std::string_view what) {
  LATENTMOE_DEBUG_CHECK(view.defined() && view.device() == Device::cuda, "CUDA backend: ", what,
                        " is undefined or not a device tensor");
  const int last = view.rank() - 1;
  LATENTMOE_DEBUG_CHECK(view.size(last) <= 1 || view.stride(last) == 1, "CUDA backend: ", what,
                        " needs a contiguous last dimension");
  RowMatrix matrix{view.data(), view.dtype(), 1, view.size(last), view.size(last)};
  if (view.rank() == 2) {
    matrix.rows = view.size(0);
    matrix.ld = view.size(0) <= 1 ? std::max<int64_t>(view.stride(0), view.size(1)) : view.stride(0);
  } else if (view.rank() > 2) {
    LATENTMOE_DEBUG_CHECK(view.is_contiguous(), "CUDA backend: ", what, " of shape ", view.shape_string(),
                          " must be contiguous");
    matrix.rows = view.size(last) == 0 ? 0 : view.numel() / view.size(last);
  }
  LATENTMOE_DEBUG_CHECK(matrix.rows == 0 || matrix.cols == 0 || view.data() != nullptr, "CUDA backend: ", what,
                        " has no data");
  return matrix;
}

// Debug builds only (the runner validated these): a dtype, a compute dtype, a contiguous device tensor.
inline void debug_require_dtype(DType dtype, DType expected, std::string_view what) {
  LATENTMOE_DEBUG_CHECK(dtype == expected, "CUDA backend: ", what, " has dtype ", dtype_name(dtype), ", expected ",
                        dtype_name(expected));
}

inline void debug_require_compute_dtype(DType dtype, std::string_view what) {
  LATENTMOE_DEBUG_CHECK(is_compute_dtype(dtype), "CUDA backend: ", what, " has dtype ", dtype_name(dtype),
                        "; only F32, BF16 and F16 are supported");
}

inline void debug_require_contiguous_device(const TensorView& view, std::string_view what) {
  LATENTMOE_DEBUG_CHECK(view.defined() && view.device() == Device::cuda && view.is_contiguous(), "CUDA backend: ", what,
                        " of shape ", view.shape_string(), " must be a contiguous device tensor");
}

enum OpSlot : unsigned { kMainSlot = 1u, kAuxSlot = 2u };

struct CudaBackend::State {
  int ordinal = 0;
  DeviceInfo info;
  cudaStream_t main_stream = nullptr;  // the backend's own
  cudaStream_t bound = nullptr;        // the main stream of the operations: the caller's (bind_stream) or main_stream
  cudaStream_t aux_stream = nullptr;
  cudaStream_t current = nullptr;
  cudaEvent_t fork = nullptr;
  cudaEvent_t join = nullptr;
  std::unique_ptr<Blas> blas;
  DeviceBuffer blas_workspace[2];  // [0]: main stream, [1]: aux stream
  DeviceBuffer push_workspace[2];  // tier 0's pushing GEMM's split-K (dense_push_gemm.h), per stream
  int64_t num_allocations = 0;

  // Workspaces sized by prepare().
  WorkspaceSpec spec;
  bool prepared = false;
  DeviceBuffer routed_workspace;  // layout | act rows | y rows | grouped-GEMM workspace
  size_t layout_bytes = 0, act_bytes = 0, y_bytes = 0, grouped_bytes = 0;
  DeviceBuffer dense_workspace;  // gate rows | up rows
  size_t dense_half_bytes = 0;
  DeviceBuffer router_workspace;  // x widened to f32 [max_tokens, d]
  size_t router_bytes = 0;

  // Rows up to which linear, dense_mlp and routed_experts take the skinny kernels (0: never).
  int skinny_max_tokens = kSkinnyMaxRows;
  bool skinny(int64_t rows) const { return rows >= 1 && rows <= skinny_max_tokens; }
  // false: the measured rule (decode_dispatch.h); true: every call within skinny_max_tokens (tests).
  bool skinny_always = false;
  SkinnyShape skinny_shape;  // {}: each call chooses
  // Rows up to which linear and dense_mlp take the decode GEMV (0: never).
  int gemv_max_tokens = 1;  // one token: the warp-rows GEMV (cuda_backend.h has the measurement)
  // CTAs per SM of dense_mlp's GEMVs (GemvShape::ctas_per_sm; 0: the kernel's two).
  int shared_gemv_ctas_per_sm = 0;
  // Rows up to which tier 0's up-projection pushes into the peers from its epilogue (0: never).
  int fused_up_projection_max_tokens = kDefaultFusedUpProjectionMaxTokens;
  // The longest latent it pushes with; -1: the decode dispatch's measured rule.
  int64_t fused_up_projection_max_latent = -1;
  // The measured decode dispatch of this device's architecture (decode_dispatch.h).
  const DecodeDispatch* dispatch = nullptr;
  // The MXFP4 tensor-core gate/up's warps per tile (Mxfp4GateUpCall::warps_per_tile; 0: its measured rule).
  int mxfp4_gate_up_warps_per_tile = 0;
  // Up to how many tokens MXFP4 experts with 16-bit activations take the decode kernels (in batches of
  // kMxfp4DecodeMaxRows; LATENTMOE_MXFP4_DECODE_MAX_TOKENS); above, the grouped GEMMs.
  int mxfp4_decode_max_tokens = kMxfp4DecodeTokens;
  // Up to how many tokens those decode-kernel calls with bf16 activations take the pair kernels (mxfp4_pairs.h;
  // LATENTMOE_MXFP4_PAIRS_MAX_TOKENS, set_mxfp4_pairs_max_tokens); 0: never.
  int mxfp4_pairs_max_tokens = kMxfp4PairsTokens;

  // run_overlapped bookkeeping: which streams routed_experts / dense_mlp ran on in this region, and the
  // weight bytes the routed experts on its main side stream at most (0: none there).
  bool overlapping = false;
  int64_t beside_bytes = 0;
  unsigned routed_slots = 0, dense_slots = 0, router_slots = 0;

  bool on_aux() const { return current == aux_stream; }
  void* blas_buffer() const { return blas_workspace[on_aux() ? 1 : 0].get(); }
  void* push_buffer() const { return push_workspace[on_aux() ? 1 : 0].get(); }

  DeviceBuffer device_alloc(size_t bytes) {
    void* pointer = nullptr;
    LATENTMOE_CUDA_CHECK(cudaMalloc(&pointer, std::max<size_t>(bytes, 1)));
    ++num_allocations;
    const int device = ordinal;
    return DeviceBuffer(pointer, bytes, [device](void* p) {
      // Never throws (it runs in destructors); errors are dropped.
      int previous = -1;
      (void)cudaGetDevice(&previous);
      if (previous != device) (void)cudaSetDevice(device);
      (void)cudaFree(p);
      if (previous >= 0 && previous != device) (void)cudaSetDevice(previous);
    });
  }

  void mark_slot(unsigned& slots, const char* op) {
    if (!overlapping) return;
    slots |= on_aux() ? kAuxSlot : kMainSlot;
    LATENTMOE_CHECK(slots != (kMainSlot | kAuxSlot), "CUDA backend: ", op,
                    " was called on both streams of one run_overlapped; its workspace is not shared");
  }
};

// This call's parts of the routed workspace (CudaBackend::routed_buffers).
struct CudaBackend::RoutedBuffers {
  void* layout = nullptr;
  void* act_rows = nullptr;
  void* y_rows = nullptr;
  void* grouped = nullptr;
};

}  // namespace latentmoe::cuda

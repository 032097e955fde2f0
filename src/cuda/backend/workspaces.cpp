// CudaBackend's workspaces: prepare() sizes them for the rank context's largest layer (one allocation
// each, before the first forward), and routed_buffers() carves one call's parts out of them, checked.
#include "cuda/backend/backend_state.h"
#include "cuda/gemm/grouped_gemm.h"
#include "cuda/kernels/moe_layout.h"
#include "cuda/kernels/routing.h"

namespace latentmoe::cuda {

void CudaBackend::prepare(const WorkspaceSpec& spec) {
  State& s = *state_;
  DeviceGuard guard(s.ordinal);
  LATENTMOE_CHECK(spec.max_tokens >= 0 && spec.num_experts >= 0 && spec.top_k >= 0 && spec.latent_size >= 0 &&
                      spec.expert_intermediate >= 0 && spec.dense_intermediate >= 0 && spec.element_size >= 1,
                  "CUDA prepare: negative workspace shape");
  // Release the old workspaces first (cudaFree waits for the work that may still use them).
  s.routed_workspace = {};
  s.dense_workspace = {};
  s.router_workspace = {};
  s.prepared = false;
  s.spec = spec;
  s.layout_bytes = s.act_bytes = s.y_bytes = s.grouped_bytes = s.dense_half_bytes = s.router_bytes = 0;

  if (spec.num_experts > 0 && spec.top_k > 0 && spec.max_tokens > 0) {
    const int64_t num_pairs = spec.max_tokens * spec.top_k;
    const int top_k = static_cast<int>(spec.top_k);
    const int num_experts = static_cast<int>(spec.num_experts);
    s.layout_bytes = align_up(moe_layout_workspace_bytes(spec.max_tokens, top_k, num_experts));
    s.act_bytes = align_up(static_cast<size_t>(num_pairs * spec.expert_intermediate) * spec.element_size);
    s.y_bytes = align_up(static_cast<size_t>(num_pairs * spec.latent_size) * spec.element_size);
    s.grouped_bytes = align_up(grouped_gemm_workspace_bytes(spec.max_tokens, top_k, num_experts));
    s.routed_workspace = s.device_alloc(s.layout_bytes + s.act_bytes + s.y_bytes + s.grouped_bytes);
    // The grouped GEMMs' split-K counters start at zero (each launch leaves them so).
    LATENTMOE_CUDA_CHECK(cudaMemset(
        static_cast<char*>(s.routed_workspace.get()) + s.layout_bytes + s.act_bytes + s.y_bytes, 0, s.grouped_bytes));
  }
  if (spec.dense_intermediate > 0 && spec.max_tokens > 0) {
    s.dense_half_bytes = align_up(static_cast<size_t>(spec.max_tokens * spec.dense_intermediate) * spec.element_size);
    s.dense_workspace = s.device_alloc(2 * s.dense_half_bytes);
  }
  if (spec.hidden_size > 0 && spec.max_tokens > 0) {
    s.router_bytes = align_up(static_cast<size_t>(spec.max_tokens * spec.hidden_size) * sizeof(float));
    s.router_workspace = s.device_alloc(s.router_bytes);
  }
  s.prepared = true;
}

CudaBackend::RoutedBuffers CudaBackend::routed_buffers(DType dtype, int64_t num_tokens, int64_t k, int64_t num_experts,
                                                       int64_t intermediate, int64_t latent) {
  State& s = *state_;
  // The workspace prepare() sized must hold this call's layout and rows.
  const size_t element = dtype_size(dtype);
  const int64_t num_pairs = num_tokens * k;
  const size_t layout_needed =
      moe_layout_workspace_bytes(num_tokens, static_cast<int>(k), static_cast<int>(num_experts));
  const size_t act_needed = static_cast<size_t>(num_pairs * intermediate) * element;
  const size_t y_needed = static_cast<size_t>(num_pairs * latent) * element;
  const size_t grouped_needed =
      grouped_gemm_workspace_bytes(num_tokens, static_cast<int>(k), static_cast<int>(num_experts));
  LATENTMOE_CHECK(s.prepared && layout_needed <= s.layout_bytes && act_needed <= s.act_bytes && y_needed <= s.y_bytes &&
                      grouped_needed <= s.grouped_bytes,
                  "CUDA routed experts: the workspace prepared for max_tokens = ", s.spec.max_tokens,
                  " (E = ", s.spec.num_experts, ", k = ", s.spec.top_k, ", l = ", s.spec.latent_size,
                  ", I_r = ", s.spec.expert_intermediate, ") does not fit ", num_tokens,
                  " tokens with E = ", num_experts, ", k = ", k, ", l = ", latent, ", I_r = ", intermediate,
                  "; call prepare() with the layer's shapes before forward");
  auto* base = static_cast<char*>(s.routed_workspace.get());
  return RoutedBuffers{base, base + s.layout_bytes, base + s.layout_bytes + s.act_bytes,
                       base + s.layout_bytes + s.act_bytes + s.y_bytes};
}

}  // namespace latentmoe::cuda

// Where CudaBackend sends a decode-sized call (1..kSkinnyMaxRows tokens) to the skinny kernels
// (cuda/gemm/skinny_gemm.h) instead of cuBLASLt and the grouped GEMMs: one row of measured constants
// per GPU architecture, keyed by compute capability, in decode_dispatch.cpp (each constant says where
// it was measured). set_skinny_always (tests) and set_skinny_max_tokens still override it. Host-only;
// includable from C++.
#pragma once

#include <cstdint>

namespace latentmoe::cuda {

struct DecodeDispatch {
  int compute_capability = 0;  // major * 10 + minor of the GPU the row was measured on
  const char* gpu = "";        // that GPU
  // routed_experts: the skinny kernels at 1..routed_max_tokens tokens when the latent size (the
  // gate/up reduction) is at least routed_min_latent.
  int64_t routed_max_tokens = 0;
  int64_t routed_min_latent = 0;
  // dense_mlp (the shared expert): at 1..dense_max_tokens tokens when the intermediate size (Is / tp)
  // is at most dense_max_intermediate.
  int64_t dense_max_tokens = 0;
  int64_t dense_max_intermediate = 0;
  // linear: at 1..linear_max_tokens tokens (0: never).
  int64_t linear_max_tokens = 0;
  // Tier 0's up-projection pushed into the peers from the skinny GEMM's epilogue
  // (CudaBackend::up_projection_all_gather): when its reduction (the latent size) is at most this.
  int64_t tier0_push_max_latent = 0;
  // The same push from the tensor-core GEMM (cuda/gemm/dense_push_gemm.h) where the skinny kernel does
  // not take it (more rows than kSkinnyMaxRows, or a latent past tier0_push_max_latent): when the
  // latent size is at most this; 0: never.
  int64_t tier0_tensor_core_push_max_latent = 0;
};

// The row of `compute_capability`; an architecture without a row of its own gets the sm_90 (H200)
// row, the only one measured so far.
const DecodeDispatch& decode_dispatch(int compute_capability);

enum class SkinnyOp { linear, dense_mlp, routed_experts, tier0_push };

// Whether the skinny kernels beat the general path for `op` on `rows` rows by `table`. `reduction`:
// the gate/up reduction length (routed experts and tier0_push: the latent size; linear: k); `intermediate`: the
// MLP's intermediate size (dense_mlp).
bool skinny_pays(const DecodeDispatch& table, SkinnyOp op, int64_t rows, int64_t reduction, int64_t intermediate);

}  // namespace latentmoe::cuda

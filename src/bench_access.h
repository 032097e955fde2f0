// INTERNAL, for benchmarks only: not part of latentmoe's API, and no library code, test or engine may
// include it. It is the one door through which the benchmarks reach inside the library: `latentmoe bench
// layer` (tools/bench_layer.cpp), `latentmoe bench tail` (tools/bench_tail*.cpp) and the benchmark
// harness (bench/harness/). Everything else under tools/ and bench/harness/ uses the public API
// (include/latentmoe/). What passes here: a Runner's private state (weights, scratch, backend, routing and
// activation parameters; core/runner_state.h) to time each phase of the layer, or its tail alone, on the
// runner's own buffers; a backend of its own for the dense GEMM ceiling; the CUDA backend's decode knobs
// and tier 0's push bounds; the CUDA fill and L2-flush kernels; the CUDA check macros. (The kernel
// benchmarks, bench/*.cu and bench/micro/, measure one internal kernel each and include that kernel's
// header, as tests/cuda do.) Everything here may change with the internals it exposes.
#pragma once

#include <memory>

#include "core/backend.h"
#include "core/layer_forward.h"
#include "core/runner_state.h"
#include "core/tails.h"
#include "cuda/backend/fused_up_projection_bounds.h"  // plain C++: the CPU-only build includes it too
#include "latentmoe/error.h"
#include "latentmoe/runner.h"

#ifdef LATENTMOE_WITH_CUDA
#include <cuda_runtime_api.h>

#include "cuda/backend/cuda_backend.h"
#include "cuda/common/cuda_check.h"  // LATENTMOE_CUDA_CHECK, LATENTMOE_CUBLAS_CHECK
#include "cuda/kernels/fill.h"
#endif

namespace latentmoe::bench_access {

using detail::ActivationParams;
using detail::Backend;
using detail::DeviceBuffer;
using detail::MlpWeights;
using detail::RoutingParams;
using detail::RunnerState;

// The runner's weights (device views), scratch (sized for max_tokens), backend and parameters.
inline RunnerState& state_of(Runner& runner) { return detail::RunnerAccess::state(runner); }

// The tail of one tier alone, as forward runs it (core/tails.h): `latentmoe bench tail` times it on
// partials it restores before every run.
using detail::TailTensors;
inline TailTensors tail_tensors(Runner& runner, TailTier tier, const TensorView& out, int64_t num_tokens) {
  return detail::tail_tensors(state_of(runner), tier, out, num_tokens);
}
inline void run_tail(Runner& runner, TailTier tier, const TailTensors& tensors) {
  detail::run_tail(state_of(runner).tail_operands(), tier, tensors);
}

// Tier 0's pushing up-projection: the most rows it takes and its default bound (the CLI states them).
using cuda::kDefaultFusedUpProjectionMaxTokens;
using cuda::kDensePushMaxRows;

// A CPU backend of its own (bench tail's scratch on the CPU).
inline std::unique_ptr<Backend> make_cpu_backend() { return detail::make_cpu_backend(); }

#ifdef LATENTMOE_WITH_CUDA

// Seeded uniform fill of device memory: data[i] = offset + scale * U[-1, 1) (cuda/kernels/fill.h).
using cuda::fill_uniform;
// The L2 flush: reads a buffer through L2, leaving clean lines (cuda/kernels/fill.h).
using cuda::read_through;

// The runner's backend as the CUDA backend; throws Error when the runner runs on another backend.
inline cuda::CudaBackend& cuda_backend_of(Runner& runner) {
  auto* backend = dynamic_cast<cuda::CudaBackend*>(state_of(runner).backend);
  LATENTMOE_CHECK(backend != nullptr, "bench: the runner does not run on the CUDA backend");
  return *backend;
}

// CudaBackend::set_skinny_max_tokens / set_gemv_max_tokens of the runner's backend (the decode paths
// the benchmark compares; they size nothing, so they may change after construction).
inline void set_skinny_max_tokens(Runner& runner, int tokens) { cuda_backend_of(runner).set_skinny_max_tokens(tokens); }
inline void set_gemv_max_tokens(Runner& runner, int tokens) { cuda_backend_of(runner).set_gemv_max_tokens(tokens); }
inline void set_mxfp4_pairs_max_tokens(Runner& runner, int tokens) {
  cuda_backend_of(runner).set_mxfp4_pairs_max_tokens(tokens);
}
inline void set_shared_gemv_ctas_per_sm(Runner& runner, int ctas) {
  cuda_backend_of(runner).set_shared_gemv_ctas_per_sm(ctas);
}
// CudaBackend::set_fused_up_projection_max_tokens (tier 0's fused up-projection; bench tail compares).
inline void set_fused_up_projection_max_tokens(Runner& runner, int tokens) {
  cuda_backend_of(runner).set_fused_up_projection_max_tokens(tokens);
}
// CudaBackend::set_fused_up_projection_max_latent (-1: the decode dispatch's rule).
inline void set_fused_up_projection_max_latent(Runner& runner, int64_t latent) {
  cuda_backend_of(runner).set_fused_up_projection_max_latent(latent);
}

// A CUDA backend of its own (no runner): the benchmark measures the dense GEMM ceiling through the
// backend's linear(), the code path the layer's dense linears take.
inline std::unique_ptr<Backend> make_cuda_backend(int device_ordinal) {
  return detail::make_cuda_backend(device_ordinal);
}

#endif

}  // namespace latentmoe::bench_access

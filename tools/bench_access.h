// INTERNAL, for benchmarks only: not part of latentmoe's API, and no library code, test or engine may
// include it. It is the one door through which `latentmoe bench layer` (tools/bench_layer.cpp),
// `latentmoe bench tail` (tools/bench_tail*.cpp) and the benchmark harness (bench/harness/) reach inside
// the library: a Runner's private state (weights, workspaces, backend, routing and activation
// parameters; src/core/runner_state.h) to time each phase of the layer, or its tail alone, on the
// runner's own buffers, the CUDA backend's decode knobs, and the CUDA fill and L2-flush kernels.
// Everything here may change with the internals it exposes.
#pragma once

#include <memory>

#include "core/backend.h"
#include "core/runner_state.h"
#include "core/tails.h"
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
using detail::MlpWeights;
using detail::RoutingParams;
using detail::RunnerState;

// The runner's weights (device views), workspaces (sized for max_tokens), backend and parameters.
inline RunnerState& state_of(Runner& runner) { return detail::state_of(runner); }

// The tail of one tier alone, as forward runs it (core/tails.h): `latentmoe bench tail` times it on
// partials it restores before every run.
using detail::run_tail;
using detail::tail_tensors;
using detail::TailTensors;

#ifdef LATENTMOE_WITH_CUDA

using cuda::cuda_device_count;
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

// The small-token path of the dense projections: y [T, n] (+)= x [T, m] · w [n, m]^T for T <= 16
// tokens (decode and tiny batches), where cuBLASLt's tiles leave most of the memory bandwidth unused.
// The kernel is a GEMV: each warp owns a few output columns, streams their weight rows with 16-byte
// loads (several in flight per thread) and reuses every loaded weight vector for all T tokens; fp32
// accumulation, warp-shuffle reductions in a fixed order (deterministic, no atomics).
//
// The gated variant runs the dense MLP's gate and up projections as one launch: both weight rows of
// an output column are streamed by the same warp and act(gate, up) is applied to the fp32 sums, so
// the activated intermediate is written directly (no gate/up buffers, no activation kernel).
//
// Supported: x, w and y of one dtype, bf16 or f16; x and w rows 16-byte aligned (base pointer and
// row stride); any m (a scalar tail covers m % 8), any n, any row stride of y. Callers check
// small_gemm_supports() / small_gate_up_supports() and keep their general path otherwise.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/backend.h"
#include "cuda/blas.h"
#include "cuda/elementwise.cuh"

namespace latentmoe::cuda {

// The cut-over: problems with up to this many tokens take the GEMV path. Up to 8 tokens the kernel
// is memory-bound (about 90 FP32 instructions per 16-byte weight vector); at 9..16 tokens the FMAs
// (8·T per vector) approach the SM's issue rate, still under cuBLASLt's measured ~2x byte floor.
inline constexpr int64_t kSmallGemmMaxTokens = 16;

// True when launch_small_gemm runs `problem`: 1 <= rows <= kSmallGemmMaxTokens, cols >= 1,
// inner >= 1, all three dtypes equal and bf16 or f16, x and w 16-byte aligned rows.
bool small_gemm_supports(const GemmProblem& problem);

// y (+)= x w^T on `stream`. Throws Error when !small_gemm_supports(problem).
void launch_small_gemm(const GemmProblem& problem, cudaStream_t stream);

// True when launch_small_gate_up runs: x, up (and gate when gated) and out of one dtype, bf16 or f16,
// 1 <= x.rows <= kSmallGemmMaxTokens, x and weight rows 16-byte aligned, shapes consistent.
bool small_gate_up_supports(const ::latentmoe::detail::ActivationParams& activation, const RowMatrix& x,
                            const RowMatrix& gate, const RowMatrix& up, const RowMatrix& out);

// out [T, Is] = act(x gate^T, x up^T) (relu2: relu(x up^T)^2, gate ignored), the activation applied
// to the fp32 sums and rounded once to out's dtype. Throws Error when not supported.
void launch_small_gate_up(const ::latentmoe::detail::ActivationParams& activation, const RowMatrix& x,
                          const RowMatrix& gate, const RowMatrix& up, const RowMatrix& out, cudaStream_t stream);

}  // namespace latentmoe::cuda

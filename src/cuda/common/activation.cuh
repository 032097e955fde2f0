// The expert activations of every CUDA kernel (DESIGN section 1 step 3), in fp32: the elementwise
// kernel of the cuBLASLt dense MLP (kernels/elementwise.cu), the grouped GEMM epilogues (SIMT, mma,
// wgmma: gemm/grouped_gemm_common.cuh) and the skinny kernels (gemm/skinny_gemm.cu). One definition,
// so that every path gives the NaN and infinity pattern of the CPU reference (src/cpu/activation.h,
// docs/NUMERICS.md), which evaluates the same formulas in double:
//   sigmoid(x) = 1 / (1 + exp(-x)):   +inf -> 1, -inf -> 0 (exp(inf) = inf), NaN -> NaN;
//   silu(g, u) = (g · sigmoid(g)) · u: silu(-inf, u) = -inf · 0 = NaN, silu(+inf, u) = inf · u
//                                      (NaN for u = 0), a NaN in g or u gives NaN;
//   situ(g, u) = (β₁ · tanh(g/β₁) · sigmoid(g)) · (β₂ · tanh(u/β₂)): saturates, finite for ±inf
//                                      (situ(-inf, u) = ∓0), NaN for a NaN g or u;
//   relu2(u)   = max(u, 0)²:           NaN stays NaN (as torch.relu), -inf -> 0, +inf -> inf.
// kFast (the 16-bit tensor-core and skinny epilogues, whose output is rounded to bf16/f16): __expf
// (ex2.approx: +inf -> inf, -inf -> +0, NaN -> NaN) and tanh.approx.f32 (±inf -> ±1, NaN -> NaN)
// instead of expf and tanhf; both keep those special values, so the fast variants give the same
// NaN/inf pattern. The division stays IEEE (1 / inf = 0). Device code only.
#pragma once

#include <cuda_runtime.h>

#include "latentmoe/config.h"

namespace latentmoe::cuda::act {

template <bool kFast = false>
__device__ __forceinline__ float sigmoid(float x) {
  if constexpr (kFast) {
    return 1.0f / (1.0f + __expf(-x));
  } else {
    return 1.0f / (1.0f + expf(-x));
  }
}

// tanh.approx.f32 (sm_75+) when kFast: relative error about 2^-11, far below the bf16/f16 rounding
// of the output.
template <bool kFast = false>
__device__ __forceinline__ float tanh(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
  if constexpr (kFast) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
  }
#endif
  return tanhf(x);
}

template <bool kFast = false>
__device__ __forceinline__ float silu(float gate, float up) {
  return gate * sigmoid<kFast>(gate) * up;
}

template <bool kFast = false>
__device__ __forceinline__ float situ(float gate, float up, float beta, float linear_beta) {
  return (beta * tanh<kFast>(gate / beta) * sigmoid<kFast>(gate)) * (linear_beta * tanh<kFast>(up / linear_beta));
}

// max(u, 0)²; a NaN fails `u <= 0` and is squared into a NaN (fmaxf would turn it into 0).
__device__ __forceinline__ float relu2(float up) { return !(up <= 0.0f) ? up * up : 0.0f; }

// The gated activation chosen at run time (the GEMM epilogues): situ when `use_situ`, else silu.
template <bool kFast = false>
__device__ __forceinline__ float gated(float gate, float up, bool use_situ, float beta, float linear_beta) {
  return use_situ ? situ<kFast>(gate, up, beta, linear_beta) : silu<kFast>(gate, up);
}

// The activation chosen at compile time; `gate` is ignored for relu2.
template <Activation kAct, bool kFast = false>
__device__ __forceinline__ float activate(float gate, float up, float beta, float linear_beta) {
  if constexpr (kAct == Activation::silu) {
    return silu<kFast>(gate, up);
  } else if constexpr (kAct == Activation::situ) {
    return situ<kFast>(gate, up, beta, linear_beta);
  } else {
    return relu2(up);
  }
}

}  // namespace latentmoe::cuda::act

// The CPU reference operations behind CpuBackend (src/cpu/cpu_backend.cpp), one function per
// Backend operation; see src/core/backend.h for the contracts and docs/NUMERICS.md for precision.
#pragma once

#include "core/backend.h"

namespace latentmoe::detail::cpu {

// linear.cpp
void router_logits(const TensorView& x, const TensorView& gate, const TensorView& logits);
void linear(const TensorView& x, const TensorView& w, const TensorView& y, bool accumulate);

// mlp.cpp
void routed_experts(const ActivationParams& activation, const TensorView& z, const TensorView& topk_ids,
                    const TensorView& topk_weights, const MlpWeights& experts, const TensorView& out);
void dense_mlp(const ActivationParams& activation, const TensorView& x, const MlpWeights& mlp, const TensorView& out);

// elementwise.cpp
void rms_norm(const TensorView& in, const TensorView& gamma, float eps, const TensorView& out);
void add(const TensorView& a, const TensorView& b, const TensorView& out);
void add_scaled_rows(const TensorView& x, const TensorView& scale, const TensorView& out);
// Equal shape and dtype, any strides, any dtype (a byte copy per element or per contiguous row).
void copy(const TensorView& src, const TensorView& dst);

}  // namespace latentmoe::detail::cpu

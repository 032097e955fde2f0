// The expert activations, in double (DESIGN section 1 step 3). Used by the CPU backend and by tests
// as the definition. They take the unrounded gate/up accumulators, as a fused GPU epilogue does.
#pragma once

#include <cmath>

#include "core/backend.h"

namespace latentmoe::detail::cpu {

inline double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// silu(g, u) = g · sigmoid(g) · u.
inline double silu(double gate, double up) { return gate * sigmoid(gate) * up; }

// situ(g, u) = (b1 · tanh(g / b1) · sigmoid(g)) · (b2 · tanh(u / b2)), Kimi K3's SiTU-GLU.
inline double situ(double gate, double up, double beta, double linear_beta) {
  return (beta * std::tanh(gate / beta) * sigmoid(gate)) * (linear_beta * std::tanh(up / linear_beta));
}

// relu2(u) = max(u, 0)^2; NaN stays NaN (as torch.relu does).
inline double relu2(double up) {
  if (std::isnan(up)) return up;
  return up > 0.0 ? up * up : 0.0;
}

// The activation of `params` on one (gate, up) pair; `gate` is ignored for relu2.
inline double activate(const ActivationParams& params, double gate, double up) {
  switch (params.activation) {
    case Activation::silu:
      return silu(gate, up);
    case Activation::situ:
      return situ(gate, up, params.situ_beta, params.situ_linear_beta);
    case Activation::relu2:
      return relu2(up);
  }
  return 0.0;
}

}  // namespace latentmoe::detail::cpu

// The one GEMM of the CPU reference: y = x · w^T with exact products and double accumulation.
#pragma once

#include <cstdint>

#include "cpu/numeric.h"

namespace latentmoe::detail::cpu {

// y[r, c] = sum_i x[r, i] * w[c, i] for x contiguous floats [rows, w.cols] and w of any compute dtype;
// y is contiguous doubles [rows, w.rows]. Every product is exact in double (float x float); the sum
// runs in double in a fixed order that depends only on w.cols (docs/NUMERICS.md), never on `rows`
// or on a row's position, so a token's result does not depend on the rest of the batch.
void matmul_nt(const float* x, int64_t rows, const Matrix& w, double* y);

}  // namespace latentmoe::detail::cpu

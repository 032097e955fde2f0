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

// An MXFP4 weight matrix [rows, cols] (latentmoe/mxfp4.h): packed codes, row r at
// packed + r * packed_stride bytes, and E8M0 scales, row r at scales + r * scale_stride bytes.
struct Mxfp4Matrix {
  const uint8_t* packed = nullptr;
  const uint8_t* scales = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t packed_stride = 0;
  int64_t scale_stride = 0;
};

// The same product with w decoded exactly to double (block by block, never the whole matrix) and
// the same summation order, so a dense w holding the decoded values gives bit-identical y.
void matmul_nt(const float* x, int64_t rows, const Mxfp4Matrix& w, double* y);

}  // namespace latentmoe::detail::cpu

// router_logits and linear: one GEMM each, through matmul_nt (double accumulation), rounded once.
#include <vector>

#include "cpu/cpu_ops.h"
#include "cpu/matmul.h"

namespace latentmoe::detail::cpu {
namespace {

// y = x · w^T (+ y): x, w and y each of a compute dtype; y may be a strided column block.
void gemm_into(const Matrix& x, const Matrix& w, const Matrix& y, bool accumulate) {
  LATENTMOE_CHECK(x.cols == w.cols && y.rows == x.rows && y.cols == w.rows, "CPU linear: shapes [", x.rows, ", ",
                  x.cols, "] x [", w.rows, ", ", w.cols, "]^T -> [", y.rows, ", ", y.cols, "] do not match");
  std::vector<float> x_rows(static_cast<size_t>(x.rows * x.cols));
  load_rows(x, 0, x.rows, x_rows.data());
  std::vector<double> sums(static_cast<size_t>(y.rows * y.cols));
  matmul_nt(x_rows.data(), x.rows, w, sums.data());
  if (accumulate) {
    std::vector<float> previous(static_cast<size_t>(y.cols));
    for (int64_t r = 0; r < y.rows; ++r) {
      load_row(y.row(r), y.dtype, y.cols, previous.data());
      for (int64_t c = 0; c < y.cols; ++c) sums[r * y.cols + c] += previous[c];
    }
  }
  store_rows(sums.data(), y);
}

}  // namespace

void router_logits(const TensorView& x, const TensorView& gate, const TensorView& logits) {
  require_compute_dtype(x.dtype(), "router input");
  require_compute_dtype(gate.dtype(), "router gate weight");
  require_dtype(logits.dtype(), DType::f32, "router logits");
  gemm_into(as_matrix(x, "router input"), as_matrix(gate, "router gate weight"), as_matrix(logits, "router logits"),
            false);
}

void linear(const TensorView& x, const TensorView& w, const TensorView& y, bool accumulate) {
  require_compute_dtype(x.dtype(), "linear input");
  require_compute_dtype(w.dtype(), "linear weight");
  require_compute_dtype(y.dtype(), "linear output");
  gemm_into(as_matrix(x, "linear input"), as_matrix(w, "linear weight"), as_matrix(y, "linear output"), accumulate);
}

}  // namespace latentmoe::detail::cpu

// Row-wise operations: rms_norm, add, add_scaled_rows, and copy. Each loads a row to float, computes
// in double and rounds once to the output dtype; loading a whole row before storing it makes
// in-place use (out aliasing an input) safe.
#include <array>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu/cpu_ops.h"
#include "cpu/numeric.h"

namespace latentmoe::detail::cpu {

void rms_norm(const TensorView& in, const TensorView& gamma, float eps, const TensorView& out) {
  require_compute_dtype(in.dtype(), "RMSNorm input");
  require_compute_dtype(gamma.dtype(), "RMSNorm gamma");
  require_compute_dtype(out.dtype(), "RMSNorm output");
  const Matrix input = as_matrix(in, "RMSNorm input");
  const Matrix output = as_matrix(out, "RMSNorm output");
  const Matrix weight = as_matrix(gamma, "RMSNorm gamma");
  const int64_t width = input.cols;
  LATENTMOE_CHECK(output.rows == input.rows && output.cols == width && weight.rows * weight.cols == width,
                  "CPU RMSNorm: input ", in.shape_string(), ", gamma ", gamma.shape_string(), " and output ",
                  out.shape_string(), " do not match");
  std::vector<float> gamma_row(static_cast<size_t>(width));
  load_row(weight.data, weight.dtype, width, gamma_row.data());
  std::vector<float> row(static_cast<size_t>(width));
  std::vector<double> result(static_cast<size_t>(width));
  for (int64_t r = 0; r < input.rows; ++r) {
    load_row(input.row(r), input.dtype, width, row.data());
    double sum_squares = 0.0;
    for (int64_t c = 0; c < width; ++c) sum_squares += static_cast<double>(row[c]) * row[c];
    const double inverse_rms = 1.0 / std::sqrt(sum_squares / static_cast<double>(width) + eps);
    for (int64_t c = 0; c < width; ++c) result[c] = row[c] * inverse_rms * gamma_row[c];
    store_row(result.data(), width, output.row(r), output.dtype);
  }
}

void add(const TensorView& a, const TensorView& b, const TensorView& out) {
  require_compute_dtype(a.dtype(), "add input a");
  require_compute_dtype(b.dtype(), "add input b");
  require_compute_dtype(out.dtype(), "add output");
  const Matrix left = as_matrix(a, "add input a");
  const Matrix right = as_matrix(b, "add input b");
  const Matrix output = as_matrix(out, "add output");
  LATENTMOE_CHECK(
      left.rows == right.rows && left.cols == right.cols && output.rows == left.rows && output.cols == left.cols,
      "CPU add: shapes ", a.shape_string(), " + ", b.shape_string(), " -> ", out.shape_string(), " do not match");
  const int64_t width = output.cols;
  std::vector<float> row_a(static_cast<size_t>(width)), row_b(static_cast<size_t>(width));
  std::vector<double> result(static_cast<size_t>(width));
  for (int64_t r = 0; r < output.rows; ++r) {
    load_row(left.row(r), left.dtype, width, row_a.data());
    load_row(right.row(r), right.dtype, width, row_b.data());
    for (int64_t c = 0; c < width; ++c) result[c] = static_cast<double>(row_a[c]) + row_b[c];
    store_row(result.data(), width, output.row(r), output.dtype);
  }
}

void add_scaled_rows(const TensorView& x, const TensorView& scale, const TensorView& out) {
  require_compute_dtype(x.dtype(), "add_scaled_rows input");
  require_compute_dtype(out.dtype(), "add_scaled_rows output");
  require_dtype(scale.dtype(), DType::f32, "add_scaled_rows scale");
  const Matrix input = as_matrix(x, "add_scaled_rows input");
  const Matrix output = as_matrix(out, "add_scaled_rows output");
  LATENTMOE_CHECK(
      input.rows == output.rows && input.cols == output.cols && scale.numel() == input.rows && scale.is_contiguous(),
      "CPU add_scaled_rows: x ", x.shape_string(), ", scale ", scale.shape_string(), " and out ", out.shape_string(),
      " do not match");
  const int64_t width = output.cols;
  const auto* scales = scale.data_as<const float>();
  std::vector<float> row_x(static_cast<size_t>(width)), row_out(static_cast<size_t>(width));
  std::vector<double> result(static_cast<size_t>(width));
  for (int64_t r = 0; r < output.rows; ++r) {
    // A token that chose no zero expert is left untouched (even where x holds inf or NaN).
    if (scales[r] == 0.0f) continue;
    load_row(input.row(r), input.dtype, width, row_x.data());
    load_row(output.row(r), output.dtype, width, row_out.data());
    for (int64_t c = 0; c < width; ++c) result[c] = row_out[c] + static_cast<double>(scales[r]) * row_x[c];
    store_row(result.data(), width, output.row(r), output.dtype);
  }
}

void copy(const TensorView& src, const TensorView& dst) {
  LATENTMOE_CHECK(src.device() == Device::cpu && dst.device() == Device::cpu,
                  "CPU copy: both tensors must be on the host");
  LATENTMOE_CHECK(src.shape() == dst.shape(), "CPU copy: shape ", src.shape_string(), " vs ", dst.shape_string());
  LATENTMOE_CHECK(src.dtype() == dst.dtype(), "CPU copy: dtype ", dtype_name(src.dtype()), " vs ",
                  dtype_name(dst.dtype()));
  const auto element = static_cast<int64_t>(dtype_size(src.dtype()));
  const int64_t count = src.numel();
  if (count == 0) return;
  if (src.is_contiguous() && dst.is_contiguous()) {
    std::memmove(dst.data(), src.data(), static_cast<size_t>(count * element));
    return;
  }
  // Strided: walk the leading indices in row-major order; copy each last-dimension row as one block
  // when it is contiguous on both sides, else element by element.
  const int last = src.rank() - 1;
  const int64_t width = src.size(last);
  const bool rows_contiguous = width <= 1 || (src.stride(last) == 1 && dst.stride(last) == 1);
  const auto* source = static_cast<const std::byte*>(src.data());
  auto* target = static_cast<std::byte*>(dst.data());
  std::array<int64_t, TensorView::kMaxRank> index{};
  for (int64_t done = 0; done < count; done += width) {
    int64_t src_offset = 0, dst_offset = 0;
    for (int dim = 0; dim < last; ++dim) {
      src_offset += index[dim] * src.stride(dim);
      dst_offset += index[dim] * dst.stride(dim);
    }
    if (rows_contiguous) {
      std::memmove(target + dst_offset * element, source + src_offset * element, static_cast<size_t>(width * element));
    } else {
      for (int64_t c = 0; c < width; ++c) {
        std::memmove(target + (dst_offset + c * dst.stride(last)) * element,
                     source + (src_offset + c * src.stride(last)) * element, static_cast<size_t>(element));
      }
    }
    for (int dim = last - 1; dim >= 0; --dim) {
      if (++index[dim] < src.size(dim)) break;
      index[dim] = 0;
    }
  }
}

}  // namespace latentmoe::detail::cpu

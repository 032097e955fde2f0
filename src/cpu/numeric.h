// Helpers shared by the CPU reference operations: dtype checks, rounding a double once to a compute
// dtype, and a plain row-major matrix view with row loads/stores. See docs/NUMERICS.md.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string_view>

#include "latentmoe/dtype.h"
#include "latentmoe/error.h"
#include "latentmoe/tensor.h"

namespace latentmoe::detail::cpu {

// Throws Error unless `dtype` is f32, bf16 or f16; `what` names the tensor.
inline void require_compute_dtype(DType dtype, std::string_view what) {
  LATENTMOE_CHECK(is_compute_dtype(dtype), "CPU backend: ", what, " has dtype ", dtype_name(dtype),
                  "; only F32, BF16 and F16 are supported");
}

inline void require_dtype(DType dtype, DType expected, std::string_view what) {
  LATENTMOE_CHECK(dtype == expected, "CPU backend: ", what, " has dtype ", dtype_name(dtype), ", expected ",
                  dtype_name(expected));
}

// Rounds a double to float with round-to-odd (truncate, then set the last bit when inexact). A later
// round-to-nearest-even to bf16 or f16 (>= 2 bits narrower) then gives exactly the correctly rounded
// double -> bf16/f16 result, so "rounded once" holds although the conversion goes through float.
inline float round_to_odd_float(double value) {
  float rounded = static_cast<float>(value);
  if (std::isnan(value) || static_cast<double>(rounded) == value) return rounded;
  if (std::fabs(static_cast<double>(rounded)) > std::fabs(value)) rounded = std::nextafter(rounded, 0.0f);
  uint32_t bits;
  std::memcpy(&bits, &rounded, sizeof(bits));
  bits |= 1u;
  std::memcpy(&rounded, &bits, sizeof(bits));
  return rounded;
}

// `value` rounded once (to nearest even) to `dtype`, returned as the float holding that value.
inline float round_to_dtype(DType dtype, double value) {
  if (dtype == DType::f32) return static_cast<float>(value);
  return round_through(dtype, round_to_odd_float(value));
}

// A row-major matrix: element (r, c) at data[r * row_stride + c] of `dtype`.
struct Matrix {
  void* data = nullptr;
  DType dtype = DType::f32;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t row_stride = 0;

  void* row(int64_t r) const {
    return static_cast<std::byte*>(data) + r * row_stride * static_cast<int64_t>(dtype_size(dtype));
  }
};

// Views a tensor as rows x cols: rank 1 is one row; rank 2 keeps its row stride (a column block);
// higher ranks must be contiguous and fold every leading dimension into rows.
inline Matrix as_matrix(const TensorView& view, std::string_view what) {
  LATENTMOE_CHECK(view.defined(), "CPU backend: ", what, " is undefined");
  LATENTMOE_CHECK(view.device() == Device::cpu, "CPU backend: ", what, " is not a host tensor");
  const int last = view.rank() - 1;
  LATENTMOE_CHECK(view.size(last) <= 1 || view.stride(last) == 1, "CPU backend: ", what,
                  " needs a contiguous last dimension");
  Matrix matrix{view.data(), view.dtype(), 1, view.size(last), view.size(last)};
  if (view.rank() == 2) {
    matrix.rows = view.size(0);
    matrix.row_stride = view.stride(0);
  } else if (view.rank() > 2) {
    LATENTMOE_CHECK(view.is_contiguous(), "CPU backend: ", what, " of shape ", view.shape_string(),
                    " must be contiguous");
    matrix.rows = view.size(last) == 0 ? 0 : view.numel() / view.size(last);
  }
  return matrix;
}

// Matrix e of a stacked [E, rows, cols] tensor (the routed experts' weights).
inline Matrix stacked_matrix(const TensorView& stacked, int64_t index, std::string_view what) {
  LATENTMOE_CHECK(stacked.defined() && stacked.rank() == 3, "CPU backend: ", what, " must be a rank-3 tensor");
  LATENTMOE_CHECK(stacked.size(2) <= 1 || stacked.stride(2) == 1, "CPU backend: ", what,
                  " needs a contiguous last dimension");
  auto* base = static_cast<std::byte*>(stacked.data()) +
               index * stacked.stride(0) * static_cast<int64_t>(dtype_size(stacked.dtype()));
  return Matrix{base, stacked.dtype(), stacked.size(1), stacked.size(2), stacked.stride(1)};
}

// Converts `count` elements of a compute dtype to float.
inline void load_row(const void* source, DType dtype, int64_t count, float* out) {
  switch (dtype) {
    case DType::f32:
      std::memcpy(out, source, static_cast<size_t>(count) * sizeof(float));
      return;
    case DType::bf16: {
      const auto* bits = static_cast<const uint16_t*>(source);
      for (int64_t i = 0; i < count; ++i) out[i] = bf16_to_float(bits[i]);
      return;
    }
    case DType::f16: {
      const auto* bits = static_cast<const uint16_t*>(source);
      for (int64_t i = 0; i < count; ++i) out[i] = f16_to_float(bits[i]);
      return;
    }
    default:
      require_compute_dtype(dtype, "a tensor");
  }
}

// Rounds `count` doubles once to a compute dtype.
inline void store_row(const double* values, int64_t count, void* out, DType dtype) {
  switch (dtype) {
    case DType::f32: {
      auto* floats = static_cast<float*>(out);
      for (int64_t i = 0; i < count; ++i) floats[i] = static_cast<float>(values[i]);
      return;
    }
    case DType::bf16: {
      auto* bits = static_cast<uint16_t*>(out);
      for (int64_t i = 0; i < count; ++i) bits[i] = float_to_bf16(round_to_odd_float(values[i]));
      return;
    }
    case DType::f16: {
      auto* bits = static_cast<uint16_t*>(out);
      for (int64_t i = 0; i < count; ++i) bits[i] = float_to_f16(round_to_odd_float(values[i]));
      return;
    }
    default:
      require_compute_dtype(dtype, "an output");
  }
}

// Rows [begin, end) of `matrix` as contiguous floats [end - begin, cols].
inline void load_rows(const Matrix& matrix, int64_t begin, int64_t end, float* out) {
  for (int64_t r = begin; r < end; ++r)
    load_row(matrix.row(r), matrix.dtype, matrix.cols, out + (r - begin) * matrix.cols);
}

// Stores contiguous doubles [rows, cols] into `matrix`, each rounded once.
inline void store_rows(const double* values, const Matrix& matrix) {
  for (int64_t r = 0; r < matrix.rows; ++r)
    store_row(values + r * matrix.cols, matrix.cols, matrix.row(r), matrix.dtype);
}

}  // namespace latentmoe::detail::cpu

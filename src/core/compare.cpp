#include "latentmoe/compare.h"

#include <cmath>
#include <cstring>
#include <limits>

#include "latentmoe/error.h"

namespace latentmoe {
namespace {

void check_comparable(const TensorView& out, const TensorView& ref) {
  LATENTMOE_CHECK(out.device() == Device::cpu && ref.device() == Device::cpu, "comparisons need host tensors");
  LATENTMOE_CHECK(out.shape() == ref.shape(), "cannot compare shape ", out.shape_string(), " with ",
                  ref.shape_string());
  LATENTMOE_CHECK(out.is_contiguous() && ref.is_contiguous(), "comparisons need contiguous tensors");
  LATENTMOE_CHECK(is_compute_dtype(out.dtype()) && is_compute_dtype(ref.dtype()), "cannot compare dtypes ",
                  dtype_name(out.dtype()), " and ", dtype_name(ref.dtype()));
}

}  // namespace

double max_relative_error(const TensorView& out, const TensorView& ref) {
  check_comparable(out, ref);
  double max_diff = 0.0, max_ref = 0.0;
  for (int64_t i = 0; i < out.numel(); ++i) {
    const double a = load_as_float(out.data(), out.dtype(), i);
    const double b = load_as_float(ref.data(), ref.dtype(), i);
    if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<double>::quiet_NaN();
    max_diff = std::max(max_diff, std::fabs(a - b));
    max_ref = std::max(max_ref, std::fabs(b));
  }
  return max_ref > 0.0 ? max_diff / max_ref : max_diff;
}

bool bitwise_equal(const TensorView& a, const TensorView& b) {
  if (a.shape() != b.shape() || a.dtype() != b.dtype()) return false;
  LATENTMOE_CHECK(a.is_contiguous() && b.is_contiguous() && a.device() == Device::cpu && b.device() == Device::cpu,
                  "bitwise_equal needs contiguous host tensors");
  return std::memcmp(a.data(), b.data(), static_cast<size_t>(a.numel()) * dtype_size(a.dtype())) == 0;
}

}  // namespace latentmoe

// Comparisons used by the demo, the tools and the tests.
#pragma once

#include <string>

#include "latentmoe/tensor.h"

namespace latentmoe {

// max_i |out_i - ref_i| / max_i |ref_i| over host tensors of equal shape (compute dtypes): the
// largest error relative to the tensor's scale, so that near-zero elements do not dominate.
// NaN anywhere gives NaN; a zero reference gives the max absolute difference.
double max_relative_error(const TensorView& out, const TensorView& ref);

// True when both host tensors have the same shape, dtype and bytes.
bool bitwise_equal(const TensorView& a, const TensorView& b);

}  // namespace latentmoe

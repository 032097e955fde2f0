#include "latentmoe/random.h"

#include "latentmoe/error.h"

namespace latentmoe {

HostTensor random_uniform_tensor(DType dtype, std::vector<int64_t> shape, uint64_t seed, float scale, float offset) {
  LATENTMOE_CHECK(is_compute_dtype(dtype), "random tensors of dtype ", dtype_name(dtype), " are not supported");
  HostTensor result(dtype, std::move(shape));
  SplitMix64 rng(seed);
  const int64_t count = result.numel();
  for (int64_t i = 0; i < count; ++i) {
    const float value = rng.uniform_pm1() * scale;  // exact product for power-of-two scales
    store_from_float(result.data(), dtype, i, offset + value);
  }
  return result;
}

}  // namespace latentmoe

#include "latentmoe/random.h"

#include "core/parallel_for.h"
#include "latentmoe/error.h"

namespace latentmoe {

HostTensor random_uniform_tensor(DType dtype, std::vector<int64_t> shape, uint64_t seed, float scale, float offset) {
  LATENTMOE_CHECK(is_compute_dtype(dtype), "random tensors of dtype ", dtype_name(dtype), " are not supported");
  HostTensor result(dtype, std::move(shape));
  void* data = result.data();
  detail::parallel_draws(result.numel(), seed, [&](int64_t i, SplitMix64& rng) {
    const float value = rng.uniform_pm1() * scale;  // exact product for power-of-two scales
    store_from_float(data, dtype, i, offset + value);
  });
  return result;
}

}  // namespace latentmoe

// Seeded uniform random fill of device memory (benchmarks and tests make their weights on the GPU
// instead of copying gigabytes from the host).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "latentmoe/dtype.h"

namespace latentmoe::cuda {

// data[i] = offset + scale * u_i with u_i uniform in [-1, 1), a pure function of (seed, i), rounded
// to `dtype` (f32, bf16 or f16). Enqueued on `stream`.
void fill_uniform(void* data, DType dtype, int64_t count, uint64_t seed, float scale, float offset,
                  cudaStream_t stream);

}  // namespace latentmoe::cuda

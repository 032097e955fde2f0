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

// Reads every 16-byte word of `buffer` (bytes a multiple of 16, buffer 16-byte aligned) through L2 and
// writes one word to `sink` only if their XOR equals a marker (so the reads are not optimised away). A
// benchmark's L2 flush: unlike a memset it leaves the cache full of clean lines, so the timed kernel
// after it does not pay for writing someone else's dirty lines back to DRAM.
void read_through(const void* buffer, size_t bytes, uint32_t* sink, cudaStream_t stream);

}  // namespace latentmoe::cuda

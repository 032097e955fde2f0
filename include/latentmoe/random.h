// Seeded random numbers that give the same bits on every compiler, standard library and device
// (std:: distributions do not): splitmix64 (Steele, Lea, Flood 2014) and uniform floats on [-1, 1)
// in steps of 2^-23, which are exact floats, so no rounding mode or FMA can change them.
#pragma once

#include <cstdint>
#include <vector>

#include "latentmoe/host_device.h"
#include "latentmoe/tensor.h"

namespace latentmoe {

class SplitMix64 {
 public:
  LATENTMOE_HOST_DEVICE explicit SplitMix64(uint64_t seed) : state_(seed) {}
  LATENTMOE_HOST_DEVICE uint64_t next() {
    state_ += 0x9e3779b97f4a7c15ull;
    uint64_t z = state_;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Skips `count` draws at once (the state advances by a constant per draw), so that a long stream can
  // be filled in parallel pieces with the same bits as in one sequential pass.
  LATENTMOE_HOST_DEVICE void discard(uint64_t count) { state_ += count * 0x9e3779b97f4a7c15ull; }
  LATENTMOE_HOST_DEVICE float uniform_pm1() {
    const int32_t k = static_cast<int32_t>(next() >> 40);  // 24 bits
    return static_cast<float>(k - (int32_t{1} << 23)) * 0x1p-23f;
  }

 private:
  uint64_t state_;
};

// The value at `index` of a stream that can be filled in parallel (one hash per element).
LATENTMOE_HOST_DEVICE inline float indexed_uniform_pm1(uint64_t seed, uint64_t index) {
  return SplitMix64(seed ^ (0xd1b54a32d192ed03ull * (index + 1))).uniform_pm1();
}

// A host tensor of `dtype` (f32, bf16, f16) with elements offset + scale * u, u from SplitMix64(seed)
// in order, each rounded once to the dtype. Large tensors are filled by several threads, with the same
// bits.
HostTensor random_uniform_tensor(DType dtype, std::vector<int64_t> shape, uint64_t seed, float scale = 1.0f,
                                 float offset = 0.0f);

}  // namespace latentmoe

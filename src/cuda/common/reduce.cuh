// Warp-level reductions shared by the kernels. Device code.
#pragma once

#include <cuda_runtime.h>

namespace latentmoe::cuda {

// The sum of `value` over the 32 lanes of a full warp, in a fixed butterfly order (every lane gets
// the same bits).
__device__ __forceinline__ float warp_sum(float value) {
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

}  // namespace latentmoe::cuda

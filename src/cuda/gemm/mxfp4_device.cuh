// Device helpers both MXFP4 decode kernel families share (mxfp4_decode.cu, mxfp4_decode_mma.cu).
#pragma once

#include <cstdint>

#include "latentmoe/mxfp4.h"

namespace latentmoe::cuda {

// Columns per E8M0 scale.
inline constexpr int kMxfp4Group = static_cast<int>(kMxfp4GroupSize);

// 2^(s - 127) as a float, exactly: s 1..254 normal, s 0 the subnormal 2^-127 (0xFF is refused at load).
__device__ __forceinline__ float e8m0_scale(uint32_t s) {
  return __int_as_float(max(static_cast<int>(s) << 23, 0x00400000));  // s >= 1: s << 23 >= 0x00800000
}

}  // namespace latentmoe::cuda

// Device helpers the MXFP4 kernels share (mxfp4_decode.cu, mxfp4_decode_mma.cu, and the grouped
// tensor-core GEMM's MXFP4 weights, grouped_gemm_mma.cuh).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "core/mxfp4_kernel_order.h"
#include "latentmoe/mxfp4.h"

namespace latentmoe::cuda {

// Columns per E8M0 scale.
inline constexpr int kMxfp4Group = static_cast<int>(kMxfp4GroupSize);

// 2^(s - 127) as a float, exactly: s 1..254 normal, s 0 the subnormal 2^-127 (0xFF is refused at load).
// A float max (two instructions with the shift; the integer max compiled to a compare and a select):
// s >= 1 gives at least 2^-126, s = 0 gives +0, which the max lifts to 2^-127 (no flush: -ftz=false).
__device__ __forceinline__ float e8m0_scale(uint32_t s) {
  return fmaxf(__uint_as_float(s << 23), __uint_as_float(0x00400000u));
}

// Every helper below that reads codes takes whole 32-bit words of codes in the *kernel order*
// (core/mxfp4_kernel_order.h, docs/MXFP4.md "The kernel order"): the runner permutes the bits of every word once,
// when the codes are put on the device. A word is 8 consecutive columns from a multiple of 8; "value i" is the
// code of column i of the word (nibble i of the canonical word). Pair k is values 2k and 2k + 1: two adjacent
// columns, in the order a row of activations holds them.

// Values 2k and 2k + 1 of the kernel-order word `w` placed as the bits of a 2-element register of T (value 2k in
// the low half) whose values are E2M1 * 2^-126 (bf16) or E2M1 * 2^-14 (f16), exactly: the magnitude bits become the
// low exponent bits and the top mantissa bit, the sign the sign. bf16: one rotate and one mask per pair (pair 0:
// the mask only, pair 3: two of each), 9 integer instructions a word; f16: 2 more per pair.
template <class T, int kI>
__device__ __forceinline__ uint32_t e2m1_pair_bits(uint32_t w) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return ::latentmoe::detail::mxfp4_pair_bits_bf16<kI>(w);
  } else {
    return ::latentmoe::detail::mxfp4_pair_bits_f16<kI>(w);
  }
}

// Values 2k and 2k + 1 of the kernel-order word `w` (E2M1: a sign and a magnitude index) as a 2-element register
// of T (value 2k in the low half), exact: e2m1_pair_bits, then one multiply by 2^126 (bf16) or 2^14 (f16).
template <class T, int kI>
__device__ __forceinline__ uint32_t e2m1_pair(uint32_t w) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const uint32_t bits = e2m1_pair_bits<T, kI>(w);
    __nv_bfloat162 value = *reinterpret_cast<const __nv_bfloat162*>(&bits);
    value = __hmul2(value, __nv_bfloat162(__ushort_as_bfloat16(0x7E80), __ushort_as_bfloat16(0x7E80)));  // 2^126
    return *reinterpret_cast<const uint32_t*>(&value);
  } else {
    const uint32_t bits = e2m1_pair_bits<T, kI>(w);
    __half2 value = *reinterpret_cast<const __half2*>(&bits);
    value = __hmul2(value, __half2(__ushort_as_half(0x7400), __ushort_as_half(0x7400)));  // 2^14
    return *reinterpret_cast<const uint32_t*>(&value);
  }
}

// Values 2k and 2k + 1 of the kernel-order word `w` times 2^(s - 127) for the scale byte s of `factor`, a bf16 pair of
// 2^(s - 1) (scale_factor_bf16): exact for every s <= 128 (E2M1 * 2^-126 times 2^(s - 1); the smallest product, 2^-128,
// is a bf16 subnormal).
template <int kI>
__device__ __forceinline__ uint32_t e2m1_pair_scaled_bf16(uint32_t w, uint32_t factor) {
  const uint32_t bits = e2m1_pair_bits<__nv_bfloat16, kI>(w);
  const __nv_bfloat162 value =
      __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&bits), *reinterpret_cast<const __nv_bfloat162*>(&factor));
  return *reinterpret_cast<const uint32_t*>(&value);
}

// The bf16 pair (2^(s - 1), 2^(s - 1)) for byte q of `scales_plus_126` (a word of four scale bytes, each plus
// 126 without carry: every byte <= 128): exponent field s + 126.
template <int kQ>
__device__ __forceinline__ uint32_t scale_factor_bf16(uint32_t scales_plus_126) {
  return __byte_perm(scales_plus_126, 0u, 0x4040u | (kQ << 8) | kQ) << 7;
}

// Values 2k and 2k + 1 of the kernel-order word `w` as floats, exactly (the bf16 bits widened, times 2^126; the
// smallest, 2^-127, is a float subnormal, which no flag flushes here).
template <int kI>
__device__ __forceinline__ float2 e2m1_pair_float(uint32_t w) {
  const uint32_t bits = e2m1_pair_bits<__nv_bfloat16, kI>(w);
  return make_float2(__uint_as_float(bits << 16) * 0x1p126f, __uint_as_float(bits & 0xFFFF0000u) * 0x1p126f);
}

// Whether any of the four scale bytes of `w` exceeds 128 (2^(s - 1) then leaves bf16's range).
__device__ __forceinline__ bool any_scale_above_128(uint32_t w) {
  return ((w & 0x80808080u) & ((w & 0x7F7F7F7Fu) + 0x7F7F7F7Fu)) != 0u;
}

// The 8 consecutive values of one kernel-order code word (value i the word's column i) times the group's
// scale 2^(s - 127), as 8 elements of T in column order (16 bytes). bf16: the product is exact where it
// is a bf16 (every scale byte but 254 and 253 with the largest codes, which overflow to infinity); f16:
// exact for products inside f16's range, smaller ones round to f16 subnormals or zero, larger ones
// overflow (the scale is applied in fp32, then rounded once).
// bf16 with s <= 128 (every scale a checkpoint is likely to hold): one multiply a pair, the raw pair bits times
// 2^(s - 1) (e2m1_pair_scaled_bf16); larger s: two, the exact E2M1 values times 2^(s - 127). Both are exact, so the
// two paths give the same bits wherever both apply. The lanes of a warp may take different paths; ptxas brackets
// the branch with a reconvergence barrier (BSSY/BSYNC in the sm_90a SASS), so the warp is converged again when
// this returns, as the callers' warp-wide (.aligned) MMA and wgmma instructions need.
template <class T>
__device__ __forceinline__ uint4 mxfp4_decode8(uint32_t code, uint32_t scale_byte) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    if (scale_byte <= 128u) {
      const uint32_t factor = ((scale_byte + 126u) << 7) * 0x00010001u;  // (2^(s - 1), 2^(s - 1))
      return make_uint4(e2m1_pair_scaled_bf16<0>(code, factor), e2m1_pair_scaled_bf16<1>(code, factor),
                        e2m1_pair_scaled_bf16<2>(code, factor), e2m1_pair_scaled_bf16<3>(code, factor));
    }
  }
  // The pairs are (v0, v1), (v2, v3), (v4, v5), (v6, v7): the 16 bytes in column order as they come.
  uint32_t words[4] = {e2m1_pair<T, 0>(code), e2m1_pair<T, 1>(code), e2m1_pair<T, 2>(code), e2m1_pair<T, 3>(code)};
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    // 2^(s - 127) as a bf16: exponent field s (s > 128 here).
    const uint16_t bits = static_cast<uint16_t>(scale_byte << 7);
    const __nv_bfloat162 scale(__ushort_as_bfloat16(bits), __ushort_as_bfloat16(bits));
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const __nv_bfloat162 v = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&words[i]), scale);
      words[i] = *reinterpret_cast<const uint32_t*>(&v);
    }
  } else {
    const float scale = e8m0_scale(scale_byte);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 v = __half22float2(*reinterpret_cast<const __half2*>(&words[i]));
      const __half2 h = __floats2half2_rn(v.x * scale, v.y * scale);
      words[i] = *reinterpret_cast<const uint32_t*>(&h);
    }
  }
  return make_uint4(words[0], words[1], words[2], words[3]);
}

}  // namespace latentmoe::cuda

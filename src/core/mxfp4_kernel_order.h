// The kernel order of MXFP4 codes (issue 31, docs/MXFP4.md "The kernel order"): a fixed permutation of the bits
// of every little-endian 32-bit word of packed E2M1 codes, applied once when the codes are put on a GPU, so that
// the GPU kernels decode a word in 9 integer instructions, straight into registers in column order. Written once here,
// for the host (latentmoe/mxfp4.h's public conversions, the CPU tests) and the device (mxfp4_device.cuh's decode
// helpers, the conversion kernel).
//
// A canonical word (the checkpoint's layout) holds 8 consecutive columns: value i in nibble i (bits 4i..4i+3; bit
// 3 of a nibble the sign, bits 0..2 the magnitude index, bit 0 the mantissa). The kernels decode it in pairs:
// pair k (k = 0..3) is the adjacent values 2k and 2k + 1, wanted as the bits of a 2-element bf16 register whose
// values are E2M1 * 2^-126: value 2k's magnitude bits 0, 1, 2 at bits 6, 7, 8 and its sign at bit 15, value
// 2k + 1's at 22, 23, 24 and 31. These 8 target bits are T = kMxfp4PairMask (0x81C081C0). Adjacent values make a
// pair register hold two consecutive columns, as a row of activations in memory does: the tensor-core kernels
// take their activation fragments as plain 32-bit words (no byte permutes) and a decoded word's four pairs are
// its 16 bytes in column order.
//
// The kernel order stores pair k so that one rotate (SHF.L.W) and one mask (LOP3) bring it to T:
//   pair 0 (values 0, 1) at T itself:            decode  w & 0x81C081C0
//   pair 1 (values 2, 3) at (T - 6) mod 32:      decode  rotl(w, 6) & 0x81C081C0
//   pair 2 (values 4, 5) at (T - 12) mod 32:     decode  rotl(w, 12) & 0x81C081C0
//   pair 3 (values 6, 7) in the 8 bits left, split between two rotations:
//     target bits A = 0x80C080C0 (bits 6, 7, 15, 22, 23, 31) at (t - 2) mod 32,
//     target bits B = 0x01000100 (bits 8, 24) at (t - 10) mod 32:
//                                                decode  (rotl(w, 2) & A) | (rotl(w, 10) & B)
// so a whole word costs 1 + 2 + 2 + 4 = 9 integer instructions. Pairs 0-2 fill bits {0-3, 6-12, 15-19, 22-28,
// 31}; pair 3's A bits land on 4, 5, 13, 20, 21, 29 and its B bits on 30, 14: every bit of the word is used once (a
// bijection, tested in tests/test_mxfp4_kernel_order.cpp). The rotations {0, 6, 12} and {2, 10} and the split of
// pair 3 were found by a short exhaustive search; which values form a pair does not enter it (the permutation
// moves whole target fields), so the pairing is free to follow the consumers.
//
// For f16 (values E2M1 * 2^-14: magnitude at bits 9..11 and 25..27, sign at 15 and 31), the bf16 bits b give the
// f16 bits as b + 7 * (b & 0x01C001C0): the magnitude moves up 3 bits, the sign stays (2 more instructions).
#pragma once

#include <cstdint>

#include "latentmoe/host_device.h"

namespace latentmoe::detail {

// The target bits of one pair (bf16: magnitudes at 6..8 and 22..24, signs at 15 and 31).
inline constexpr uint32_t kMxfp4PairMask = 0x81C081C0u;
// Pair 3: the target bits stored rotated by kMxfp4Pair3RotationA, the others by kMxfp4Pair3RotationB.
inline constexpr uint32_t kMxfp4Pair3MaskA = 0x80C080C0u;
inline constexpr uint32_t kMxfp4Pair3MaskB = 0x01000100u;
// Pairs 0, 1, 2: the left rotation that decodes them (0, 6, 12).
LATENTMOE_HOST_DEVICE constexpr int mxfp4_pair_rotation(int pair) { return 6 * pair; }
inline constexpr int kMxfp4Pair3RotationA = 2;
inline constexpr int kMxfp4Pair3RotationB = 10;
// f16 targets: the bf16 magnitude bits, moved up by 3.
inline constexpr uint32_t kMxfp4PairMagnitudeMask = 0x01C001C0u;

// A 32-bit rotate (one SHF.L.W on the GPU; r in 0..31).
LATENTMOE_HOST_DEVICE constexpr uint32_t rotl32(uint32_t w, int r) { return r == 0 ? w : (w << r) | (w >> (32 - r)); }
LATENTMOE_HOST_DEVICE constexpr uint32_t rotr32(uint32_t w, int r) { return rotl32(w, (32 - r) & 31); }

// Pair k of a *canonical* word at its target bits: nibble 2k's magnitude to bits 6..8 and its sign to bit 15,
// nibble 2k + 1's to 22..24 and 31 (the conversion's source; the kernels never decode the canonical order).
template <int kI>
LATENTMOE_HOST_DEVICE constexpr uint32_t mxfp4_canonical_pair_bits(uint32_t w) {
  const uint32_t low = (w >> (8 * kI)) & 0xFu, high = (w >> (8 * kI + 4)) & 0xFu;
  return ((low & 7u) << 6) | ((low >> 3) << 15) | ((high & 7u) << 22) | ((high >> 3) << 31);
}

// The inverse: target bits of pair k back to their nibbles 2k and 2k + 1 of a canonical word.
template <int kI>
LATENTMOE_HOST_DEVICE constexpr uint32_t mxfp4_canonical_from_pair_bits(uint32_t bits) {
  const uint32_t low = ((bits >> 6) & 7u) | (((bits >> 15) & 1u) << 3);
  const uint32_t high = ((bits >> 22) & 7u) | (((bits >> 31) & 1u) << 3);
  return (low << (8 * kI)) | (high << (8 * kI + 4));
}

// Pair k of a *kernel-order* word at its target bits: bf16 bits of (value 2k, value 2k + 1) * 2^-126, value 2k in
// the low half. The decode the GPU kernels run (mxfp4_device.cuh): 1, 2, 2 and 4 instructions for pairs 0..3.
template <int kI>
LATENTMOE_HOST_DEVICE constexpr uint32_t mxfp4_pair_bits_bf16(uint32_t w) {
  static_assert(kI >= 0 && kI < 4, "a word holds pairs 0..3");
  if constexpr (kI < 3) {
    return rotl32(w, mxfp4_pair_rotation(kI)) & kMxfp4PairMask;
  } else {
    return (rotl32(w, kMxfp4Pair3RotationA) & kMxfp4Pair3MaskA) | (rotl32(w, kMxfp4Pair3RotationB) & kMxfp4Pair3MaskB);
  }
}

// The same as f16 bits of (value 2k, value 2k + 1) * 2^-14: the magnitude fields 3 bits higher (b - m + 8m).
template <int kI>
LATENTMOE_HOST_DEVICE constexpr uint32_t mxfp4_pair_bits_f16(uint32_t w) {
  const uint32_t b = mxfp4_pair_bits_bf16<kI>(w);
  return b + 7u * (b & kMxfp4PairMagnitudeMask);
}

// A canonical word in kernel order: each pair's target bits rotated right by the rotation that decodes it.
LATENTMOE_HOST_DEVICE constexpr uint32_t mxfp4_to_kernel_order(uint32_t w) {
  const uint32_t pair3 = mxfp4_canonical_pair_bits<3>(w);
  return rotr32(mxfp4_canonical_pair_bits<0>(w), mxfp4_pair_rotation(0)) |
         rotr32(mxfp4_canonical_pair_bits<1>(w), mxfp4_pair_rotation(1)) |
         rotr32(mxfp4_canonical_pair_bits<2>(w), mxfp4_pair_rotation(2)) |
         rotr32(pair3 & kMxfp4Pair3MaskA, kMxfp4Pair3RotationA) |
         rotr32(pair3 & kMxfp4Pair3MaskB, kMxfp4Pair3RotationB);
}

// The inverse: a kernel-order word back in the canonical order.
LATENTMOE_HOST_DEVICE constexpr uint32_t mxfp4_from_kernel_order(uint32_t w) {
  return mxfp4_canonical_from_pair_bits<0>(mxfp4_pair_bits_bf16<0>(w)) |
         mxfp4_canonical_from_pair_bits<1>(mxfp4_pair_bits_bf16<1>(w)) |
         mxfp4_canonical_from_pair_bits<2>(mxfp4_pair_bits_bf16<2>(w)) |
         mxfp4_canonical_from_pair_bits<3>(mxfp4_pair_bits_bf16<3>(w));
}

// Compile-time checks of the spec: the masks split pair 3's targets, and every bit of a word is used exactly once.
static_assert((kMxfp4Pair3MaskA | kMxfp4Pair3MaskB) == kMxfp4PairMask && (kMxfp4Pair3MaskA & kMxfp4Pair3MaskB) == 0);
static_assert((rotr32(kMxfp4PairMask, 0) | rotr32(kMxfp4PairMask, 6) | rotr32(kMxfp4PairMask, 12) |
               rotr32(kMxfp4Pair3MaskA, 2) | rotr32(kMxfp4Pair3MaskB, 10)) == 0xFFFFFFFFu);
static_assert(mxfp4_to_kernel_order(0xFFFFFFFFu) == 0xFFFFFFFFu && mxfp4_to_kernel_order(0u) == 0u);
static_assert(mxfp4_from_kernel_order(mxfp4_to_kernel_order(0x12345678u)) == 0x12345678u);

}  // namespace latentmoe::detail

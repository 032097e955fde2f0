// MXFP4 weights as Kimi K3 publishes its routed experts (compressed-tensors "mxfp4-pack-quantized",
// DESIGN section 3, docs/FILES.md): a matrix [rows, cols] is stored as
//   packed [rows, cols/2] U8: two E2M1 codes a byte, the even column in the low nibble;
//   scales [rows, cols/32] U8: one E8M0 exponent per group of 32 consecutive columns, 2^(byte-127).
// Every value is e2m1 * 2^(s-127). The decoding here is exact in double: an E2M1 magnitude has at
// most two significant bits and a scale is a power of two in [2^-127, 2^127], so the product (at most
// 6 * 2^127, beyond float and bf16) fits a double without rounding.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace latentmoe {

// Columns per scale (the compressed-tensors group_size of MXFP4).
inline constexpr int64_t kMxfp4GroupSize = 32;
// The one E8M0 byte that is not a power of two (NaN); rejected when weights are loaded.
inline constexpr uint8_t kE8m0Nan = 0xFF;

// The value of the E2M1 code in the low 4 bits of `code`: bit 3 the sign, bits 0-2 index the
// magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}. Code 0x8 is -0.0.
double e2m1_value(uint8_t code);

// The exponent of an E8M0 scale byte: byte - 127 (0x00 gives -127: 2^-127, not zero). Meaningless
// for 0xFF, which callers reject first (check_e8m0_scales).
inline int e8m0_exponent(uint8_t scale) { return static_cast<int>(scale) - 127; }

// 2^(byte - 127) as a double; NaN for 0xFF.
double e8m0_value(uint8_t scale);

// Decodes columns [begin, begin + count) of one MXFP4 row into `out`, exactly. `packed_row` points
// at the packed byte of column 0, `scale_row` at the scale of columns [0, 32). A 0xFF scale gives NaN.
void mxfp4_decode_row(const uint8_t* packed_row, const uint8_t* scale_row, int64_t begin, int64_t count, double* out);

// Throws Error "<what>: scale byte 0xFF (NaN) at row R, group G (columns [32G, 32G + 32))" for the
// first 0xFF in a [rows, groups] scale matrix whose rows are `row_stride` bytes apart. The reported
// row and group are offset by `row_offset` and `group_offset` (positions in a larger tensor that the
// matrix is a slice of).
void check_e8m0_scales(const uint8_t* scales, int64_t rows, int64_t groups, int64_t row_stride, std::string_view what,
                       int64_t row_offset = 0, int64_t group_offset = 0);

// The order of the bits of the packed codes, per little-endian 32-bit word (8 codes: 8 consecutive columns from
// a multiple of 8). `canonical` is the checkpoint's layout above, the one every host tensor and the CPU backend
// use. `kernel` is the order the CUDA kernels read (issue 31, docs/MXFP4.md "The kernel order"): a fixed
// permutation of the 32 bits of every word that lets a kernel decode a word in 9 integer instructions instead of
// ~15. A Runner converts the MXFP4 expert codes it copies to a GPU itself; codes already on the GPU (device
// LayerWeightViews) must be converted once by their owner (mxfp4_to_kernel_order in latentmoe/runner.h) and
// declared so (LayerWeightViews::expert_code_order). Scales are never permuted.
enum class Mxfp4CodeOrder { canonical, kernel };
std::string_view to_string(Mxfp4CodeOrder order);

// One word of codes from the canonical order to the kernel order, and back (a bijection on the 32 bits).
uint32_t mxfp4_word_to_kernel_order(uint32_t word);
uint32_t mxfp4_word_from_kernel_order(uint32_t word);

// Converts `bytes` bytes of packed codes in place, word by word (little-endian 32-bit words, any alignment).
// Throws Error unless `bytes` is a multiple of 4: a code row is cols/2 bytes with cols a multiple of 32, so whole
// rows always are, and a length that is not cannot be whole words of codes.
void mxfp4_codes_to_kernel_order(uint8_t* codes, size_t bytes);
void mxfp4_codes_from_kernel_order(uint8_t* codes, size_t bytes);

}  // namespace latentmoe

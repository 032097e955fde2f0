#include "latentmoe/mxfp4.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/mxfp4_kernel_order.h"
#include "latentmoe/error.h"

namespace latentmoe {
namespace {

// E2M1 (1 sign, 2 exponent, 1 mantissa bit, exponent bias 1, no infinities or NaN): codes 0-7 are
// 0, 0.5 (the subnormal), 1, 1.5, 2, 3, 4, 6; codes 8-15 their negatives (8 is -0).
constexpr double kE2m1Values[16] = {0.0,  0.5,  1.0,  1.5,  2.0,  3.0,  4.0,  6.0,
                                    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0};

template <uint32_t (*kConvert)(uint32_t)>
void convert_words(uint8_t* codes, size_t bytes, const char* what) {
  LATENTMOE_CHECK(bytes % 4 == 0, what, ": ", bytes,
                  " bytes of MXFP4 codes is not a whole number of 32-bit words (8 codes each); a code row of "
                  "cols/2 bytes with cols a multiple of 32 always is");
  LATENTMOE_CHECK(codes != nullptr || bytes == 0, what, ": no codes");
  for (size_t i = 0; i < bytes; i += 4) {
    uint8_t* b = codes + i;  // a little-endian word, as the GPU reads it
    const uint32_t word = kConvert(uint32_t{b[0]} | uint32_t{b[1]} << 8 | uint32_t{b[2]} << 16 | uint32_t{b[3]} << 24);
    for (int j = 0; j < 4; ++j) b[j] = static_cast<uint8_t>(word >> (8 * j));
  }
}

}  // namespace

std::string_view to_string(Mxfp4CodeOrder order) { return order == Mxfp4CodeOrder::kernel ? "kernel" : "canonical"; }

uint32_t mxfp4_word_to_kernel_order(uint32_t word) { return detail::mxfp4_to_kernel_order(word); }
uint32_t mxfp4_word_from_kernel_order(uint32_t word) { return detail::mxfp4_from_kernel_order(word); }

void mxfp4_codes_to_kernel_order(uint8_t* codes, size_t bytes) {
  convert_words<detail::mxfp4_to_kernel_order>(codes, bytes, "mxfp4_codes_to_kernel_order");
}

void mxfp4_codes_from_kernel_order(uint8_t* codes, size_t bytes) {
  convert_words<detail::mxfp4_from_kernel_order>(codes, bytes, "mxfp4_codes_from_kernel_order");
}

double e2m1_value(uint8_t code) { return kE2m1Values[code & 0x0F]; }

double e8m0_value(uint8_t scale) {
  if (scale == kE8m0Nan) return std::numeric_limits<double>::quiet_NaN();
  return std::ldexp(1.0, e8m0_exponent(scale));
}

void mxfp4_decode_row(const uint8_t* packed_row, const uint8_t* scale_row, int64_t begin, int64_t count, double* out) {
  int64_t column = begin;
  const int64_t end = begin + count;
  while (column < end) {
    const int64_t group = column / kMxfp4GroupSize;
    const int64_t group_end = std::min(end, (group + 1) * kMxfp4GroupSize);
    const double scale = e8m0_value(scale_row[group]);
    for (; column < group_end; ++column) {
      const uint8_t byte = packed_row[column / 2];
      const uint8_t code = (column & 1) == 0 ? byte & 0x0F : byte >> 4;
      *out++ = kE2m1Values[code] * scale;  // exact: a power of two times a 2-bit significand
    }
  }
}

void check_e8m0_scales(const uint8_t* scales, int64_t rows, int64_t groups, int64_t row_stride, std::string_view what,
                       int64_t row_offset, int64_t group_offset) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = scales + r * row_stride;
    for (int64_t g = 0; g < groups; ++g) {
      if (row[g] != kE8m0Nan) continue;
      const int64_t group = group_offset + g;
      detail::throw_error(what, ": scale byte 0xFF (NaN) at row ", row_offset + r, ", group ", group, " (columns [",
                          group * kMxfp4GroupSize, ", ", (group + 1) * kMxfp4GroupSize,
                          ")); an E8M0 scale must be 0x00..0xFE");
    }
  }
}

}  // namespace latentmoe

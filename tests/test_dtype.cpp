#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "latentmoe/dtype.h"
#include "latentmoe/error.h"
#include "latentmoe/tensor.h"

namespace latentmoe {
namespace {

TEST(DType, NamesAndSizesRoundTrip) {
  for (DType dtype : {DType::f64, DType::f32, DType::f16, DType::bf16, DType::i64, DType::i32, DType::i16, DType::i8,
                      DType::u8, DType::boolean, DType::f8_e4m3, DType::f8_e5m2}) {
    auto parsed = parse_dtype(dtype_name(dtype));
    ASSERT_TRUE(parsed.has_value()) << dtype_name(dtype);
    EXPECT_EQ(*parsed, dtype);
  }
  EXPECT_EQ(dtype_size(DType::bf16), 2u);
  EXPECT_EQ(dtype_size(DType::f64), 8u);
  EXPECT_FALSE(parse_dtype("F31").has_value());
  EXPECT_FALSE(parse_dtype("f32").has_value());  // safetensors names are upper case
}

TEST(DType, Bf16HandComputed) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(float_to_bf16(-2.0f), 0xc000);
  // 1 + 2^-8 is exactly half way between bf16 1.0 and 1.0078125: ties to even (1.0).
  EXPECT_EQ(float_to_bf16(1.0f + 1.0f / 256), 0x3f80);
  // 1 + 3*2^-8 is half way between 1.0078125 (odd) and 1.015625 (even): rounds up.
  EXPECT_EQ(float_to_bf16(1.0f + 3.0f / 256), 0x3f82);
  EXPECT_EQ(bf16_to_float(0x4049), 3.140625f);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(bf16_to_float(float_to_bf16(std::numeric_limits<float>::infinity())),
            std::numeric_limits<float>::infinity());
}

TEST(DType, F16HandComputed) {
  EXPECT_EQ(float_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(float_to_f16(-2.5f), 0xc100);
  EXPECT_EQ(float_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(float_to_f16(65520.0f), 0x7c00);               // half way to the next binade rounds to inf
  EXPECT_EQ(float_to_f16(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(float_to_f16(std::ldexp(1.0f, -25)), 0x0000);  // tie to even: zero
  EXPECT_EQ(float_to_f16(std::ldexp(3.0f, -25)), 0x0002);  // 1.5 ulp: ties to even 2
  EXPECT_EQ(f16_to_float(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(f16_to_float(0x03ff), std::ldexp(1023.0f, -24));
  EXPECT_EQ(f16_to_float(0x3555), 0.333251953125f);
  EXPECT_EQ(float_to_f16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // tie to even
  EXPECT_EQ(float_to_f16(1.0f + std::ldexp(3.0f, -11)), 0x3c02);  // tie to even, up
  EXPECT_TRUE(std::isnan(f16_to_float(float_to_f16(std::nanf("")))));
}

TEST(DType, F16RoundTripsEveryFiniteValue) {
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    uint16_t half = static_cast<uint16_t>(bits);
    if ((half & 0x7c00) == 0x7c00 && (half & 0x3ff) != 0) continue;  // NaN payloads
    EXPECT_EQ(float_to_f16(f16_to_float(half)), half) << std::hex << bits;
  }
}

TEST(TensorView, SlicesAndStrides) {
  float data[12];
  for (int i = 0; i < 12; ++i) data[i] = static_cast<float>(i);
  TensorView matrix(data, DType::f32, {3, 4});
  EXPECT_TRUE(matrix.is_contiguous());
  TensorView columns = matrix.slice_cols(1, 3);
  EXPECT_FALSE(columns.is_contiguous());
  EXPECT_EQ(columns.stride(0), 4);
  HostTensor copy = to_host_tensor(columns, DType::f32);
  EXPECT_EQ(copy.data_as<float>()[0], 1.0f);
  EXPECT_EQ(copy.data_as<float>()[3], 6.0f);
  EXPECT_EQ(matrix.slice_rows(2, 3).data_as<float>()[0], 8.0f);
  EXPECT_THROW(matrix.slice_rows(2, 4), Error);
  EXPECT_THROW(matrix.reshaped({5, 2}), Error);
  EXPECT_EQ(matrix.shape_string(), "[3, 4]");
}

}  // namespace
}  // namespace latentmoe

// Element types and the scalar conversions between the 16-bit float formats and float.
#pragma once

#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace latentmoe {

// Every dtype a safetensors file may carry. Only f32, bf16 and f16 are compute types;
// i32 is used for topk_ids. The others can be listed (inspect) but not computed with.
enum class DType : uint8_t { f64, f32, f16, bf16, i64, i32, i16, i8, u8, boolean, f8_e4m3, f8_e5m2 };

// Size in bytes of one element.
size_t dtype_size(DType dtype);
// The safetensors spelling: "F32", "BF16", ...
std::string_view dtype_name(DType dtype);
// Parses the safetensors spelling; nullopt for an unknown name.
std::optional<DType> parse_dtype(std::string_view name);
// f32, bf16 or f16: the types the layer computes in.
bool is_compute_dtype(DType dtype);

// bf16 <-> float. float_to_bf16 rounds to nearest even and keeps NaN a (quiet) NaN.
inline float bf16_to_float(uint16_t bits) {
  uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &widened, sizeof(value));
  return value;
}

inline uint16_t float_to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  uint32_t rounding_bias = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding_bias) >> 16);
}

// IEEE binary16 <-> float, round to nearest even, with subnormals, infinities and NaN.
float f16_to_float(uint16_t bits);
uint16_t float_to_f16(float value);

// Loads element i of a buffer of compute dtype `dtype` as float / stores a float rounded to it.
inline float load_as_float(const void* data, DType dtype, int64_t index) {
  switch (dtype) {
    case DType::f32:
      return static_cast<const float*>(data)[index];
    case DType::bf16:
      return bf16_to_float(static_cast<const uint16_t*>(data)[index]);
    case DType::f16:
      return f16_to_float(static_cast<const uint16_t*>(data)[index]);
    default:
      return 0.0f;  // callers validate the dtype before the loop
  }
}

inline void store_from_float(void* data, DType dtype, int64_t index, float value) {
  switch (dtype) {
    case DType::f32:
      static_cast<float*>(data)[index] = value;
      break;
    case DType::bf16:
      static_cast<uint16_t*>(data)[index] = float_to_bf16(value);
      break;
    case DType::f16:
      static_cast<uint16_t*>(data)[index] = float_to_f16(value);
      break;
    default:
      break;
  }
}

// Rounds a float through `dtype` and back (identity for f32).
inline float round_through(DType dtype, float value) {
  switch (dtype) {
    case DType::bf16:
      return bf16_to_float(float_to_bf16(value));
    case DType::f16:
      return f16_to_float(float_to_f16(value));
    default:
      return value;
  }
}

}  // namespace latentmoe

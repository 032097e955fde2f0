// The kernel order of MXFP4 codes (issue 31, core/mxfp4_kernel_order.h, docs/MXFP4.md "The kernel order"): the
// permutation is a bijection with its inverse, the decode the GPU kernels run (the same host/device functions,
// compiled here for the host) gives every code's exact bf16 and f16 bits at every position of a word, the public
// buffer conversion refuses lengths that are not whole words, and the runner refuses host codes declared in the
// kernel order (the CUDA side, device views declared canonical, is in tests/cuda/test_cuda_runner.cpp).
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <set>
#include <vector>

#include "core/mxfp4_kernel_order.h"
#include "error_test_util.h"
#include "latentmoe/config.h"
#include "latentmoe/in_process_group.h"
#include "latentmoe/mxfp4.h"
#include "latentmoe/presets.h"
#include "latentmoe/random.h"
#include "latentmoe/runner.h"
#include "latentmoe/weights.h"
#include "layer_test_util.h"

namespace latentmoe {
namespace {

using testing::expect_error;

std::vector<uint32_t> random_words(int count, uint64_t seed) {
  SplitMix64 rng(seed);
  std::vector<uint32_t> words(count);
  for (uint32_t& word : words) word = static_cast<uint32_t>(rng.next());
  return words;
}

// A canonical word whose nibble `position` is `code` and whose other nibbles are `others`'.
uint32_t with_code(uint32_t others, int position, int code) {
  return (others & ~(0xFu << (4 * position))) | (static_cast<uint32_t>(code) << (4 * position));
}

// The value of a bf16 / f16 bit pattern, decoded from the format's definition (not from the E2M1 layout).
double bf16_value(uint16_t bits) {
  const uint32_t word = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &word, 4);
  return value;
}

double f16_value(uint16_t bits) {
  const int exponent = (bits >> 10) & 0x1F, mantissa = bits & 0x3FF;
  const double magnitude = exponent == 0 ? std::ldexp(mantissa, -24) : std::ldexp(1024 + mantissa, exponent - 25);
  return (bits & 0x8000) ? -magnitude : magnitude;
}

// Pair `pair` of kernel-order word `w` through the decode the kernels run.
uint32_t pair_bits(uint32_t w, int pair, bool f16) {
  switch (pair) {
    case 0:
      return f16 ? detail::mxfp4_pair_bits_f16<0>(w) : detail::mxfp4_pair_bits_bf16<0>(w);
    case 1:
      return f16 ? detail::mxfp4_pair_bits_f16<1>(w) : detail::mxfp4_pair_bits_bf16<1>(w);
    case 2:
      return f16 ? detail::mxfp4_pair_bits_f16<2>(w) : detail::mxfp4_pair_bits_bf16<2>(w);
    default:
      return f16 ? detail::mxfp4_pair_bits_f16<3>(w) : detail::mxfp4_pair_bits_bf16<3>(w);
  }
}

uint32_t rotl(uint32_t w, int r) { return r == 0 ? w : (w << r) | (w >> (32 - r)); }

TEST(Mxfp4KernelOrder, every_single_bit_goes_to_a_different_single_bit_and_back) {
  std::set<int> targets;
  for (int bit = 0; bit < 32; ++bit) {
    const uint32_t word = uint32_t{1} << bit;
    const uint32_t kernel = mxfp4_word_to_kernel_order(word);
    ASSERT_EQ(std::popcount(kernel), 1) << "bit " << bit;
    targets.insert(std::countr_zero(kernel));
    EXPECT_EQ(mxfp4_word_from_kernel_order(kernel), word) << "bit " << bit;
    // The inverse alone is a permutation too.
    EXPECT_EQ(std::popcount(mxfp4_word_from_kernel_order(word)), 1) << "bit " << bit;
  }
  EXPECT_EQ(targets.size(), 32u);
}

TEST(Mxfp4KernelOrder, random_words_round_trip_both_ways) {
  for (uint32_t word : random_words(100000, 31)) {
    ASSERT_EQ(mxfp4_word_from_kernel_order(mxfp4_word_to_kernel_order(word)), word) << std::hex << word;
    ASSERT_EQ(mxfp4_word_to_kernel_order(mxfp4_word_from_kernel_order(word)), word) << std::hex << word;
  }
  EXPECT_EQ(mxfp4_word_to_kernel_order(0u), 0u);  // zero-filled codes (the kernels' padding) stay zeros
  EXPECT_EQ(mxfp4_word_to_kernel_order(0xFFFFFFFFu), 0xFFFFFFFFu);
}

// The spec as docs/MXFP4.md writes it, with its own rotate: the kernel decode is these rotations and masks.
TEST(Mxfp4KernelOrder, the_decode_is_the_documented_rotations_and_masks) {
  constexpr uint32_t kT = 0x81C081C0u, kA = 0x80C080C0u, kB = 0x01000100u;
  for (uint32_t w : random_words(20000, 32)) {
    ASSERT_EQ(detail::mxfp4_pair_bits_bf16<0>(w), w & kT);
    ASSERT_EQ(detail::mxfp4_pair_bits_bf16<1>(w), rotl(w, 6) & kT);
    ASSERT_EQ(detail::mxfp4_pair_bits_bf16<2>(w), rotl(w, 12) & kT);
    ASSERT_EQ(detail::mxfp4_pair_bits_bf16<3>(w), (rotl(w, 2) & kA) | (rotl(w, 10) & kB));
  }
}

// Every code at every position of a word (the other 7 codes random), decoded from the kernel order as the GPU
// kernels decode it: exactly e2m1_value(code) * 2^-126 as bf16 and * 2^-14 as f16 (sign of zero included), in
// pair position / 2, the low half for an even position and the high half for an odd one (adjacent columns share a
// register, as they do in a row of activations); and the pair read straight from the canonical word (the
// conversion's source) gives the same bits.
TEST(Mxfp4KernelOrder, every_code_at_every_position_decodes_exactly_in_bf16_and_f16) {
  const std::vector<uint32_t> others = random_words(64, 33);
  for (uint32_t background : others) {
    for (int position = 0; position < 8; ++position) {
      for (int code = 0; code < 16; ++code) {
        const uint32_t canonical = with_code(background, position, code);
        const uint32_t kernel = mxfp4_word_to_kernel_order(canonical);
        const int pair = position / 2;
        const int shift = position % 2 == 0 ? 0 : 16;
        const double value = e2m1_value(static_cast<uint8_t>(code));
        for (bool f16 : {false, true}) {
          const uint16_t bits = static_cast<uint16_t>(pair_bits(kernel, pair, f16) >> shift);
          const double decoded = f16 ? f16_value(bits) : bf16_value(bits);
          const double expected = std::ldexp(value, f16 ? -14 : -126);
          ASSERT_EQ(decoded, expected) << "code " << code << " at " << position << (f16 ? " f16" : " bf16");
          ASSERT_EQ(std::signbit(decoded), std::signbit(expected)) << "code " << code << " at " << position;
        }
        uint32_t before = 0;  // the pair read from the canonical word
        switch (pair) {
          case 0:
            before = detail::mxfp4_canonical_pair_bits<0>(canonical);
            break;
          case 1:
            before = detail::mxfp4_canonical_pair_bits<1>(canonical);
            break;
          case 2:
            before = detail::mxfp4_canonical_pair_bits<2>(canonical);
            break;
          default:
            before = detail::mxfp4_canonical_pair_bits<3>(canonical);
        }
        ASSERT_EQ(pair_bits(kernel, pair, false), before) << "code " << code << " at " << position;
      }
    }
  }
}

TEST(Mxfp4KernelOrder, a_buffer_is_converted_word_by_word_little_endian) {
  std::vector<uint8_t> bytes(4 * 33 + 1);  // one byte more, so that the words start unaligned
  SplitMix64 rng(34);
  for (uint8_t& byte : bytes) byte = static_cast<uint8_t>(rng.next());
  const std::vector<uint8_t> original = bytes;
  uint8_t* codes = bytes.data() + 1;
  mxfp4_codes_to_kernel_order(codes, 4 * 33);
  EXPECT_EQ(bytes[0], original[0]);
  for (int w = 0; w < 33; ++w) {
    const uint8_t* b = original.data() + 1 + 4 * w;
    const uint32_t word = b[0] | uint32_t{b[1]} << 8 | uint32_t{b[2]} << 16 | uint32_t{b[3]} << 24;
    const uint32_t converted = mxfp4_word_to_kernel_order(word);
    for (int j = 0; j < 4; ++j) EXPECT_EQ(codes[4 * w + j], static_cast<uint8_t>(converted >> (8 * j))) << w;
  }
  mxfp4_codes_from_kernel_order(codes, 4 * 33);
  EXPECT_EQ(bytes, original);
}

TEST(Mxfp4KernelOrder, a_buffer_that_is_not_whole_words_is_refused) {
  std::vector<uint8_t> bytes(18, 0x5A);
  for (size_t length : {1, 2, 3, 17, 18}) {
    expect_error([&] { mxfp4_codes_to_kernel_order(bytes.data(), length); },
                 {"mxfp4_codes_to_kernel_order", std::to_string(length) + " bytes", "32-bit words"});
    expect_error([&] { mxfp4_codes_from_kernel_order(bytes.data(), length); }, {"mxfp4_codes_from_kernel_order"});
  }
  EXPECT_EQ(bytes, std::vector<uint8_t>(18, 0x5A));  // nothing converted before the refusal
  mxfp4_codes_to_kernel_order(bytes.data(), 0);      // no words: nothing to do
  mxfp4_codes_to_kernel_order(bytes.data(), 16);
}

LayerConfig kimi_mxfp4_config() {
  LayerConfig config = resized(kimi_k3_config(), {40, 64, 6, 3, 256, 40});
  config.experts_format = ExpertWeightFormat::mxfp4;
  config.validate();
  return config;
}

TEST(Mxfp4KernelOrder, host_codes_declared_in_the_kernel_order_are_refused) {
  const LayerConfig config = kimi_mxfp4_config();
  const LayerWeights weights = make_random_layer_weights(config, DType::bf16, 35);
  LayerWeightViews views = views_of(weights);
  EXPECT_EQ(views.expert_code_order, Mxfp4CodeOrder::canonical);  // the default: what host codes are
  views.expert_code_order = Mxfp4CodeOrder::kernel;
  expect_error([&] { validate_layer_weights(views, config, 1); },
               {"expert_gate is on the host but expert_code_order is kernel", "canonical order"});
  auto group = make_in_process_group(1);
  expect_error([&] { Runner(config, {1, 0}, views, *group[0]); }, {"on the host but expert_code_order is kernel"});
  views.expert_code_order = Mxfp4CodeOrder::canonical;
  Runner runner(config, {1, 0}, views, *group[0]);  // canonical host codes: the CPU reference's own
}

TEST(Mxfp4KernelOrder, dense_experts_have_no_code_order) {
  const LayerConfig config = resized(kimi_k3_config(), {40, 64, 6, 3, 256, 40});
  const LayerWeights weights = make_random_layer_weights(config, DType::f32, 36);
  LayerWeightViews views = views_of(weights);
  views.expert_code_order = Mxfp4CodeOrder::kernel;
  expect_error([&] { validate_layer_weights(views, config, 1); },
               {"expert_code_order is kernel but the experts are dense"});
}

TEST(Mxfp4KernelOrder, the_cpu_backend_has_nothing_to_convert_on_a_device) {
  std::vector<uint8_t> codes(16);
  // Host tensors are refused by the device conversion (and, without CUDA, so is everything).
  expect_error([&] { mxfp4_to_kernel_order(TensorView(codes.data(), DType::u8, {16})); }, {"mxfp4_to_kernel_order"});
}

}  // namespace
}  // namespace latentmoe

// The CPU backend's operations: hand-computed cases, naive loops written from the definitions,
// the rounding of 16-bit outputs, and dtype errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "core/backend.h"
#include "cpu/activation.h"
#include "cpu/matmul.h"
#include "cpu/numeric.h"
#include "latentmoe/error.h"
#include "latentmoe/tensor.h"

namespace latentmoe {
namespace {

using detail::ActivationParams;
using detail::MlpWeights;

// A host tensor of `dtype` holding `values` (each rounded to the dtype).
HostTensor make(DType dtype, std::vector<int64_t> shape, const std::vector<float>& values) {
  HostTensor tensor(dtype, std::move(shape));
  EXPECT_EQ(tensor.numel(), static_cast<int64_t>(values.size()));
  for (size_t i = 0; i < values.size(); ++i) store_from_float(tensor.data(), dtype, static_cast<int64_t>(i), values[i]);
  return tensor;
}

std::vector<float> values_of(const TensorView& view) {
  HostTensor copy = to_host_tensor(view, DType::f32);
  return {copy.data_as<float>(), copy.data_as<float>() + copy.numel()};
}

// Values as stored in `dtype` (what a kernel reads back).
std::vector<float> rounded(DType dtype, std::vector<float> values) {
  for (float& v : values) v = round_through(dtype, v);
  return values;
}

std::vector<float> random_values(size_t count, float scale, std::mt19937& rng) {
  std::uniform_real_distribution<float> uniform(-scale, scale);
  std::vector<float> values(count);
  for (float& v : values) v = uniform(rng);
  return values;
}

// One unit in the last place of the output dtype, relative to the value (the upper bound within a
// binade): the naive loops below round exactly once as the backend does, so they may differ from it
// by at most one such rounding step (their sums are ordered differently).
double relative_ulp(DType dtype) {
  switch (dtype) {
    case DType::bf16:
      return std::ldexp(1.0, -7);
    case DType::f16:
      return std::ldexp(1.0, -10);
    default:
      return std::ldexp(1.0, -22);
  }
}

void expect_close(const std::vector<float>& actual, const std::vector<float>& expected, DType dtype) {
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    const double tolerance = relative_ulp(dtype) * (std::fabs(expected[i]) + 1e-3);
    ASSERT_NEAR(actual[i], expected[i], tolerance)
        << "first mismatch at index " << i << " (" << dtype_name(dtype) << ")";
  }
}

ActivationParams activation(Activation kind) {
  ActivationParams params;
  params.activation = kind;
  return params;
}

constexpr DType kComputeDTypes[] = {DType::f32, DType::bf16, DType::f16};

// --- Activations ------------------------------------------------------------------------------

TEST(CpuActivation, silu_hand_computed) {
  using detail::cpu::silu;
  EXPECT_DOUBLE_EQ(silu(0.0, 5.0), 0.0);
  EXPECT_NEAR(silu(1.0, 2.0), 1.4621171572600098, 1e-15);    // 1 · 1/(1+e^-1) · 2
  EXPECT_NEAR(silu(-1.0, 1.0), -0.2689414213699951, 1e-15);  // -1 · 1/(1+e) · 1
  EXPECT_NEAR(silu(0.5, -3.0), -0.933688996802782, 1e-15);   // 0.5 · 0.6224593 · -3
  EXPECT_NEAR(silu(-800.0, 1.0), 0.0, 1e-300);               // sigmoid underflows to 0, no NaN
}

TEST(CpuActivation, situ_hand_computed) {
  using detail::cpu::situ;
  EXPECT_DOUBLE_EQ(situ(0.0, 7.0, 4.0, 25.0), 0.0);
  // (4 · tanh(1) · sigmoid(4)) · (25 · tanh(1)) = 100 · 0.5800257 · 0.9820138 = 56.9593195
  EXPECT_NEAR(situ(4.0, 25.0, 4.0, 25.0), 56.95931951108434, 1e-12);
  // (4 · tanh(-0.5) · sigmoid(-2)) · (25 · tanh(0.4)) = -0.2203399 · 9.4987241 = -2.0929760
  EXPECT_NEAR(situ(-2.0, 10.0, 4.0, 25.0), -2.0929760424853576, 1e-12);
  // Saturation: tanh -> 1 and sigmoid -> 1, so the product tends to b1 · b2 = 100.
  EXPECT_NEAR(situ(1000.0, 1000.0, 4.0, 25.0), 100.0, 1e-12);
  // The params dispatch uses situ_beta and situ_linear_beta.
  ActivationParams params = activation(Activation::situ);
  params.situ_beta = 2.0f;
  params.situ_linear_beta = 3.0f;
  EXPECT_DOUBLE_EQ(detail::cpu::activate(params, 1.5, -0.5), situ(1.5, -0.5, 2.0, 3.0));
}

TEST(CpuActivation, relu2_hand_computed) {
  using detail::cpu::relu2;
  EXPECT_EQ(relu2(3.0), 9.0);
  EXPECT_EQ(relu2(0.5), 0.25);
  EXPECT_EQ(relu2(-2.0), 0.0);
  EXPECT_EQ(relu2(0.0), 0.0);
  EXPECT_TRUE(std::isnan(relu2(std::nan(""))));
  EXPECT_EQ(detail::cpu::activate(activation(Activation::relu2), 100.0, -1.0), 0.0);  // gate ignored
}

// --- linear and router_logits -------------------------------------------------------------------

TEST(CpuLinear, hand_computed_every_dtype) {
  // [[1, 2, 3], [4, 5, 6]] · [[1, 0, -1], [2, 1, 0]]^T = [[1 - 3, 2 + 2], [4 - 6, 8 + 5]] = [[-2, 4], [-2, 13]]
  auto backend = detail::make_cpu_backend();
  for (DType dtype : kComputeDTypes) {
    HostTensor x = make(dtype, {2, 3}, {1, 2, 3, 4, 5, 6});
    HostTensor w = make(dtype, {2, 3}, {1, 0, -1, 2, 1, 0});
    HostTensor y = make(dtype, {2, 2}, {10, 20, 30, 40});
    backend->linear(x.view(), w.view(), y.view(), false);
    EXPECT_EQ(values_of(y.view()), (std::vector<float>{-2, 4, -2, 13})) << dtype_name(dtype);
    // accumulate: adds onto the previous y: [[-2 - 2, 4 + 4], [-2 - 2, 13 + 13]].
    backend->linear(x.view(), w.view(), y.view(), true);
    EXPECT_EQ(values_of(y.view()), (std::vector<float>{-4, 8, -4, 26})) << dtype_name(dtype);
  }
}

TEST(CpuLinear, strided_column_block_output) {
  // y is columns 1..2 of a [2, 5] matrix of 100s; the other columns must stay 100. With accumulate,
  // the block adds onto the 100s: [[98, 104], [98, 113]].
  auto backend = detail::make_cpu_backend();
  HostTensor x = make(DType::bf16, {2, 3}, {1, 2, 3, 4, 5, 6});
  HostTensor w = make(DType::bf16, {2, 3}, {1, 0, -1, 2, 1, 0});
  HostTensor wide = make(DType::bf16, {2, 5}, std::vector<float>(10, 100.0f));
  TensorView block = wide.view().slice_cols(1, 3);
  backend->linear(x.view(), w.view(), block, true);
  EXPECT_EQ(values_of(wide.view()), (std::vector<float>{100, 98, 104, 100, 100, 100, 98, 113, 100, 100}));
  backend->linear(x.view(), w.view(), block, false);
  EXPECT_EQ(values_of(wide.view()), (std::vector<float>{100, -2, 4, 100, 100, 100, -2, 13, 100, 100}));
}

TEST(CpuLinear, output_is_the_exact_sum_rounded_through_the_dtype) {
  // Inputs are multiples of 1/64 in [-1, 1], so every dot product (16 terms, multiples of 2^-12) is
  // exact in float; the 16-bit outputs must equal that float rounded through the dtype.
  auto backend = detail::make_cpu_backend();
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> sixty_fourths(-64, 64);
  const int64_t rows = 5, cols = 7, depth = 16;
  std::vector<float> x(rows * depth), w(cols * depth);
  for (float& v : x) v = sixty_fourths(rng) / 64.0f;
  for (float& v : w) v = sixty_fourths(rng) / 64.0f;
  std::vector<float> exact(rows * cols);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      double sum = 0.0;
      for (int64_t i = 0; i < depth; ++i) sum += static_cast<double>(x[r * depth + i]) * w[c * depth + i];
      exact[r * cols + c] = static_cast<float>(sum);
      ASSERT_EQ(static_cast<double>(exact[r * cols + c]), sum);  // the premise: exact in float
    }
  }
  bool any_rounded = false;
  for (DType dtype : kComputeDTypes) {
    HostTensor xt = make(dtype, {rows, depth}, x), wt = make(dtype, {cols, depth}, w);
    HostTensor y(dtype, {rows, cols});
    backend->linear(xt.view(), wt.view(), y.view(), false);
    EXPECT_EQ(values_of(y.view()), rounded(dtype, exact)) << dtype_name(dtype);
    any_rounded |= rounded(dtype, exact) != exact;
  }
  EXPECT_TRUE(any_rounded);  // the case does exercise 16-bit rounding
}

TEST(CpuLinear, rounds_once_from_double) {
  // 1 + 2^-8 + 2^-30 lies just above the bf16 midpoint between 1 and 1 + 2^-7, so it rounds up. Rounding
  // through float first would land exactly on the midpoint (2^-30 is below float's half ulp) and then
  // round to even, 1.0: the backend must not round twice.
  const double value = 1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -30);
  EXPECT_EQ(round_through(DType::bf16, static_cast<float>(value)), 1.0f);  // the double rounding
  EXPECT_EQ(detail::cpu::round_to_dtype(DType::bf16, value), 1.0078125f);
  auto backend = detail::make_cpu_backend();
  HostTensor x = make(DType::f32, {1, 3}, {1.0f, std::ldexp(1.0f, -8), std::ldexp(1.0f, -30)});
  HostTensor w = make(DType::f32, {1, 3}, {1, 1, 1});
  HostTensor y(DType::bf16, {1, 1});
  backend->linear(x.view(), w.view(), y.view(), false);
  EXPECT_EQ(values_of(y.view())[0], 1.0078125f);
}

TEST(CpuLinear, blocks_tiles_and_batch_invariance) {
  // k = 5003 (not a multiple of 8) makes the GEMM convert w in blocks of 6 rows (3 blocks for 13 outputs)
  // and x in tiles of 4 rows (7 rows: a 4-row kernel pass and 3 single rows). Every result must match a
  // naive double dot product, and each row computed alone must give bit-identical values.
  auto backend = detail::make_cpu_backend();
  const int64_t rows = 7, outputs = 13, depth = 5003;
  std::mt19937 rng(21);
  std::vector<float> x = random_values(rows * depth, 1.0f, rng), w = random_values(outputs * depth, 1.0f, rng);
  HostTensor xt = make(DType::f32, {rows, depth}, x), wt = make(DType::f32, {outputs, depth}, w);
  HostTensor y(DType::f32, {rows, outputs});
  backend->linear(xt.view(), wt.view(), y.view(), false);
  std::vector<float> expected(rows * outputs);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < outputs; ++c) {
      double sum = 0.0;
      for (int64_t i = 0; i < depth; ++i) sum += static_cast<double>(x[r * depth + i]) * w[c * depth + i];
      expected[r * outputs + c] = static_cast<float>(sum);
    }
  }
  const std::vector<float> batched = values_of(y.view());
  expect_close(batched, expected, DType::f32);
  // The double accumulators themselves (before rounding) are batch invariant.
  const detail::cpu::Matrix w_matrix = detail::cpu::as_matrix(wt.view(), "w");
  std::vector<double> all(rows * outputs), one(outputs);
  detail::cpu::matmul_nt(x.data(), rows, w_matrix, all.data());
  for (int64_t r = 0; r < rows; ++r) {
    detail::cpu::matmul_nt(x.data() + r * depth, 1, w_matrix, one.data());
    for (int64_t c = 0; c < outputs; ++c) ASSERT_EQ(one[c], all[r * outputs + c]) << r << ", " << c;
  }
  for (int64_t r = 0; r < rows; ++r) {
    HostTensor single(DType::f32, {1, outputs});
    backend->linear(xt.view().slice_rows(r, r + 1), wt.view(), single.view(), false);
    const std::vector<float> alone = values_of(single.view());
    for (int64_t c = 0; c < outputs; ++c) ASSERT_EQ(alone[c], batched[r * outputs + c]) << r << ", " << c;
  }
}

TEST(CpuRouterLogits, hand_computed_fp32_output) {
  // x [[1, 2]] (bf16) · gate [[1, 1], [0.5, -1], [3, 0]]^T = [[3, -1.5, 3]] in f32.
  auto backend = detail::make_cpu_backend();
  HostTensor x = make(DType::bf16, {1, 2}, {1, 2});
  HostTensor gate = make(DType::bf16, {3, 2}, {1, 1, 0.5f, -1, 3, 0});
  HostTensor logits(DType::f32, {1, 3});
  backend->router_logits(x.view(), gate.view(), logits.view());
  EXPECT_EQ(values_of(logits.view()), (std::vector<float>{3, -1.5f, 3}));
  HostTensor bf16_logits(DType::bf16, {1, 3});
  EXPECT_THROW(backend->router_logits(x.view(), gate.view(), bf16_logits.view()), Error);
}

// --- rms_norm, add, add_scaled_rows ------------------------------------------------------------

TEST(CpuRmsNorm, hand_computed) {
  auto backend = detail::make_cpu_backend();
  for (DType dtype : kComputeDTypes) {
    HostTensor gamma = make(DType::f32, {4}, {0.5f, 1, 2, 4});
    // mean((2, -2, 2, -2)^2) = 4, eps 0: divide by 2 -> (1, -1, 1, -1) · gamma = (0.5, -1, 2, -4).
    HostTensor a = make(dtype, {1, 4}, {2, -2, 2, -2});
    HostTensor out(dtype, {1, 4});
    backend->rms_norm(a.view(), gamma.view(), 0.0f, out.view());
    EXPECT_EQ(values_of(out.view()), (std::vector<float>{0.5f, -1, 2, -4})) << dtype_name(dtype);
    // mean(1^2) = 1, eps 3: divide by sqrt(4) = 2 -> 0.5 · gamma; a zero row stays zero. In place.
    HostTensor b = make(dtype, {2, 4}, {1, 1, 1, 1, 0, 0, 0, 0});
    backend->rms_norm(b.view(), gamma.view(), 3.0f, b.view());
    EXPECT_EQ(values_of(b.view()), (std::vector<float>{0.25f, 0.5f, 1, 2, 0, 0, 0, 0})) << dtype_name(dtype);
  }
}

TEST(CpuRmsNorm, matches_naive_loop_rounded_through_dtype) {
  auto backend = detail::make_cpu_backend();
  std::mt19937 rng(11);
  const int64_t rows = 3, width = 64;
  const float eps = 1e-5f;
  std::vector<float> gamma_values = random_values(width, 2.0f, rng);
  HostTensor gamma = make(DType::f32, {width}, gamma_values);
  for (DType dtype : kComputeDTypes) {
    std::vector<float> input = rounded(dtype, random_values(rows * width, 3.0f, rng));
    std::vector<float> expected(rows * width);
    for (int64_t r = 0; r < rows; ++r) {
      double squares = 0.0;
      for (int64_t c = 0; c < width; ++c) squares += static_cast<double>(input[r * width + c]) * input[r * width + c];
      const double rms = std::sqrt(squares / width + eps);
      for (int64_t c = 0; c < width; ++c) {
        expected[r * width + c] =
            round_through(dtype, static_cast<float>(input[r * width + c] / rms * gamma_values[c]));
      }
    }
    HostTensor in = make(dtype, {rows, width}, input);
    HostTensor out(dtype, {rows, width});
    backend->rms_norm(in.view(), gamma.view(), eps, out.view());
    expect_close(values_of(out.view()), expected, dtype);
  }
}

TEST(CpuAdd, hand_computed_in_place_and_rounded_once) {
  auto backend = detail::make_cpu_backend();
  HostTensor a = make(DType::f32, {2, 2}, {1, 2, 3, 4});
  HostTensor b = make(DType::f32, {2, 2}, {0.5f, -2, 10, 0.25f});
  backend->add(a.view(), b.view(), a.view());  // out aliases a
  EXPECT_EQ(values_of(a.view()), (std::vector<float>{1.5f, 0, 13, 4.25f}));
  // bf16 (8 significant bits): 1 + 2^-8 is a tie between 1 and 1 + 2^-7 -> even (1);
  // 1.0078125 + 2^-8 = 1.01171875 is a tie between 1.0078125 and 1.015625 -> even (1.015625).
  HostTensor c = make(DType::bf16, {1, 2}, {1.0f, 1.0078125f});
  HostTensor d = make(DType::bf16, {1, 2}, {std::ldexp(1.0f, -8), std::ldexp(1.0f, -8)});
  HostTensor sum(DType::bf16, {1, 2});
  backend->add(c.view(), d.view(), sum.view());
  EXPECT_EQ(values_of(sum.view()), (std::vector<float>{1.0f, 1.015625f}));
}

TEST(CpuAddScaledRows, hand_computed) {
  // out [[1, 1], [2, 2]] += scale (0.5, 0) · x [[2, 4], [NaN, 1]] = [[2, 3], [2, 2]]: a zero scale leaves
  // the row untouched, even where x holds NaN.
  auto backend = detail::make_cpu_backend();
  for (DType dtype : kComputeDTypes) {
    HostTensor x = make(dtype, {2, 2}, {2, 4, std::nanf(""), 1});
    HostTensor scale = make(DType::f32, {2}, {0.5f, 0.0f});
    HostTensor out = make(dtype, {2, 2}, {1, 1, 2, 2});
    backend->add_scaled_rows(x.view(), scale.view(), out.view());
    EXPECT_EQ(values_of(out.view()), (std::vector<float>{2, 3, 2, 2})) << dtype_name(dtype);
  }
}

// --- routed_experts and dense_mlp ----------------------------------------------------------------

TEST(CpuRoutedExperts, relu2_hand_computed) {
  // E = 3, l = I = 2. Up Wu_e [I, l], down Wd_e [l, I]:
  //   Wu_0 = [[1, 0], [0, 1]]  Wd_0 = [[1, 0], [0, 1]]
  //   Wu_1 = [[1, 1], [1, -1]] Wd_1 = [[1, 0], [1, 1]]
  //   Wu_2 = [[-1, 0], [0, 2]] Wd_2 = [[2, 0], [0, 1]]
  // Token 0, z (1, 2), ids (1, 0), weights (0.5, 0.25):
  //   e1: v = (3, -1), a = (9, 0), y = (9, 9); e0: v = (1, 2), a = (1, 4), y = (1, 4)
  //   out = 0.5 (9, 9) + 0.25 (1, 4) = (4.75, 5.5)
  // Token 1, z (-1, 1), ids (3, 2), weights (0.75, 0.5): id 3 is a zero expert (skipped here);
  //   e2: v = (1, 2), a = (1, 4), y = (2, 4); out = (1, 2)
  // Token 2, ids (4, 3): zero experts only: out = (0, 0), overwriting what was there.
  auto backend = detail::make_cpu_backend();
  for (DType dtype : kComputeDTypes) {
    HostTensor z = make(dtype, {3, 2}, {1, 2, -1, 1, 5, 5});
    HostTensor ids = HostTensor(DType::i32, {3, 2});
    const int32_t id_values[] = {1, 0, 3, 2, 4, 3};
    std::copy(std::begin(id_values), std::end(id_values), ids.data_as<int32_t>());
    HostTensor weights = make(DType::f32, {3, 2}, {0.5f, 0.25f, 0.75f, 0.5f, 0.3f, 0.7f});
    HostTensor up = make(dtype, {3, 2, 2}, {1, 0, 0, 1, 1, 1, 1, -1, -1, 0, 0, 2});
    HostTensor down = make(dtype, {3, 2, 2}, {1, 0, 0, 1, 1, 0, 1, 1, 2, 0, 0, 1});
    HostTensor out = make(dtype, {3, 2}, std::vector<float>(6, 7.0f));
    backend->routed_experts(activation(Activation::relu2), z.view(), ids.view(), weights.view(),
                            MlpWeights{TensorView(), up.view(), down.view()}, out.view());
    EXPECT_EQ(values_of(out.view()), (std::vector<float>{4.75f, 5.5f, 1, 2, 0, 0})) << dtype_name(dtype);
  }
}

// out[t] = sum_j w[t, j] · Wd_e · round(act(Wg_e z[t], Wu_e z[t])) over ids < E, from the definition.
std::vector<float> naive_routed(const ActivationParams& params, DType dtype, const std::vector<float>& z,
                                const std::vector<int32_t>& ids, const std::vector<float>& weights,
                                const std::vector<float>& gate, const std::vector<float>& up,
                                const std::vector<float>& down, int64_t num_experts, int64_t inter, int64_t width) {
  const int64_t num_tokens = static_cast<int64_t>(z.size()) / width;
  const int64_t k = static_cast<int64_t>(ids.size()) / num_tokens;
  std::vector<float> out(z.size());
  for (int64_t t = 0; t < num_tokens; ++t) {
    std::vector<double> sum(width, 0.0);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = ids[t * k + j];
      if (e >= num_experts) continue;
      std::vector<double> a(inter);
      for (int64_t i = 0; i < inter; ++i) {
        double g = 0.0, u = 0.0;
        for (int64_t c = 0; c < width; ++c) {
          const double zc = z[t * width + c];
          if (!gate.empty()) g += zc * gate[(e * inter + i) * width + c];
          u += zc * up[(e * inter + i) * width + c];
        }
        a[i] = round_through(dtype, static_cast<float>(detail::cpu::activate(params, g, u)));
      }
      for (int64_t c = 0; c < width; ++c) {
        double y = 0.0;
        for (int64_t i = 0; i < inter; ++i) y += a[i] * down[(e * width + c) * inter + i];
        sum[c] += weights[t * k + j] * y;
      }
    }
    for (int64_t c = 0; c < width; ++c) out[t * width + c] = round_through(dtype, static_cast<float>(sum[c]));
  }
  return out;
}

TEST(CpuRoutedExperts, gated_matches_naive_loop) {
  // 5 tokens, E = 3 (+ zero experts 3 and 4), k = 2, l = 8, I = 6; token 4 chose zero experts only and
  // token 1 chose expert 2 twice (each choice counts).
  auto backend = detail::make_cpu_backend();
  const int64_t num_tokens = 5, num_experts = 3, k = 2, width = 8, inter = 6;
  const std::vector<int32_t> ids = {0, 2, 2, 2, 1, 3, 4, 0, 4, 3};
  std::mt19937 rng(3);
  for (Activation kind : {Activation::silu, Activation::situ}) {
    for (DType dtype : kComputeDTypes) {
      std::vector<float> z = rounded(dtype, random_values(num_tokens * width, 2.0f, rng));
      std::vector<float> gate = rounded(dtype, random_values(num_experts * inter * width, 0.5f, rng));
      std::vector<float> up = rounded(dtype, random_values(num_experts * inter * width, 0.5f, rng));
      std::vector<float> down = rounded(dtype, random_values(num_experts * width * inter, 0.5f, rng));
      std::vector<float> weights = random_values(num_tokens * k, 1.0f, rng);
      HostTensor zt = make(dtype, {num_tokens, width}, z);
      HostTensor idt(DType::i32, {num_tokens, k});
      std::copy(ids.begin(), ids.end(), idt.data_as<int32_t>());
      HostTensor wt = make(DType::f32, {num_tokens, k}, weights);
      HostTensor gt = make(dtype, {num_experts, inter, width}, gate);
      HostTensor ut = make(dtype, {num_experts, inter, width}, up);
      HostTensor dt = make(dtype, {num_experts, width, inter}, down);
      HostTensor out(dtype, {num_tokens, width});
      backend->routed_experts(activation(kind), zt.view(), idt.view(), wt.view(),
                              MlpWeights{gt.view(), ut.view(), dt.view()}, out.view());
      SCOPED_TRACE(to_string(kind));
      expect_close(values_of(out.view()),
                   naive_routed(activation(kind), dtype, z, ids, weights, gate, up, down, num_experts, inter, width),
                   dtype);
      const std::vector<float> result = values_of(out.view());
      for (int64_t c = 0; c < width; ++c) EXPECT_EQ(result[4 * width + c], 0.0f);
    }
  }
}

TEST(CpuDenseMlp, relu2_hand_computed) {
  // x [[1, -1], [2, 3]]; Wu [[1, 0], [0, 1], [1, 1]]; Wd [[1, 1, 0], [0, 1, 1]].
  // Token 0: v = (1, -1, 0), a = (1, 0, 0), out = (1, 0). Token 1: v = (2, 3, 5), a = (4, 9, 25),
  // out = (13, 34).
  auto backend = detail::make_cpu_backend();
  for (DType dtype : kComputeDTypes) {
    HostTensor x = make(dtype, {2, 2}, {1, -1, 2, 3});
    HostTensor up = make(dtype, {3, 2}, {1, 0, 0, 1, 1, 1});
    HostTensor down = make(dtype, {2, 3}, {1, 1, 0, 0, 1, 1});
    HostTensor out(dtype, {2, 2});
    backend->dense_mlp(activation(Activation::relu2), x.view(), MlpWeights{TensorView(), up.view(), down.view()},
                       out.view());
    EXPECT_EQ(values_of(out.view()), (std::vector<float>{1, 0, 13, 34})) << dtype_name(dtype);
  }
}

TEST(CpuDenseMlp, gated_hand_computed) {
  // silu: x (1, 0), Wg [[1, 0]], Wu [[2, 0]]: g = 1, u = 2, a = silu(1, 2) = 1.4621172;
  //   Wd [[1], [-2]]: out = (1.4621172, -2.9242343).
  // situ: Wg [[-2, 0]], Wu [[10, 0]]: a = situ(-2, 10) = -2.0929760; Wd [[1], [0.5]]: out = (-2.0929760, -1.0464880).
  auto backend = detail::make_cpu_backend();
  HostTensor x = make(DType::f32, {1, 2}, {1, 0});
  HostTensor out(DType::f32, {1, 2});
  HostTensor silu_gate = make(DType::f32, {1, 2}, {1, 0}), silu_up = make(DType::f32, {1, 2}, {2, 0});
  HostTensor silu_down = make(DType::f32, {2, 1}, {1, -2});
  backend->dense_mlp(activation(Activation::silu), x.view(), {silu_gate.view(), silu_up.view(), silu_down.view()},
                     out.view());
  EXPECT_NEAR(values_of(out.view())[0], 1.4621171572600098, 1e-6);
  EXPECT_NEAR(values_of(out.view())[1], -2.9242343145200196, 1e-6);
  HostTensor situ_gate = make(DType::f32, {1, 2}, {-2, 0}), situ_up = make(DType::f32, {1, 2}, {10, 0});
  HostTensor situ_down = make(DType::f32, {2, 1}, {1, 0.5f});
  backend->dense_mlp(activation(Activation::situ), x.view(), {situ_gate.view(), situ_up.view(), situ_down.view()},
                     out.view());
  EXPECT_NEAR(values_of(out.view())[0], -2.0929760424853576, 1e-6);
  EXPECT_NEAR(values_of(out.view())[1], -1.0464880212426788, 1e-6);
  // A gated activation without a gate weight is an error.
  EXPECT_THROW(backend->dense_mlp(activation(Activation::silu), x.view(),
                                  {TensorView(), silu_up.view(), silu_down.view()}, out.view()),
               Error);
}

TEST(CpuDenseMlp, activation_is_rounded_to_the_compute_dtype) {
  // relu2 with v = (1.0234375, 1) (both exact in bf16) and Wd [[1, -1]]: v0^2 = 1.04742431640625.
  // f32 keeps it: out = 0.04742431640625. bf16 stores a0 = 1.046875 (the nearest bf16), so
  // out = 1.046875 - 1 = 0.046875 exactly; without that rounding it would be bf16(0.0474243) = 0.0473633.
  auto backend = detail::make_cpu_backend();
  for (DType dtype : {DType::f32, DType::bf16}) {
    HostTensor x = make(dtype, {1, 1}, {1});
    HostTensor up = make(dtype, {2, 1}, {1.0234375f, 1});
    HostTensor down = make(dtype, {1, 2}, {1, -1});
    HostTensor out(dtype, {1, 1});
    backend->dense_mlp(activation(Activation::relu2), x.view(), {TensorView(), up.view(), down.view()}, out.view());
    EXPECT_EQ(values_of(out.view())[0], dtype == DType::f32 ? 0.04742431640625f : 0.046875f) << dtype_name(dtype);
  }
}

TEST(CpuDenseMlp, gated_matches_naive_loop) {
  // The dense MLP is one expert applied to every token with weight 1.
  auto backend = detail::make_cpu_backend();
  const int64_t num_tokens = 4, width = 6, inter = 10;
  std::mt19937 rng(5);
  for (DType dtype : kComputeDTypes) {
    std::vector<float> x = rounded(dtype, random_values(num_tokens * width, 2.0f, rng));
    std::vector<float> gate = rounded(dtype, random_values(inter * width, 0.5f, rng));
    std::vector<float> up = rounded(dtype, random_values(inter * width, 0.5f, rng));
    std::vector<float> down = rounded(dtype, random_values(width * inter, 0.5f, rng));
    HostTensor xt = make(dtype, {num_tokens, width}, x);
    HostTensor gt = make(dtype, {inter, width}, gate), ut = make(dtype, {inter, width}, up);
    HostTensor dt = make(dtype, {width, inter}, down);
    HostTensor out(dtype, {num_tokens, width});
    backend->dense_mlp(activation(Activation::silu), xt.view(), {gt.view(), ut.view(), dt.view()}, out.view());
    std::vector<int32_t> ids(num_tokens, 0);
    std::vector<float> ones(num_tokens, 1.0f);
    expect_close(values_of(out.view()),
                 naive_routed(activation(Activation::silu), dtype, x, ids, ones, gate, up, down, 1, inter, width),
                 dtype);
  }
}

// --- Backend basics and errors -------------------------------------------------------------------

TEST(CpuBackend, allocate_is_aligned_and_zeroed) {
  auto backend = detail::make_cpu_backend();
  EXPECT_EQ(backend->device(), Device::cpu);
  detail::DeviceBuffer buffer = backend->allocate(100);
  ASSERT_NE(buffer.get(), nullptr);
  EXPECT_EQ(buffer.bytes(), 100u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(buffer.get()) % 64, 0u);
  const auto* bytes = static_cast<const unsigned char*>(buffer.get());
  for (int i = 0; i < 100; ++i) ASSERT_EQ(bytes[i], 0) << i;
  detail::DeviceBuffer moved = std::move(buffer);
  EXPECT_EQ(buffer.get(), nullptr);
  EXPECT_NE(moved.get(), nullptr);
}

TEST(CpuBackend, copy_contiguous_and_strided) {
  auto backend = detail::make_cpu_backend();
  HostTensor matrix(DType::i32, {3, 4});
  for (int i = 0; i < 12; ++i) matrix.data_as<int32_t>()[i] = i;
  HostTensor block(DType::i32, {3, 2});
  backend->copy(matrix.view().slice_cols(1, 3), block.view());
  EXPECT_EQ(std::vector<int32_t>(block.data_as<int32_t>(), block.data_as<int32_t>() + 6),
            (std::vector<int32_t>{1, 2, 5, 6, 9, 10}));
  // Back into columns 2..3 of the matrix (a strided destination).
  backend->copy(block.view(), matrix.view().slice_cols(2, 4));
  EXPECT_EQ(std::vector<int32_t>(matrix.data_as<int32_t>(), matrix.data_as<int32_t>() + 12),
            (std::vector<int32_t>{0, 1, 1, 2, 4, 5, 5, 6, 8, 9, 9, 10}));
  HostTensor same(DType::i32, {3, 4});
  backend->copy(matrix.view(), same.view());
  EXPECT_EQ(same.data_as<int32_t>()[11], 10);
  HostTensor wrong_shape(DType::i32, {4, 3}), wrong_dtype(DType::f32, {3, 4});
  EXPECT_THROW(backend->copy(matrix.view(), wrong_shape.view()), Error);
  EXPECT_THROW(backend->copy(matrix.view(), wrong_dtype.view()), Error);
}

TEST(CpuBackend, unsupported_dtypes_throw) {
  auto backend = detail::make_cpu_backend();
  HostTensor f32(DType::f32, {2, 2}), i32(DType::i32, {2, 2}), f64(DType::f64, {2, 2}), f8(DType::f8_e4m3, {2, 2});
  HostTensor gamma(DType::f32, {2}), bf16_scale(DType::bf16, {2});
  EXPECT_THROW(backend->linear(i32.view(), f32.view(), f32.view(), false), Error);
  EXPECT_THROW(backend->linear(f32.view(), f8.view(), f32.view(), false), Error);
  EXPECT_THROW(backend->linear(f32.view(), f32.view(), f64.view(), false), Error);
  EXPECT_THROW(backend->rms_norm(f64.view(), gamma.view(), 1e-5f, f32.view()), Error);
  EXPECT_THROW(backend->add(f32.view(), i32.view(), f32.view()), Error);
  EXPECT_THROW(backend->add_scaled_rows(f32.view(), bf16_scale.view(), f32.view()), Error);
  EXPECT_THROW(
      backend->dense_mlp(activation(Activation::relu2), f32.view(), {TensorView(), f8.view(), f32.view()}, f32.view()),
      Error);
  HostTensor z(DType::f32, {2, 2}), ids64(DType::i64, {2, 1}), weights(DType::f32, {2, 1});
  HostTensor up(DType::f32, {1, 2, 2}), down(DType::f32, {1, 2, 2});
  EXPECT_THROW(backend->routed_experts(activation(Activation::relu2), z.view(), ids64.view(), weights.view(),
                                       {TensorView(), up.view(), down.view()}, z.view()),
               Error);
}

}  // namespace
}  // namespace latentmoe

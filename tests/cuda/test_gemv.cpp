// The decode GEMV (cuda/gemm/gemv.h) against the CPU reference (double sums, one rounding): bf16 and f16,
// 1..kGemvMaxRows rows, n = 1, 7, 100, 3592, k = 8, 264, 3584, 7168 and the limit kGemvMaxK, row strides
// longer than the rows (their padding NaN, so a read past k shows), accumulation on and off, outputs
// poisoned around the written block; every launch path (short and long rows, both long-row kernels: the
// ring and the warp rows, one warp to 16, clusters of 1 to 8 CTAs, more clusters than rows); the same bits
// on every run and, for the warp rows, on every grid; graph capture behind an RMSNorm
// (a programmatic-launch predecessor) replayed with new inputs; rejected inputs; and CudaBackend::linear
// taking it at one token (gemv_max_tokens), after the skinny kernels' precedence, and leaving it off.
// Every test skips itself without a GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu/activation.h"
#include "cuda/backend/cuda_backend.h"
#include "cuda/common/device.h"
#include "cuda/gemm/gemv.h"
#include "cuda/gemm/skinny_gemm.h"
#include "cuda_test_util.h"
#include "latentmoe/error.h"

namespace latentmoe::cuda::testing {
namespace {

using ::latentmoe::detail::make_cpu_backend;
namespace cpu = ::latentmoe::detail::cpu;

constexpr uint16_t kPoison = 0xffff;  // NaN in bf16 and f16

bool bytes_equal(const HostTensor& a, const HostTensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

// One output-dtype ulp relative to the value (docs/NUMERICS.md, "Tolerances in the tests").
double ulp_rel(DType dtype) { return dtype == DType::bf16 ? 0x1p-7 : 0x1p-10; }

// [rows, ld] of `dtype`: uniform values in [low, high) in columns < cols, NaN in the padding.
HostTensor padded_random(DType dtype, int64_t rows, int64_t cols, int64_t ld, uint32_t seed, float low, float high) {
  HostTensor tensor = random_tensor(dtype, {rows, ld}, seed, low, high);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = cols; c < ld; ++c) tensor.data_as<uint16_t>()[r * ld + c] = kPoison;
  }
  return tensor;
}

template <class F>
void expect_error(F&& call, const std::string& needle) {
  try {
    call();
    ADD_FAILURE() << "no Error; expected one naming \"" << needle << "\"";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find(needle), std::string::npos) << error.what();
  }
}

// A problem: W [n, k] (row stride ldw) on the device, x [rows, k] (ldx), y [rows, n] (ldy).
struct Problem {
  DType dtype = DType::bf16;
  int64_t rows = 1, n = 1, k = 8;
  int64_t ldx = 8, ldw = 8, ldy = 1;
  bool accumulate = false;
};

class Gemv : public ::testing::Test {
 protected:
  void SetUp() override {
    LATENTMOE_REQUIRE_GPU();
    gpu_ = std::make_unique<CudaBackend>(0);
    cpu_ = make_cpu_backend();
  }
  cudaStream_t stream() const { return static_cast<cudaStream_t>(gpu_->stream()); }

  // Runs `problem` with the weights `w` (host, [n, ldw]) already on the device at `dw`, against the CPU
  // reference; returns the output buffer [rows + 1, ldy] (one row more than written, to check it stays).
  HostTensor check(const Problem& problem, const HostTensor& w, const DeviceTensor& dw, uint32_t seed,
                   const GemvShape& shape = {}) {
    const auto [dtype, rows, n, k, ldx, ldw, ldy, accumulate] = problem;
    SCOPED_TRACE(name_of(dtype) + ", rows " + std::to_string(rows) + ", n " + std::to_string(n) + ", k " +
                 std::to_string(k) + ", ldx " + std::to_string(ldx) + ", ldw " + std::to_string(ldw) + ", ldy " +
                 std::to_string(ldy) + (accumulate ? ", accumulate" : "") + ", shape {" + std::to_string(shape.warps) +
                 ", " + std::to_string(shape.split) + ", " + std::to_string(shape.clusters) + ", kernel " +
                 std::to_string(static_cast<int>(shape.kernel)) + "}");
    const HostTensor x = padded_random(dtype, rows, k, ldx, seed, -1.0f, 1.0f);
    // y: the block [rows, n] random when accumulating (poisoned otherwise), everything else poisoned.
    HostTensor y0(dtype, {rows + 1, ldy});
    const HostTensor y_values = random_tensor(dtype, {rows, n}, seed + 1, -2.0f, 2.0f);
    for (int64_t i = 0; i < y0.numel(); ++i) y0.data_as<uint16_t>()[i] = kPoison;
    if (accumulate) {
      for (int64_t r = 0; r < rows; ++r) {
        std::memcpy(y0.data_as<uint16_t>() + r * ldy, y_values.data_as<uint16_t>() + r * n, n * 2);
      }
    }
    DeviceTensor dx = upload(*gpu_, x), dy = upload(*gpu_, y0);
    gemv(dtype, dx.view.data(), ldx, rows, dw.view.data(), ldw, n, k, dy.view.data(), ldy, accumulate, stream(), shape);
    HostTensor got = download(*gpu_, dy.view);

    HostTensor ref = accumulate ? to_host_tensor(y_values.view(), dtype) : HostTensor(dtype, {rows, n});
    cpu_->linear(x.view().slice_cols(0, k), w.view().slice_cols(0, k), ref.view(), accumulate);
    int64_t bad = 0;
    for (int64_t r = 0; r <= rows; ++r) {
      for (int64_t c = 0; c < ldy; ++c) {
        const int64_t index = r * ldy + c;
        if (r == rows || c >= n) {  // outside the written block
          if (got.data_as<uint16_t>()[index] != kPoison && ++bad <= 5) {
            ADD_FAILURE() << "element (" << r << ", " << c << ") outside the block was written";
          }
          continue;
        }
        double scale = accumulate ? std::abs(static_cast<double>(value_at(y_values, r * n + c))) : 0.0;
        for (int64_t e = 0; e < k; ++e) {
          scale += std::abs(static_cast<double>(value_at(x, r * ldx + e)) * value_at(w, c * ldw + e));
        }
        const double expected = value_at(ref, r * n + c), out = value_at(got, index);
        // One rounding step of the output plus fp32 sums in another order (docs/NUMERICS.md).
        const double bound =
            ulp_rel(dtype) * std::abs(expected) + 4.0 * 0x1p-24 * std::sqrt(double(k)) * scale + 0x1p-24;
        if (!(std::abs(out - expected) <= bound) && ++bad <= 5) {
          ADD_FAILURE() << "y(" << r << ", " << c << ") = " << out << ", reference " << expected << ", bound " << bound;
        }
      }
    }
    EXPECT_EQ(bad, 0);
    return got;
  }

  // Weights [n, ldw] (padding NaN) on the host and the device.
  std::pair<HostTensor, DeviceTensor> weights(DType dtype, int64_t n, int64_t k, int64_t ldw, uint32_t seed) {
    HostTensor w = padded_random(dtype, n, k, ldw, seed, -0.25f, 0.25f);
    DeviceTensor dw = upload(*gpu_, w);
    return {std::move(w), std::move(dw)};
  }

  std::unique_ptr<CudaBackend> gpu_;
  std::unique_ptr<Backend> cpu_;
};

TEST_F(Gemv, matches_the_reference_for_every_shape_dtype_and_row_count) {
  uint32_t seed = 1000;
  int index = 0;
  for (DType dtype : {DType::bf16, DType::f16}) {
    for (int64_t n : {1, 7, 100, 3584 + 8}) {
      for (int64_t k : {8, 264, 3584, 7168}) {
        const bool padded = (index++ % 2) == 1;  // every other problem with longer rows than k
        const int64_t ldw = k + (padded ? 8 : 0);
        auto [w, dw] = weights(dtype, n, k, ldw, seed += 7);
        const bool large = n * k > (int64_t{1} << 22);
        for (int64_t rows = 1; rows <= kGemvMaxRows; ++rows) {
          if (large && rows != 1 && rows != kGemvMaxRows) continue;  // keep the host reference quick
          for (bool accumulate : {false, true}) {
            if (large && accumulate != (rows == kGemvMaxRows)) continue;
            Problem problem{dtype, rows, n, k, k + (padded ? 24 : 0), ldw, n + (padded ? 5 : 0), accumulate};
            check(problem, w, dw, seed += 3);
          }
        }
      }
    }
  }
}

// k at the limit: x takes 128 KiB of shared memory at four rows; both long-row kernels.
TEST_F(Gemv, runs_at_the_longest_reduction) {
  for (DType dtype : {DType::bf16, DType::f16}) {
    auto [w, dw] = weights(dtype, 37, kGemvMaxK, kGemvMaxK, 5);
    for (GemvKernel kernel : {GemvKernel::ring, GemvKernel::warp_rows}) {
      for (int64_t rows : {1, kGemvMaxRows}) {
        check({dtype, rows, 37, kGemvMaxK, kGemvMaxK, kGemvMaxK, 40, true}, w, dw, 6, {0, 0, 0, kernel});
      }
    }
  }
}

// Every launch path: short rows (k < 256) and long rows on both long-row kernels; one warp to 16; for
// the ring kernel split rows within a CTA and, on sm_90, across clusters of 2, 4 and 8 CTAs; more
// clusters (CTAs) than rows (CTAs with nothing to do); ranges shorter than a warp step; one CTA walking
// every row (warp rows). Each against the reference; every shape twice gives the same bits.
TEST_F(Gemv, every_launch_shape_matches_the_reference) {
  const std::vector<GemvShape> one_cta_shapes = {{1, 1, 1}, {3, 1, 5},   {16, 1, 0}, {0, 1, 0},
                                                 {5, 1, 7}, {2, 1, 300}, {0, 0, 0}};
  std::vector<GemvShape> shapes;
  for (GemvKernel kernel : {GemvKernel::ring, GemvKernel::warp_rows, GemvKernel::automatic}) {
    for (GemvShape shape : one_cta_shapes) {
      shape.kernel = kernel;
      shapes.push_back(shape);
    }
  }
  if (current_compute_capability() >= 90) {
    for (GemvShape shape :
         std::vector<GemvShape>{{4, 2, 3}, {0, 2, 0}, {8, 4, 0}, {2, 8, 3}, {16, 8, 1}, {0, 8, 0}, {1, 8, 200}}) {
      shape.kernel = GemvKernel::ring;
      shapes.push_back(shape);
    }
  }
  const std::vector<std::pair<int64_t, int64_t>> problems = {{100, 264},  {7, 3584}, {1, 7168}, {33, 8},
                                                             {300, 1000}, {5, 256},  {64, 248}, {9, 136}};
  uint32_t seed = 2000;
  for (const auto& [n, k] : problems) {
    auto [w, dw] = weights(DType::bf16, n, k, k + 8, seed += 11);
    for (const GemvShape& shape : shapes) {
      for (int64_t rows : {1, 3}) {
        const Problem problem{DType::bf16, rows, n, k, k, k + 8, n + 1, rows == 3};
        const HostTensor first = check(problem, w, dw, seed + 1, shape);
        const HostTensor second = check(problem, w, dw, seed + 1, shape);
        EXPECT_TRUE(bytes_equal(first, second)) << "n " << n << ", k " << k << ": two runs differ";
      }
    }
  }
}

TEST_F(Gemv, gives_the_same_bits_on_every_run) {
  const int64_t rows = 2, n = 3584, k = 7168;
  auto [w, dw] = weights(DType::bf16, n, k, k, 31);
  const HostTensor x = random_tensor(DType::bf16, {rows, k}, 32);
  DeviceTensor dx = upload(*gpu_, x);
  std::vector<GemvShape> shapes = {{}, {7, 1, 0, GemvKernel::ring}, {7, 1, 0, GemvKernel::warp_rows}};
  if (current_compute_capability() >= 90) shapes.push_back({0, 2, 0, GemvKernel::ring});
  for (const GemvShape& shape : shapes) {
    HostTensor previous;
    for (int run = 0; run < 3; ++run) {
      DeviceTensor dy = poisoned(*gpu_, DType::bf16, {rows, n});
      gemv(DType::bf16, dx.view.data(), k, rows, dw.view.data(), k, n, k, dy.view.data(), n, false, stream(), shape);
      HostTensor out = download(*gpu_, dy.view);
      EXPECT_EQ(count_non_finite(out), 0);
      if (run > 0) EXPECT_TRUE(bytes_equal(out, previous)) << "run " << run;
      previous = std::move(out);
    }
  }
}

// The warp-rows kernel sums each row in an order fixed by k alone (a warp a row: team 1), so every grid
// gives the same bits: one CTA of one warp walking all rows, a few CTAs, more CTAs than rows, and the
// default; at one and four x rows, accumulating. (Teams: teams_match_the_reference_and_give_...)
TEST_F(Gemv, warp_rows_give_the_same_bits_on_every_grid) {
  const int64_t n = 1000, k = 7168 + 8;
  auto [w, dw] = weights(DType::bf16, n, k, k, 33);
  for (int64_t rows : {1, kGemvMaxRows}) {
    const HostTensor x = random_tensor(DType::bf16, {rows, k}, 34);
    const HostTensor y0 = random_tensor(DType::bf16, {rows, n}, 35);
    DeviceTensor dx = upload(*gpu_, x);
    HostTensor first;
    bool have_first = false;
    for (const GemvShape& shape : std::vector<GemvShape>{{0, 0, 0, GemvKernel::warp_rows, 1},
                                                         {1, 0, 1, GemvKernel::warp_rows, 1},
                                                         {3, 1, 7, GemvKernel::warp_rows, 1},
                                                         {16, 0, 500, GemvKernel::warp_rows, 1}}) {
      DeviceTensor dy = upload(*gpu_, y0);
      gemv(DType::bf16, dx.view.data(), k, rows, dw.view.data(), k, n, k, dy.view.data(), n, true, stream(), shape);
      HostTensor out = download(*gpu_, dy.view);
      EXPECT_EQ(count_non_finite(out), 0);
      if (!have_first) {
        first = std::move(out);
        have_first = true;
      } else {
        EXPECT_TRUE(bytes_equal(out, first)) << "rows " << rows << ": warps " << shape.warps << ", CTAs "
                                             << shape.clusters << " differ from the default grid";
      }
    }
  }
}

// Teams (a row shared by 2 to 16 warps of a CTA, what the launch rule picks where rows are few): against
// the reference, with members whose segment is empty (k = 264: 33 vectors, so from team 4 on some
// members hold none), accumulating; a team gives the same bits on every grid of its CTAs.
TEST_F(Gemv, teams_match_the_reference_and_give_the_same_bits_on_every_grid) {
  const std::vector<std::pair<int64_t, int64_t>> problems = {{100, 7168 + 8}, {37, 1032}, {300, 264}};
  uint32_t seed = 2500;
  for (const auto& [n, k] : problems) {
    auto [w, dw] = weights(DType::bf16, n, k, k, seed += 11);
    for (int team : {2, 4, 8, 16}) {
      for (int64_t rows : {1, 3}) {
        const Problem problem{DType::bf16, rows, n, k, k, k, n, rows == 3};
        HostTensor first;
        bool have_first = false;
        for (const GemvShape& shape : std::vector<GemvShape>{{0, 0, 0, GemvKernel::warp_rows, team},
                                                             {16, 0, 3, GemvKernel::warp_rows, team},
                                                             {team, 0, 1, GemvKernel::warp_rows, team}}) {
          HostTensor out = check(problem, w, dw, seed + 1, shape);
          if (!have_first) {
            first = std::move(out);
            have_first = true;
          } else {
            EXPECT_TRUE(bytes_equal(out, first))
                << "n " << n << ", k " << k << ", team " << team << ": warps " << shape.warps << ", CTAs "
                << shape.clusters << " differ from the default grid";
          }
        }
      }
    }
  }
}

// --- gemv_rms_norm --------------------------------------------------------------------------------------

// gemv_rms_norm against the norm in double, each normalised value rounded to the dtype as the kernel rounds
// it, then the sum in double: bf16 and f16, gamma of every compute dtype, 1..kGemvMaxRows rows, short and
// long rows (k = 8: a vector a row), accumulation, the default launch, a team of 4 and a one-warp CTA. The
// bound is gemv's plus, for each element whose unrounded normalised value lies so close to a rounding
// midpoint that fp32 (and another order of the sum of squares) may round it the other way, that step
// times its weight. Each shape gives the same bits as the default launch.
TEST_F(Gemv, rms_norm_matches_the_normalised_reference_on_every_launch) {
  uint32_t seed = 4000;
  const float eps = 1e-5f;
  for (DType dtype : {DType::bf16, DType::f16}) {
    for (DType gamma_dtype : {DType::f32, DType::bf16, DType::f16}) {
      for (const auto& [n, k] : std::vector<std::pair<int64_t, int64_t>>{{100, 3584}, {7, 264}, {33, 8}}) {
        for (int64_t rows = 1; rows <= kGemvMaxRows; ++rows) {
          const bool accumulate = rows % 2 == 0;
          const int64_t ldx = k + 8, ldw = k, ldy = n + 1;
          SCOPED_TRACE(name_of(dtype) + ", gamma " + name_of(gamma_dtype) + ", rows " + std::to_string(rows) + ", n " +
                       std::to_string(n) + ", k " + std::to_string(k));
          const HostTensor x = padded_random(dtype, rows, k, ldx, seed += 3, -3.0f, 3.0f);
          const HostTensor gamma = random_tensor(gamma_dtype, {k}, seed + 1, 0.5f, 1.5f);
          auto [w, dw] = weights(dtype, n, k, ldw, seed + 2);
          const HostTensor y0 = random_tensor(dtype, {rows, ldy}, seed + 3, -2.0f, 2.0f);
          DeviceTensor dx = upload(*gpu_, x), dgamma = upload(*gpu_, gamma);
          // The reference: expected[r][c] and its bound.
          std::vector<double> expected(rows * n), bound(rows * n);
          for (int64_t r = 0; r < rows; ++r) {
            double squares = 0.0;
            for (int64_t e = 0; e < k; ++e) squares += double(value_at(x, r * ldx + e)) * value_at(x, r * ldx + e);
            const double inverse_rms = 1.0 / std::sqrt(squares / double(k) + double(eps));
            std::vector<double> normed(k), flip(k);
            HostTensor one(dtype, {3});
            for (int64_t e = 0; e < k; ++e) {
              const double u = value_at(x, r * ldx + e) * inverse_rms * value_at(gamma, e);
              store_from_float(one.data(), dtype, 0, static_cast<float>(u));
              store_from_float(one.data(), dtype, 1, static_cast<float>(u * (1.0 - 0x1p-18)));
              store_from_float(one.data(), dtype, 2, static_cast<float>(u * (1.0 + 0x1p-18)));
              normed[e] = value_at(one, 0);
              flip[e] = std::abs(double(value_at(one, 2)) - value_at(one, 1));
            }
            for (int64_t c = 0; c < n; ++c) {
              double sum = accumulate ? double(value_at(y0, r * ldy + c)) : 0.0, scale = std::abs(sum), flips = 0.0;
              for (int64_t e = 0; e < k; ++e) {
                const double product = normed[e] * value_at(w, c * ldw + e);
                sum += product;
                scale += std::abs(product);
                flips += flip[e] * std::abs(double(value_at(w, c * ldw + e)));
              }
              expected[r * n + c] = sum;
              bound[r * n + c] =
                  ulp_rel(dtype) * std::abs(sum) + 4.0 * 0x1p-24 * std::sqrt(double(k)) * scale + flips + 0x1p-24;
            }
          }
          // Teams 2 and 4 (each on two grids, which must agree bit for bit) and a one-warp CTA.
          HostTensor previous;
          for (const GemvShape& shape : std::vector<GemvShape>{{0, 0, 0, GemvKernel::warp_rows, 2},
                                                               {16, 0, 3, GemvKernel::warp_rows, 2},
                                                               {0, 0, 0, GemvKernel::warp_rows, 4},
                                                               {8, 0, 200, GemvKernel::warp_rows, 4},
                                                               {1, 0, 1, GemvKernel::warp_rows, 1}}) {
            SCOPED_TRACE("team " + std::to_string(shape.team) + ", warps " + std::to_string(shape.warps) + ", CTAs " +
                         std::to_string(shape.clusters));
            DeviceTensor dy = upload(*gpu_, y0);
            if (!accumulate) poison(*gpu_, dy);
            gemv_rms_norm(dtype, dx.view.data(), ldx, rows, dgamma.view.data(), gamma_dtype, eps, dw.view.data(), ldw,
                          n, k, dy.view.data(), ldy, accumulate, stream(), shape);
            HostTensor got = download(*gpu_, dy.view);
            if (shape.warps != 0 && shape.team != 1) EXPECT_TRUE(bytes_equal(got, previous)) << "the grids differ";
            int64_t bad = 0;
            for (int64_t r = 0; r < rows; ++r) {
              for (int64_t c = 0; c < ldy; ++c) {
                const float out = value_at(got, r * ldy + c);
                if (c >= n) {
                  const bool kept = accumulate ? out == value_at(y0, r * ldy + c) : std::isnan(out);
                  if (!kept && ++bad <= 5) ADD_FAILURE() << "(" << r << ", " << c << ") past n was written";
                  continue;
                }
                if (!(std::abs(out - expected[r * n + c]) <= bound[r * n + c]) && ++bad <= 5) {
                  ADD_FAILURE() << "y(" << r << ", " << c << ") = " << out << ", reference " << expected[r * n + c]
                                << ", bound " << bound[r * n + c];
                }
              }
            }
            EXPECT_EQ(bad, 0);
            previous = std::move(got);
          }
        }
      }
    }
  }
}

TEST_F(Gemv, rms_norm_rejects_what_it_does_not_take_and_names_the_problem) {
  DeviceTensor buffer = device_empty(*gpu_, DType::bf16, {8, 1024});
  void* base = buffer.view.data();
  EXPECT_TRUE(gemv_rms_norm_supported(DType::bf16, 1, 16, 64, base, 64, base, DType::f32, base, 64));
  EXPECT_FALSE(gemv_rms_norm_supported(DType::bf16, 1, 16, 64, base, 64, nullptr, DType::f32, base, 64));
  EXPECT_FALSE(gemv_rms_norm_supported(DType::bf16, 1, 16, 64, base, 64, base, DType::i32, base, 64));
  EXPECT_FALSE(gemv_rms_norm_supported(DType::bf16, 1, 16, 60, base, 64, base, DType::f32, base, 64));
  auto call = [&](const void* gamma, DType gamma_dtype, int64_t k, const GemvShape& shape = {}) {
    return [=, this] {
      gemv_rms_norm(DType::bf16, base, 1024, 1, gamma, gamma_dtype, 1e-6f, base, 1024, 16, k, base, 64, false, stream(),
                    shape);
    };
  };
  expect_error(call(nullptr, DType::f32, 64), "gamma is null");
  expect_error(call(base, DType::i32, 64), "gamma dtype I32");
  expect_error(call(base, DType::f32, 60), "not a positive multiple of 8");
  expect_error(call(base, DType::f32, 256, {0, 0, 0, GemvKernel::ring}), "warp-rows kernel only");
  ASSERT_EQ(cudaStreamSynchronize(stream()), cudaSuccess);  // nothing was launched, nothing failed
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
}

// --- gemv_gate_up ------------------------------------------------------------------------------------

class GemvGateUp : public Gemv {
 protected:
  // gemv_gate_up on x [rows, k] (ldx = k + 8, padding NaN) and gate/up [n, ldw] against the activation of
  // the double sums (cpu/activation.h); the output [rows + 1, n + 3] as downloaded (the block [rows, n]
  // written, the rest left poisoned: checked).
  HostTensor check_gate_up(DType dtype, Activation activation, int64_t rows, int64_t n, int64_t k, int64_t ldw,
                           uint32_t seed, const GemvShape& shape = {}) {
    SCOPED_TRACE(std::string(to_string(activation)) + ", " + name_of(dtype) + ", rows " + std::to_string(rows) +
                 ", n " + std::to_string(n) + ", k " + std::to_string(k) + ", team " + std::to_string(shape.team) +
                 ", warps " + std::to_string(shape.warps) + ", CTAs " + std::to_string(shape.clusters));
    ::latentmoe::detail::ActivationParams params;
    params.activation = activation;
    const bool gated = activation != Activation::relu2;
    const int64_t ldx = k + 8, ldy = n + 3;
    const HostTensor x = padded_random(dtype, rows, k, ldx, seed, -1.0f, 1.0f);
    const HostTensor gate = padded_random(dtype, n, k, ldw, seed + 1, -0.25f, 0.25f);
    const HostTensor up = padded_random(dtype, n, k, ldw, seed + 2, -0.25f, 0.25f);
    DeviceTensor dx = upload(*gpu_, x), dgate = upload(*gpu_, gate), dup = upload(*gpu_, up);
    DeviceTensor dy = poisoned(*gpu_, dtype, {rows + 1, ldy});
    gemv_gate_up(dtype, params, dx.view.data(), ldx, rows, gated ? dgate.view.data() : nullptr, dup.view.data(), ldw, n,
                 k, dy.view.data(), ldy, stream(), shape);
    HostTensor got = download(*gpu_, dy.view);
    // The fast activations (tanh.approx: about 2^-11 relative per factor; __expf) on top of fp32 sums.
    const double approx = activation == Activation::situ ? 0x1p-9 : activation == Activation::silu ? 0x1p-18 : 0.0;
    int64_t bad = 0;
    for (int64_t r = 0; r <= rows; ++r) {
      for (int64_t c = 0; c < ldy; ++c) {
        const float out = value_at(got, r * ldy + c);
        if (r == rows || c >= n) {
          if (!std::isnan(out) && ++bad <= 5) ADD_FAILURE() << "(" << r << ", " << c << ") outside the block written";
          continue;
        }
        double g = 0.0, u = 0.0, scale_g = 0.0, scale_u = 0.0;
        for (int64_t e = 0; e < k; ++e) {
          const double xe = value_at(x, r * ldx + e), ge = value_at(gate, c * ldw + e), ue = value_at(up, c * ldw + e);
          g += xe * ge;
          u += xe * ue;
          scale_g += std::abs(xe * ge);
          scale_u += std::abs(xe * ue);
        }
        const double expected = cpu::activate(params, g, u);
        // fp32 sums in another order move g and u by up to eg, eu; the activation moves with them
        // (bounded by its values at the corners of that box), then one rounding of the output.
        const double eg = 4.0 * 0x1p-24 * std::sqrt(double(k)) * scale_g + 0x1p-30;
        const double eu = 4.0 * 0x1p-24 * std::sqrt(double(k)) * scale_u + 0x1p-30;
        double moved = 0.0;
        for (double sg : {-1.0, 0.0, 1.0}) {
          for (double su : {-1.0, 0.0, 1.0}) {
            moved = std::max(moved, std::abs(cpu::activate(params, g + sg * eg, u + su * eu) - expected));
          }
        }
        // 2^-24: half the f16 subnormal step (2^-25) and more, for outputs below f16's normal range.
        const double bound =
            ulp_rel(dtype) * std::abs(expected) + moved + approx * (std::abs(expected) + 1e-3) + 0x1p-24;
        if (!(std::abs(out - expected) <= bound) && ++bad <= 5) {
          ADD_FAILURE() << "y(" << r << ", " << c << ") = " << out << ", reference " << expected << ", bound " << bound;
        }
      }
    }
    EXPECT_EQ(bad, 0);
    return got;
  }
};

// Every activation and dtype, 1..kGemvMaxRows rows, rows shorter than a warp step (k = 8, 136) and long
// (7168: Kimi-K3's shared expert at tp 8 is 768 rows of it, where the rule picks a team of 4), a
// gate/up boundary inside a batch (k = 520: 65 vectors), padded weight rows; the default launch and
// teams of 1 to 16. Each team gives the same bits on every grid.
TEST_F(GemvGateUp, matches_the_reference_for_every_activation_team_and_row_count) {
  uint32_t seed = 3000;
  for (Activation activation : {Activation::silu, Activation::situ, Activation::relu2}) {
    for (DType dtype : {DType::bf16, DType::f16}) {
      for (const auto& [n, k] : std::vector<std::pair<int64_t, int64_t>>{{7, 8}, {100, 520}, {33, 136}}) {
        for (int64_t rows = 1; rows <= kGemvMaxRows; ++rows) {
          check_gate_up(dtype, activation, rows, n, k, k + (rows % 2) * 8, seed += 5);
        }
      }
      check_gate_up(dtype, activation, 1, 768, 7168, 7168, seed += 5);
    }
    for (int team : {1, 2, 4, 8, 16}) {
      for (int64_t rows : {1, kGemvMaxRows}) {
        const HostTensor first =
            check_gate_up(DType::bf16, activation, rows, 60, 1032, 1032, 3100, {0, 0, 0, GemvKernel::warp_rows, team});
        const HostTensor second =
            check_gate_up(DType::bf16, activation, rows, 60, 1032, 1032, 3100, {16, 0, 2, GemvKernel::warp_rows, team});
        EXPECT_TRUE(bytes_equal(first, second)) << "team " << team << ", rows " << rows << ": grids differ";
      }
    }
  }
}

TEST_F(GemvGateUp, rejects_what_it_does_not_take_and_names_the_problem) {
  DeviceTensor buffer = device_empty(*gpu_, DType::bf16, {64, 1024});
  void* base = buffer.view.data();
  const void* unaligned = static_cast<const char*>(base) + 2;
  ::latentmoe::detail::ActivationParams silu, relu2;
  silu.activation = Activation::silu;
  relu2.activation = Activation::relu2;
  EXPECT_TRUE(gemv_gate_up_supported(DType::bf16, Activation::silu, 1, 16, 64, base, 64, base, base, 64));
  EXPECT_TRUE(gemv_gate_up_supported(DType::bf16, Activation::relu2, 2, 16, 64, base, 64, nullptr, base, 64));
  EXPECT_FALSE(gemv_gate_up_supported(DType::bf16, Activation::silu, 1, 16, 64, base, 64, nullptr, base, 64));
  EXPECT_FALSE(gemv_gate_up_supported(DType::bf16, Activation::relu2, 1, 16, 64, base, 64, base, base, 64));
  EXPECT_FALSE(gemv_gate_up_supported(DType::bf16, Activation::situ, 1, 16, 64, base, 64, unaligned, base, 64));
  EXPECT_FALSE(gemv_gate_up_supported(DType::bf16, Activation::situ, 1, 16, 60, base, 64, base, base, 64));
  EXPECT_FALSE(gemv_gate_up_supported(DType::f32, Activation::situ, 1, 16, 64, base, 64, base, base, 64));
  auto call = [&](const ::latentmoe::detail::ActivationParams& activation, const void* gate, const void* up, int64_t k,
                  int64_t ldy, const GemvShape& shape = {}) {
    return [=, this] {
      gemv_gate_up(DType::bf16, activation, base, 1024, 1, gate, up, 1024, 16, k, base, ldy, stream(), shape);
    };
  };
  expect_error(call(silu, nullptr, base, 64, 64), "the gate matrix is null (silu is gated)");
  expect_error(call(relu2, base, base, 64, 64), "a gate matrix was given for relu2");
  expect_error(call(silu, unaligned, base, 64, 64), "gate rows are not 16-byte aligned");
  expect_error(call(silu, base, unaligned, 64, 64), "W rows are not 16-byte aligned");
  expect_error(call(silu, base, base, 60, 64), "not a positive multiple of 8");
  expect_error(call(silu, base, base, 64, 8), "y row stride 8 is shorter than n");
  expect_error(call(silu, base, base, 256, 64, {0, 0, 0, GemvKernel::ring}), "warp-rows kernel only");
  expect_error(call(silu, base, base, 256, 64, {0, 2, 0}), "warp-rows kernel only");
  expect_error(call(silu, base, base, 256, 64, {0, 0, 0, GemvKernel::warp_rows, 3}), "a power of two");
  expect_error(call(silu, base, base, 256, 64, {4, 0, 0, GemvKernel::warp_rows, 8}), "does not divide");
  ASSERT_EQ(cudaStreamSynchronize(stream()), cudaSuccess);  // nothing was launched, nothing failed
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
}

// RMSNorm (launched as a programmatic dependent itself) -> GEMV -> GEMV accumulating into the same y,
// captured once and replayed with new inputs written into the same buffers: bit-identical to eager runs
// and right against the reference on the normalised x the GPU produced.
TEST_F(Gemv, replays_in_a_cuda_graph_with_new_inputs) {
  const DType dtype = DType::bf16;
  const int64_t n = 3584, k = 7168;
  auto [w, dw] = weights(dtype, n, k, k, 41);
  auto [w2, dw2] = weights(dtype, n, k, k, 42);
  DeviceTensor gamma = upload(*gpu_, random_tensor(DType::f32, {k}, 43, 0.5f, 1.5f));
  DeviceTensor raw = device_empty(*gpu_, dtype, {1, k});
  DeviceTensor normed = device_empty(*gpu_, dtype, {1, k});
  DeviceTensor y = device_empty(*gpu_, dtype, {1, n});
  auto step = [&] {
    gpu_->rms_norm(raw.view, gamma.view, 1e-6f, normed.view);
    gemv(dtype, normed.view.data(), k, 1, dw.view.data(), k, n, k, y.view.data(), n, false, stream());
    gemv(dtype, normed.view.data(), k, 1, dw2.view.data(), k, n, k, y.view.data(), n, true, stream());
  };
  step();  // eager first: kernels loaded, shared-memory limits set
  ASSERT_EQ(cudaStreamSynchronize(stream()), cudaSuccess);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream(), cudaStreamCaptureModeGlobal), cudaSuccess);
  step();
  ASSERT_EQ(cudaStreamEndCapture(stream(), &graph), cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  cudaGraphDestroy(graph);
  for (uint32_t seed : {50u, 60u, 70u}) {
    const HostTensor input = random_tensor(dtype, {1, k}, seed, -3.0f, 3.0f);
    gpu_->copy(input.view(), raw.view);
    poison(*gpu_, y);
    poison(*gpu_, normed);
    step();
    const HostTensor eager = download(*gpu_, y.view);
    gpu_->copy(input.view(), raw.view);
    poison(*gpu_, y);
    poison(*gpu_, normed);
    ASSERT_EQ(cudaGraphLaunch(exec, stream()), cudaSuccess);
    const HostTensor replayed = download(*gpu_, y.view);
    EXPECT_TRUE(bytes_equal(eager, replayed)) << "seed " << seed;
    EXPECT_EQ(count_non_finite(replayed), 0);
    // Reference: both products on the GPU's normalised x, summed in double, rounded once.
    const HostTensor x = download(*gpu_, normed.view);
    HostTensor ref(dtype, {1, n}), first(DType::f32, {1, n}), second(DType::f32, {1, n});
    cpu_->linear(x.view(), w.view(), first.view(), false);
    cpu_->linear(x.view(), w2.view(), second.view(), false);
    for (int64_t c = 0; c < n; ++c) {
      store_from_float(ref.data(), dtype, c, value_at(first, c) + value_at(second, c));
    }
    EXPECT_LT(relative_error(replayed, ref), 1e-2) << "seed " << seed;
  }
  cudaGraphExecDestroy(exec);
}

// The warp-rows launch rule (gemv_warp_rows_launch), host-only: it runs without a GPU (in CI).
// 132 SMs and 227 KiB of shared memory a CTA, the H100's and H200's.
TEST(Cuda_Gemv, warp_rows_launch_follows_the_rows_and_the_shared_memory) {
  constexpr size_t kOptin = 227 * 1024;
  auto launch = [](int64_t rows, int64_t n, int64_t k, const GemvShape& shape = {}, bool gate_up = false) {
    return gemv_warp_rows_launch(rows, n, k, gate_up, 132, kOptin, shape);
  };
  auto is = [](const GemvWarpRowsLaunch& got, int warps, int ctas, size_t shared, int team = 1, int segment = -1) {
    return got.warps == warps && got.ctas == ctas && got.shared_bytes == shared && got.team == team &&
           (segment < 0 || got.segment == segment);
  };
  // Kimi-K3's W_down: 3584 rows of 7168, 16 warps a CTA, 224 CTAs (two per SM fit 264); x 14 KiB; a warp a row.
  EXPECT_TRUE(is(launch(1, 3584, 7168), 16, 224, 14336, 1, 896));
  // W_up: 7168 rows, more than two CTAs of 16 warps per SM hold: 264 CTAs, most warps take two rows.
  EXPECT_TRUE(is(launch(1, 7168, 3584), 16, 264, 7168));
  // Nemotron 3 Super's W_down, 1024 rows of 512 vectors: 4096 warps fit the 4224 slots, so teams of 4,
  // each member one batch (128 vectors); 16 warps a CTA, 256 CTAs; the partial sums after x.
  EXPECT_TRUE(is(launch(1, 1024, 4096), 16, 256, 8192 + 2 * 16 * 4, 4, 128));
  // Kimi-K3's shared expert at tp 8: gate/up 768 rows of 2 x 896 vectors, teams of 4 (448 vectors each);
  // its down projection, 7168 rows of 96 vectors, a warp a row.
  EXPECT_TRUE(is(launch(1, 768, 7168, {}, true), 16, 192, 14336 + 2 * 16 * 2 * 4, 4, 448));
  EXPECT_TRUE(is(launch(1, 7168, 768), 16, 264, 1536, 1));
  // The same at one CTA per SM (ctas_per_sm 1, set_shared_gemv_ctas_per_sm(1)): half the slots, so teams of 2
  // and 12 warps a CTA for gate/up; 132 CTAs for the down projection.
  GemvShape beside;
  beside.ctas_per_sm = 1;
  EXPECT_TRUE(is(launch(1, 768, 7168, beside, true), 12, 128, 14336 + 2 * 12 * 2 * 4, 2, 896));
  EXPECT_TRUE(is(launch(1, 7168, 768, beside), 16, 132, 1536, 1));
  // Few short rows: one warp a CTA, a CTA a row (a team would hold less than a batch each).
  EXPECT_TRUE(is(launch(1, 37, 256), 1, 37, 512));
  // From two x rows the kernel is compiled for one 512-thread CTA per SM: at most 132 CTAs.
  EXPECT_TRUE(is(launch(2, 7168, 3584), 16, 132, 14336));
  // Four rows at the longest reduction: x takes 128 KiB, so one CTA per SM whatever the rows.
  EXPECT_TRUE(is(launch(kGemvMaxRows, 100000, kGemvMaxK), 16, 132, 131072));
  // Forced shapes are taken as given; a forced team sets the CTA's warps to a multiple of it.
  EXPECT_TRUE(is(launch(1, 3584, 7168, {3, 0, 5, GemvKernel::warp_rows}), 3, 5, 14336));
  EXPECT_TRUE(is(launch(1, 3584, 7168, {1, 0, 0, GemvKernel::warp_rows}), 1, 264, 14336));
  EXPECT_TRUE(is(launch(1, 100, 7168, {0, 0, 0, GemvKernel::warp_rows, 8}), 8, 100, 14336 + 2 * 8 * 4, 8, 128));
  // x larger than a CTA's shared memory, no problem at all, or a team that is not a power of two or does
  // not divide the CTA's warps: refused with the reason.
  expect_error([&] { gemv_warp_rows_launch(4, 10, kGemvMaxK, false, 132, 64 * 1024, {}); }, "bytes of shared memory");
  expect_error([&] { launch(0, 10, 64); }, "no warp-rows launch");
  expect_error([&] { launch(1, 10, 1024, {0, 0, 0, GemvKernel::warp_rows, 6}); }, "a power of two");
  expect_error([&] { launch(1, 10, 1024, {4, 0, 0, GemvKernel::warp_rows, 8}); }, "does not divide");
  expect_error([&] { launch(1, 10, 1024, {0, 0, 0, GemvKernel::warp_rows, 0, -1}); }, "CTAs per SM");
  // A forced warp count caps the rule's team by the largest power of two dividing it.
  EXPECT_EQ(launch(1, 768, 7168, {6, 0, 0, GemvKernel::warp_rows}, true).team, 2);
  EXPECT_EQ(launch(1, 768, 7168, {3, 0, 0, GemvKernel::warp_rows}, true).team, 1);
}

TEST_F(Gemv, rejects_what_it_does_not_take_and_names_the_problem) {
  DeviceTensor buffer = device_empty(*gpu_, DType::bf16, {8, kGemvMaxK + 64});
  DeviceTensor out = device_empty(*gpu_, DType::bf16, {8, 64});
  void* base = buffer.view.data();
  const void* unaligned = static_cast<const char*>(base) + 2;
  void* y = out.view.data();

  EXPECT_TRUE(gemv_supported(DType::bf16, 2, 16, 64, base, 72, base, 64));
  EXPECT_TRUE(gemv_supported(DType::f16, kGemvMaxRows, 1, kGemvMaxK, base, kGemvMaxK, base, kGemvMaxK));
  EXPECT_FALSE(gemv_supported(DType::bf16, 2, 16, 60, base, 64, base, 64));  // k % 8
  EXPECT_FALSE(gemv_supported(DType::bf16, 2, 16, 0, base, 64, base, 64));   // k = 0
  EXPECT_FALSE(gemv_supported(DType::bf16, 2, 16, kGemvMaxK + 8, base, kGemvMaxK + 8, base, kGemvMaxK + 8));
  EXPECT_FALSE(gemv_supported(DType::bf16, 2, 16, 64, unaligned, 64, base, 64));            // x pointer
  EXPECT_FALSE(gemv_supported(DType::bf16, 2, 16, 64, base, 68, base, 64));                 // x row stride
  EXPECT_FALSE(gemv_supported(DType::bf16, 2, 16, 64, base, 64, unaligned, 64));            // W pointer
  EXPECT_FALSE(gemv_supported(DType::bf16, 2, 16, 64, base, 64, base, 66));                 // W row stride
  EXPECT_FALSE(gemv_supported(DType::bf16, 0, 16, 64, base, 64, base, 64));                 // rows
  EXPECT_FALSE(gemv_supported(DType::bf16, kGemvMaxRows + 1, 16, 64, base, 64, base, 64));  // rows
  EXPECT_FALSE(gemv_supported(DType::bf16, 2, 0, 64, base, 64, base, 64));                  // n
  EXPECT_FALSE(gemv_supported(DType::f32, 2, 16, 64, base, 64, base, 64));                  // dtype
  // One row: its stride does not matter.
  EXPECT_TRUE(gemv_supported(DType::bf16, 1, 16, 64, base, 68, base, 64));

  auto call = [&](DType dtype, int64_t rows, int64_t n, int64_t k, const void* x, int64_t ldx, const void* w,
                  int64_t ldw, int64_t ldy, const GemvShape& shape = {}) {
    return [=, this] { gemv(dtype, x, ldx, rows, w, ldw, n, k, y, ldy, false, stream(), shape); };
  };
  expect_error(call(DType::bf16, 2, 16, 60, base, 64, base, 64, 64), "not a positive multiple of 8");
  expect_error(call(DType::bf16, 2, 16, kGemvMaxK + 8, base, kGemvMaxK + 8, base, kGemvMaxK + 8, 64), "kGemvMaxK");
  expect_error(call(DType::bf16, 2, 16, 64, unaligned, 64, base, 64, 64), "x rows are not 16-byte aligned");
  expect_error(call(DType::bf16, 2, 16, 64, base, 68, base, 64, 64), "x rows are not 16-byte aligned");
  expect_error(call(DType::bf16, 2, 16, 64, base, 64, unaligned, 64, 64), "W rows are not 16-byte aligned");
  expect_error(call(DType::bf16, kGemvMaxRows + 1, 16, 64, base, 64, base, 64, 64), "rows");
  expect_error(call(DType::f32, 2, 16, 64, base, 64, base, 64, 64), "dtype F32");
  expect_error(call(DType::bf16, 2, 16, 64, base, 32, base, 64, 64), "x row stride 32 is shorter than k");
  expect_error(call(DType::bf16, 2, 16, 64, base, 64, base, 64, 8), "y row stride 8 is shorter than n");
  expect_error(call(DType::bf16, 2, 16, 64, base, 64, base, 64, 64, {17, 0, 0}), "warps");
  expect_error(call(DType::bf16, 2, 16, 64, base, 64, base, 64, 64, {0, 3, 0}), "split 3");
  expect_error(call(DType::bf16, 2, 16, 64, base, 64, base, 64, 64, {0, 0, -1}), "clusters");
  if (current_compute_capability() >= 90) {  // split 2 itself needs sm_90; the warp-rows kernel takes none
    expect_error(call(DType::bf16, 2, 16, 256, base, 256, base, 256, 64, {0, 2, 0, GemvKernel::warp_rows}),
                 "ring kernel only");
    expect_error(call(DType::bf16, 2, 16, 256, base, 256, base, 256, 64, {0, 2, 0}), "ring kernel only");
  }
  ASSERT_EQ(cudaStreamSynchronize(stream()), cudaSuccess);  // nothing was launched, nothing failed
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
}

// --- CudaBackend::linear ---------------------------------------------------------------------------

class GemvBackend : public Gemv {
 protected:
  // linear() through the backend against the CPU backend; the output as downloaded.
  HostTensor linear(DType dtype, int64_t rows, int64_t n, int64_t k, bool accumulate, int64_t ld_out, uint32_t seed) {
    const HostTensor x = random_tensor(dtype, {rows, k}, seed, -1.0f, 1.0f);
    const HostTensor w = random_tensor(dtype, {n, k}, seed + 1, -0.1f, 0.1f);
    const HostTensor y0 = random_tensor(dtype, {rows, ld_out}, seed + 2, -1.0f, 1.0f);
    HostTensor ref = to_host_tensor(y0.view(), dtype);
    cpu_->linear(x.view(), w.view(), ref.view().slice_cols(0, n), accumulate);
    DeviceTensor dx = upload(*gpu_, x), dw = upload(*gpu_, w), dy = upload(*gpu_, y0);
    if (!accumulate) poison(*gpu_, dy);
    gpu_->linear(dx.view, dw.view, dy.view.slice_cols(0, n), accumulate);
    HostTensor got = download(*gpu_, dy.view);
    HostTensor block(dtype, {rows, n}), ref_block(dtype, {rows, n});
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < ld_out; ++c) {
        const float value = value_at(got, r * ld_out + c);
        if (c < n) {
          store_from_float(block.data(), dtype, r * n + c, value);
          store_from_float(ref_block.data(), dtype, r * n + c, value_at(ref, r * ld_out + c));
        } else {
          EXPECT_TRUE(accumulate ? value == value_at(y0, r * ld_out + c) : std::isnan(value))
              << "column " << c << " past n was written";
        }
      }
    }
    EXPECT_EQ(count_non_finite(block), 0);
    EXPECT_LT(relative_error(block, ref_block), tolerance(dtype));
    // The same call made directly on the GEMV, for the caller to compare bits with.
    DeviceTensor direct = upload(*gpu_, y0);
    if (!accumulate) poison(*gpu_, direct);
    gemv_bits_ = HostTensor();
    if (gemv_supported(dtype, rows, n, k, dx.view.data(), k, dw.view.data(), k)) {
      gemv(dtype, dx.view.data(), k, rows, dw.view.data(), k, n, k, direct.view.data(), ld_out, accumulate, stream());
      gemv_bits_ = download(*gpu_, direct.view);
    }
    return got;
  }
  HostTensor gemv_bits_;  // the direct GEMV's output of the last linear(), if it takes the problem
};

TEST_F(GemvBackend, linear_takes_the_gemv_at_one_token_and_matches_the_cpu_backend) {
  ASSERT_EQ(gpu_->gemv_max_tokens(), 1);  // one token by default (docs/CUDA_BACKEND.md, "Decode GEMV")
  for (DType dtype : {DType::bf16, DType::f16}) {
    SCOPED_TRACE(name_of(dtype));
    // Kimi-K3's W_down and W_up at one token, and an accumulation into a strided column block.
    EXPECT_TRUE(bytes_equal(linear(dtype, 1, 3584, 7168, false, 3584, 1), gemv_bits_));
    EXPECT_TRUE(bytes_equal(linear(dtype, 1, 7168, 3584, false, 7168, 2), gemv_bits_));
    EXPECT_TRUE(bytes_equal(linear(dtype, 1, 250, 520, true, 264, 3), gemv_bits_));
  }
  // f32 stays on cuBLASLt (true fp32; the GEMV does not take f32).
  const HostTensor x = random_tensor(DType::f32, {1, 512}, 4), w = random_tensor(DType::f32, {96, 512}, 5);
  HostTensor ref(DType::f32, {1, 96});
  cpu_->linear(x.view(), w.view(), ref.view(), false);
  DeviceTensor dx = upload(*gpu_, x), dw = upload(*gpu_, w), dy = poisoned(*gpu_, DType::f32, {1, 96});
  gpu_->linear(dx.view, dw.view, dy.view, false);
  EXPECT_LT(relative_error(download(*gpu_, dy.view), ref), 2e-6);
}

TEST_F(GemvBackend, gemv_max_tokens_chooses_who_runs_a_linear) {
  // Off: cuBLASLt, still right; on up to 4 rows: the GEMV, bit for bit.
  gpu_->set_gemv_max_tokens(0);
  linear(DType::bf16, 1, 3584, 7168, false, 3584, 11);
  gpu_->set_gemv_max_tokens(kGemvMaxRows);
  for (int64_t rows = 1; rows <= kGemvMaxRows; ++rows) {
    EXPECT_TRUE(bytes_equal(linear(DType::bf16, rows, 520, 1000, rows % 2 == 0, 528, 12), gemv_bits_)) << rows;
  }
  // Beyond gemv_max_tokens and for problems it does not take (k % 8 != 0): cuBLASLt, still right.
  gpu_->set_gemv_max_tokens(1);
  linear(DType::bf16, 2, 520, 1000, false, 520, 13);
  linear(DType::bf16, 1, 64, 60, false, 64, 14);
  EXPECT_THROW(gpu_->set_gemv_max_tokens(kGemvMaxRows + 1), Error);
  EXPECT_THROW(gpu_->set_gemv_max_tokens(-1), Error);
  EXPECT_EQ(gpu_->gemv_max_tokens(), 1);  // a rejected value leaves the setting as it was
}

// dense_mlp (the shared expert) at one token runs the GEMV pair, gemv_gate_up then gemv, bit for bit,
// for every activation, with Kimi-K3's shape at tp 8 (a team of 4 for gate/up) and an odd one; it
// matches the CPU backend (check_dense_mlp). With gemv_max_tokens 0 it leaves the GEMV.
TEST_F(GemvBackend, dense_mlp_takes_the_gemv_pair_at_one_token) {
  for (Activation act : {Activation::silu, Activation::situ, Activation::relu2}) {
    for (const auto& [d, inter] : std::vector<std::pair<int64_t, int64_t>>{{7168, 768}, {1032, 200}}) {
      SCOPED_TRACE(std::string(to_string(act)) + ", d " + std::to_string(d) + ", Is " + std::to_string(inter));
      WorkspaceSpec spec;
      spec.max_tokens = 4;
      spec.dense_intermediate = inter;
      gpu_->prepare(spec);
      check_dense_mlp(*gpu_, *cpu_, act, DType::bf16, 1, d, inter, 40);
      ::latentmoe::detail::ActivationParams activation;
      activation.activation = act;
      const bool gated = act != Activation::relu2;
      DeviceTensor x = upload(*gpu_, random_tensor(DType::bf16, {1, d}, 41, -2.0f, 2.0f));
      DeviceTensor gate = upload(*gpu_, random_tensor(DType::bf16, {inter, d}, 42, -0.15f, 0.15f));
      DeviceTensor up = upload(*gpu_, random_tensor(DType::bf16, {inter, d}, 43, -0.15f, 0.15f));
      DeviceTensor down = upload(*gpu_, random_tensor(DType::bf16, {d, inter}, 44, -0.15f, 0.15f));
      const ::latentmoe::detail::MlpWeights mlp{gated ? gate.view : TensorView(), up.view, down.view};
      DeviceTensor by_backend = poisoned(*gpu_, DType::bf16, {1, d});
      gpu_->dense_mlp(activation, x.view, mlp, by_backend.view);
      DeviceTensor act_rows = poisoned(*gpu_, DType::bf16, {1, inter}), direct = poisoned(*gpu_, DType::bf16, {1, d});
      GemvShape beside;  // what dense_mlp launches: one CTA per SM by default
      beside.ctas_per_sm = gpu_->shared_gemv_ctas_per_sm();
      gemv_gate_up(DType::bf16, activation, x.view.data(), d, 1, gated ? gate.view.data() : nullptr, up.view.data(), d,
                   inter, d, act_rows.view.data(), inter, stream(), beside);
      gemv(DType::bf16, act_rows.view.data(), inter, 1, down.view.data(), inter, d, inter, direct.view.data(), d, false,
           stream(), beside);
      const HostTensor pair = download(*gpu_, direct.view);
      EXPECT_TRUE(bytes_equal(download(*gpu_, by_backend.view), pair));
      gpu_->set_gemv_max_tokens(0);
      check_dense_mlp(*gpu_, *cpu_, act, DType::bf16, 1, d, inter, 45);
      gpu_->set_gemv_max_tokens(1);
    }
  }
  ASSERT_EQ(gpu_->shared_gemv_ctas_per_sm(), 0);
  EXPECT_THROW(gpu_->set_shared_gemv_ctas_per_sm(3), Error);
  EXPECT_THROW(gpu_->set_shared_gemv_ctas_per_sm(-1), Error);
  EXPECT_EQ(gpu_->shared_gemv_ctas_per_sm(), 0);  // a rejected value leaves the setting as it was
  // One CTA per SM: still the CPU backend's result.
  gpu_->set_shared_gemv_ctas_per_sm(1);
  check_dense_mlp(*gpu_, *cpu_, Activation::situ, DType::bf16, 1, 7168, 768, 46);
}

// Beside routed experts (run_overlapped, as the layer runs them), dense_mlp takes the GEMV pair only when
// the experts stream at most kSharedGemvBesideMaxBytes: beside 3 MB of experts its bits are the GEMV
// pair's, beside 132 MB (Kimi-K3's bf16 experts at tp 8, one token) they are those of the path it takes
// without the GEMV (gemv_max_tokens 0).
TEST_F(GemvBackend, dense_mlp_beside_large_routed_experts_leaves_the_gemv) {
  const int64_t d = 7168, inter = 768;
  ::latentmoe::detail::ActivationParams activation;
  activation.activation = Activation::silu;
  DeviceTensor x = upload(*gpu_, random_tensor(DType::bf16, {1, d}, 71, -2.0f, 2.0f));
  DeviceTensor gate = upload(*gpu_, random_tensor(DType::bf16, {inter, d}, 72, -0.15f, 0.15f));
  DeviceTensor up = upload(*gpu_, random_tensor(DType::bf16, {inter, d}, 73, -0.15f, 0.15f));
  DeviceTensor down = upload(*gpu_, random_tensor(DType::bf16, {d, inter}, 74, -0.15f, 0.15f));
  const ::latentmoe::detail::MlpWeights shared{gate.view, up.view, down.view};
  // Alone, and then without the GEMV: the two paths' bits.
  WorkspaceSpec spec;
  spec.max_tokens = 1;
  spec.dense_intermediate = inter;
  spec.num_experts = 16;
  spec.top_k = 16;
  spec.latent_size = 3584;
  spec.expert_intermediate = 384;
  gpu_->prepare(spec);
  auto shared_alone = [&] {
    DeviceTensor out = poisoned(*gpu_, DType::bf16, {1, d});
    gpu_->dense_mlp(activation, x.view, shared, out.view);
    return download(*gpu_, out.view);
  };
  const HostTensor with_gemv = shared_alone();
  gpu_->set_gemv_max_tokens(0);
  const HostTensor without_gemv = shared_alone();
  gpu_->set_gemv_max_tokens(1);
  for (const auto& [experts, inter_e, latent] :
       std::vector<std::tuple<int64_t, int64_t, int64_t>>{{4, 128, 1024}, {16, 384, 3584}}) {
    SCOPED_TRACE(std::to_string(experts) + " experts of [" + std::to_string(inter_e) + ", " + std::to_string(latent) +
                 "]");
    DeviceTensor eg = device_empty(*gpu_, DType::bf16, {experts, inter_e, latent});
    DeviceTensor eu = device_empty(*gpu_, DType::bf16, {experts, inter_e, latent});
    DeviceTensor ed = device_empty(*gpu_, DType::bf16, {experts, latent, inter_e});
    for (const DeviceTensor* t : {&eg, &eu, &ed}) {
      gpu_->copy(random_tensor(DType::bf16, t->view.shape(), 75, -0.1f, 0.1f).view(), t->view);
    }
    HostTensor ids(DType::i32, {1, experts}), weights(DType::f32, {1, experts});
    for (int64_t j = 0; j < experts; ++j) {
      ids.data_as<int32_t>()[j] = static_cast<int32_t>(j);
      weights.data_as<float>()[j] = 1.0f / static_cast<float>(experts);
    }
    DeviceTensor z = upload(*gpu_, random_tensor(DType::bf16, {1, latent}, 76)), dids = upload(*gpu_, ids),
                 dweights = upload(*gpu_, weights);
    DeviceTensor routed_out = device_empty(*gpu_, DType::bf16, {1, latent});
    DeviceTensor out = poisoned(*gpu_, DType::bf16, {1, d});
    gpu_->run_overlapped(
        [&] {
          gpu_->routed_experts(activation, z.view, dids.view, dweights.view,
                               ::latentmoe::detail::MlpWeights{eg.view, eu.view, ed.view}, routed_out.view);
        },
        [&] { gpu_->dense_mlp(activation, x.view, shared, out.view); });
    const HostTensor beside = download(*gpu_, out.view);
    const int64_t bytes = 3 * experts * inter_e * latent * 2;
    EXPECT_TRUE(bytes_equal(beside, bytes <= kSharedGemvBesideMaxBytes ? with_gemv : without_gemv))
        << bytes << " bytes of experts beside";
  }
}

// rms_norm_linear at one token: the norm inside the GEMV, bit for bit the direct gemv_rms_norm, `normed`
// left untouched, within rounding of the CPU backend's rms_norm then linear; with gemv_max_tokens 0 the
// composition (rms_norm into `normed`, then cuBLASLt), which writes `normed`.
TEST_F(GemvBackend, rms_norm_linear_folds_the_norm_into_the_gemv_at_one_token) {
  const int64_t k = 3584, n = 7168;
  const float eps = 1e-6f;
  const HostTensor x = random_tensor(DType::bf16, {1, k}, 61, -4.0f, 4.0f);
  const HostTensor gamma = random_tensor(DType::f32, {k}, 62, 0.5f, 1.5f);
  const HostTensor w = random_tensor(DType::bf16, {n, k}, 63, -0.1f, 0.1f);
  const HostTensor y0 = random_tensor(DType::bf16, {1, n}, 64, -1.0f, 1.0f);
  HostTensor ref = to_host_tensor(y0.view(), DType::bf16), ref_normed(DType::bf16, {1, k});
  cpu_->rms_norm_linear(x.view(), gamma.view(), eps, ref_normed.view(), w.view(), ref.view(), true);
  DeviceTensor dx = upload(*gpu_, x), dgamma = upload(*gpu_, gamma), dw = upload(*gpu_, w);
  for (int gemv_rows : {1, 0}) {
    SCOPED_TRACE("gemv_max_tokens " + std::to_string(gemv_rows));
    gpu_->set_gemv_max_tokens(gemv_rows);
    DeviceTensor dy = upload(*gpu_, y0), normed = poisoned(*gpu_, DType::bf16, {1, k});
    gpu_->rms_norm_linear(dx.view, dgamma.view, eps, normed.view, dw.view, dy.view, true);
    const HostTensor got = download(*gpu_, dy.view);
    EXPECT_EQ(count_non_finite(got), 0);
    EXPECT_LT(relative_error(got, ref), tolerance(DType::bf16));
    const HostTensor normed_out = download(*gpu_, normed.view);
    if (gemv_rows == 1) {
      EXPECT_EQ(count_non_finite(normed_out), k) << "the fused path wrote the scratch";
      DeviceTensor direct = upload(*gpu_, y0);
      gemv_rms_norm(DType::bf16, dx.view.data(), k, 1, dgamma.view.data(), DType::f32, eps, dw.view.data(), k, n, k,
                    direct.view.data(), n, true, stream());
      EXPECT_TRUE(bytes_equal(got, download(*gpu_, direct.view)));
    } else {
      EXPECT_LT(relative_error(normed_out, ref_normed), tolerance(DType::bf16));
    }
  }
}

// The skinny kernels keep their precedence: forced on (set_skinny_always), a one-row linear runs on
// skinny_down, not on the GEMV.
TEST_F(GemvBackend, the_skinny_kernels_come_first_when_forced) {
  gpu_->set_skinny_always(true);
  const int64_t n = 512, k = 1024;
  const HostTensor x = random_tensor(DType::bf16, {1, k}, 21), w = random_tensor(DType::bf16, {n, k}, 22);
  DeviceTensor dx = upload(*gpu_, x), dw = upload(*gpu_, w);
  DeviceTensor by_backend = poisoned(*gpu_, DType::bf16, {1, n}), skinny = poisoned(*gpu_, DType::bf16, {1, n});
  gpu_->linear(dx.view, dw.view, by_backend.view, false);
  skinny_down(DType::bf16, SkinnyRouting{}, {dx.view.data(), k}, 1, SkinnyWeights{nullptr, dw.view.data(), n, k, k, 0},
              skinny.view.data(), n, false, stream());
  EXPECT_TRUE(bytes_equal(download(*gpu_, by_backend.view), download(*gpu_, skinny.view)));
}

}  // namespace
}  // namespace latentmoe::cuda::testing

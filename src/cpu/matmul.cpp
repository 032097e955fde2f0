#include "cpu/matmul.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "latentmoe/mxfp4.h"

// The kernel is compiled twice on x86-64 (AVX2 and baseline), picked at load time. Both clones do
// the same IEEE operations in the same order, so their results are bit-identical. Not under
// ThreadSanitizer: the clone's resolver runs while the dynamic loader relocates, before the TSan
// runtime exists, and its instrumented entry crashes the process before main.
#if defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define LATENTMOE_CPU_UNDER_TSAN 1
#endif
#endif
#if defined(__SANITIZE_THREAD__)
#define LATENTMOE_CPU_UNDER_TSAN 1
#endif
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(LATENTMOE_CPU_UNDER_TSAN)
#define LATENTMOE_CPU_MULTIVERSION __attribute__((target_clones("avx2", "default")))
#else
#define LATENTMOE_CPU_MULTIVERSION
#endif

// Vec4 never crosses a non-inlined call, so the ABI note GCC gives for it does not apply.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace latentmoe::detail::cpu {
namespace {

using Vec4 = double __attribute__((vector_size(32)));

// Rows of w converted to double per block (256 KiB, stays in L2 while the rows of x stream past).
constexpr int64_t kBlockDoubles = 32 * 1024;
// Rows of x converted to double per tile (at most 128 KiB, at least 4 rows).
constexpr int64_t kTileDoubles = 16 * 1024;
constexpr int64_t kRowsPerKernel = 4;

[[gnu::always_inline]] inline Vec4 load4(const double* p) {
  Vec4 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// The fixed summation order of every dot product of length k: lane j of 8 sums the products
// i = j (mod 8) below k rounded down to a multiple of 8, in order; the lanes combine as
// ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)); the remaining products add in order.
[[gnu::always_inline]] inline double finish(Vec4 low, Vec4 high, const double* x, const double* w, int64_t begin,
                                            int64_t k) {
  const Vec4 lanes = low + high;
  double total = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  for (int64_t j = begin; j < k; ++j) total += x[j] * w[j];
  return total;
}

// One row of x against one row of w.
[[gnu::always_inline]] inline double dot1(const double* x, const double* w, int64_t k) {
  Vec4 low{0.0, 0.0, 0.0, 0.0}, high = low;
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    low += load4(x + i) * load4(w + i);
    high += load4(x + i + 4) * load4(w + i + 4);
  }
  return finish(low, high, x, w, i, k);
}

// Four consecutive rows of x (row length k) against one row of w, sharing the loads of w; each
// result is bit-identical to dot1 on that row.
[[gnu::always_inline]] inline void dot4(const double* x, const double* w, int64_t k, double* out, int64_t out_stride) {
  const double* x0 = x;
  const double* x1 = x + k;
  const double* x2 = x + 2 * k;
  const double* x3 = x + 3 * k;
  Vec4 low0{0.0, 0.0, 0.0, 0.0}, high0 = low0, low1 = low0, high1 = low0, low2 = low0, high2 = low0, low3 = low0,
                                 high3 = low0;
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    const Vec4 w_low = load4(w + i);
    const Vec4 w_high = load4(w + i + 4);
    low0 += load4(x0 + i) * w_low;
    high0 += load4(x0 + i + 4) * w_high;
    low1 += load4(x1 + i) * w_low;
    high1 += load4(x1 + i + 4) * w_high;
    low2 += load4(x2 + i) * w_low;
    high2 += load4(x2 + i + 4) * w_high;
    low3 += load4(x3 + i) * w_low;
    high3 += load4(x3 + i + 4) * w_high;
  }
  out[0] = finish(low0, high0, x0, w, i, k);
  out[out_stride] = finish(low1, high1, x1, w, i, k);
  out[2 * out_stride] = finish(low2, high2, x2, w, i, k);
  out[3 * out_stride] = finish(low3, high3, x3, w, i, k);
}

// y[r, c] (row stride y_stride) for a tile of x rows and a block of w rows, both contiguous doubles.
LATENTMOE_CPU_MULTIVERSION void multiply_tile(const double* x, int64_t rows, const double* w, int64_t cols, int64_t k,
                                              double* y, int64_t y_stride) {
  for (int64_t c = 0; c < cols; ++c) {
    const double* w_row = w + c * k;
    int64_t r = 0;
    for (; r + kRowsPerKernel <= rows; r += kRowsPerKernel) {
      dot4(x + r * k, w_row, k, y + r * y_stride + c, y_stride);
    }
    for (; r < rows; ++r) y[r * y_stride + c] = dot1(x + r * k, w_row, k);
  }
}

void to_double(const float* in, int64_t count, double* out) {
  for (int64_t i = 0; i < count; ++i) out[i] = in[i];
}

// y = x · w^T for w of n rows of length k, whose rows [c0, c1) `load_block(c0, c1, out)` writes as
// contiguous doubles.
template <class LoadBlock>
void matmul_blocks(const float* x, int64_t rows, int64_t n, int64_t k, LoadBlock load_block, double* y) {
  if (rows == 0 || n == 0) return;
  const int64_t block_rows = std::clamp<int64_t>(kBlockDoubles / std::max<int64_t>(k, 1), 1, n);
  const int64_t tile_rows = std::min(
      rows, std::max(kRowsPerKernel, kTileDoubles / std::max<int64_t>(k, 1) / kRowsPerKernel * kRowsPerKernel));
  std::vector<double> block(static_cast<size_t>(block_rows * k));
  std::vector<double> tile(static_cast<size_t>(tile_rows * k));
  for (int64_t c0 = 0; c0 < n; c0 += block_rows) {
    const int64_t c1 = std::min(n, c0 + block_rows);
    load_block(c0, c1, block.data());
    for (int64_t r0 = 0; r0 < rows; r0 += tile_rows) {
      const int64_t r1 = std::min(rows, r0 + tile_rows);
      to_double(x + r0 * k, (r1 - r0) * k, tile.data());
      multiply_tile(tile.data(), r1 - r0, block.data(), c1 - c0, k, y + r0 * n + c0, n);
    }
  }
}

}  // namespace

void matmul_nt(const float* x, int64_t rows, const Matrix& w, double* y) {
  const int64_t k = w.cols;
  std::vector<float> block_floats;
  auto load_block = [&](int64_t c0, int64_t c1, double* out) {
    block_floats.resize(static_cast<size_t>((c1 - c0) * k));
    load_rows(w, c0, c1, block_floats.data());
    to_double(block_floats.data(), (c1 - c0) * k, out);
  };
  matmul_blocks(x, rows, w.rows, k, load_block, y);
}

void matmul_nt(const float* x, int64_t rows, const Mxfp4Matrix& w, double* y) {
  const int64_t k = w.cols;
  auto load_block = [&](int64_t c0, int64_t c1, double* out) {
    for (int64_t c = c0; c < c1; ++c) {
      mxfp4_decode_row(w.packed + c * w.packed_stride, w.scales + c * w.scale_stride, 0, k, out + (c - c0) * k);
    }
  };
  matmul_blocks(x, rows, w.rows, k, load_block, y);
}

}  // namespace latentmoe::detail::cpu

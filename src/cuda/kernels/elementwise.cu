#include <algorithm>
#include <climits>
#include <cmath>

#include "cuda/common/activation.cuh"
#include "cuda/common/cuda_check.h"
#include "cuda/common/dtype_dispatch.cuh"
#include "cuda/common/pdl.cuh"
#include "cuda/common/reduce.cuh"
#include "cuda/kernels/elementwise.h"

namespace latentmoe::cuda {
namespace {

constexpr int kThreads = 256;

// --- add ----------------------------------------------------------------------------------------

template <class T, int kVec>
__global__ void add_kernel(const T* a, int64_t lda, const T* b, int64_t ldb, T* out, int64_t ldo, int64_t rows,
                           int64_t cols) {
  using V = Vec<T, kVec>;
  pdl_wait();  // a programmatic dependent (src/cuda/common/pdl.cuh)
  const int64_t chunks = cols / kVec;
  const int64_t total = rows * chunks;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / chunks;
    const int64_t c = (i - r * chunks) * kVec;
    const V va = *reinterpret_cast<const V*>(a + r * lda + c);
    const V vb = *reinterpret_cast<const V*>(b + r * ldb + c);
    V vo;
#pragma unroll
    for (int v = 0; v < kVec; ++v) vo.values[v] = from_float<T>(to_float(va.values[v]) + to_float(vb.values[v]));
    *reinterpret_cast<V*>(out + r * ldo + c) = vo;
  }
  pdl_trigger();
}

// Mixed dtypes: one element per thread, dtypes read at run time.
__global__ void add_mixed_kernel(RowMatrix a, RowMatrix b, RowMatrix out) {
  const int64_t total = out.rows * out.cols;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / out.cols;
    const int64_t c = i - r * out.cols;
    const float sum =
        load_as_float_dev(a.data, a.dtype, r * a.ld + c) + load_as_float_dev(b.data, b.dtype, r * b.ld + c);
    store_from_float_dev(out.data, out.dtype, r * out.ld + c, sum);
  }
}

// --- convert ------------------------------------------------------------------------------------

template <class Tin, class To>
__global__ void convert_kernel(const Tin* in, int64_t ldi, To* out, int64_t ldo, int64_t rows, int64_t cols) {
  const int64_t total = rows * cols;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols;
    const int64_t c = i - r * cols;
    out[r * ldo + c] = from_float<To>(to_float(in[r * ldi + c]));
  }
}

// --- add_scaled_rows ----------------------------------------------------------------------------

template <class Tx, class To>
__global__ void add_scaled_rows_kernel(const Tx* x, int64_t ldx, const float* scale, To* out, int64_t ldo, int64_t rows,
                                       int64_t cols) {
  const int64_t total = rows * cols;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols;
    const int64_t c = i - r * cols;
    const float s = scale[r];
    if (s == 0.0f) continue;  // as the reference: a token with no zero expert is untouched
    const float value = fmaf(s, to_float(x[r * ldx + c]), to_float(out[r * ldo + c]));
    out[r * ldo + c] = from_float<To>(value);
  }
}

// --- activations (DESIGN section 1 step 3), fp32, accurate (cuda/common/activation.cuh) -----------

template <class T, int kVec, Activation kAct>
__global__ void gated_activation_kernel(const T* gate, const T* up, T* out, int64_t count, float beta,
                                        float linear_beta) {
  using V = Vec<T, kVec>;
  const int64_t chunks = count / kVec;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < chunks;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const V vu = reinterpret_cast<const V*>(up)[i];
    V vg;
    if constexpr (kAct != Activation::relu2) vg = reinterpret_cast<const V*>(gate)[i];
    V vo;
#pragma unroll
    for (int v = 0; v < kVec; ++v) {
      const float g = kAct != Activation::relu2 ? to_float(vg.values[v]) : 0.0f;
      vo.values[v] = from_float<T>(act::activate<kAct>(g, to_float(vu.values[v]), beta, linear_beta));
    }
    reinterpret_cast<V*>(out)[i] = vo;
  }
}

// --- combine ------------------------------------------------------------------------------------

constexpr int kMaxTopK = 32;
// Rows loaded before they are accumulated: up to kCombineBatch 16-byte loads in flight per thread.
constexpr int kCombineBatch = 8;
constexpr int kCombineThreads = 64;

// A block covers kCombineThreads column vectors of one token (blocks of one token are consecutive),
// so a one-token combine of l = 3584 bf16 columns runs on 7 blocks. Each thread loads a batch of its
// token's rows before accumulating them in j order (fp32 fmaf, the same order as the reference).
template <class Ty, class To, int kVec>
__global__ void __launch_bounds__(kCombineThreads)
    combine_kernel(const Ty* y_rows, const int32_t* pair_rows, const float* weights, int top_k, To* out, int64_t ldo,
                   int64_t cols, int64_t vectors, int blocks_per_token) {
  pdl_wait();  // a programmatic dependent of the down projection (src/cuda/common/pdl.cuh)
  const int64_t t = blockIdx.x / blocks_per_token;
  const int64_t vector = static_cast<int64_t>(blockIdx.x % blocks_per_token) * kCombineThreads + threadIdx.x;
  if (vector >= vectors) return;
  const int64_t c = vector * kVec;
  using VIn = Vec<Ty, kVec>;
  using VOut = Vec<To, kVec>;
  const int32_t* rows = pair_rows + t * top_k;
  const float* w = weights + t * top_k;
  float acc[kVec];
#pragma unroll
  for (int v = 0; v < kVec; ++v) acc[v] = 0.0f;
  for (int j0 = 0; j0 < top_k; j0 += kCombineBatch) {
    int32_t row[kCombineBatch];
    float weight[kCombineBatch];
#pragma unroll
    for (int b = 0; b < kCombineBatch; ++b) {
      row[b] = j0 + b < top_k ? __ldg(rows + j0 + b) : -1;
      weight[b] = j0 + b < top_k ? __ldg(w + j0 + b) : 0.0f;
    }
    VIn y[kCombineBatch];
#pragma unroll
    for (int b = 0; b < kCombineBatch; ++b) {
      if (row[b] >= 0) y[b] = *reinterpret_cast<const VIn*>(y_rows + static_cast<int64_t>(row[b]) * cols + c);
    }
#pragma unroll
    for (int b = 0; b < kCombineBatch; ++b) {
      if (row[b] < 0) continue;
#pragma unroll
      for (int v = 0; v < kVec; ++v) acc[v] = fmaf(weight[b], to_float(y[b].values[v]), acc[v]);
    }
  }
  VOut o;
#pragma unroll
  for (int v = 0; v < kVec; ++v) o.values[v] = from_float<To>(acc[v]);
  *reinterpret_cast<VOut*>(out + t * ldo + c) = o;
}

}  // namespace

int grid_for(int64_t work_items, int threads) {
  const int64_t blocks = (work_items + threads - 1) / threads;
  return static_cast<int>(std::clamp<int64_t>(blocks, 1, 8192));
}

void launch_add(const RowMatrix& a, const RowMatrix& b, const RowMatrix& out, cudaStream_t stream) {
  if (out.rows == 0 || out.cols == 0) return;
  if (a.dtype != out.dtype || b.dtype != out.dtype) {
    for (const RowMatrix* m : {&a, &b, &out}) dispatch_compute_dtype(m->dtype, "add operand", [](auto) {});
    add_mixed_kernel<<<grid_for(out.rows * out.cols, kThreads), kThreads, 0, stream>>>(a, b, out);
    LATENTMOE_CUDA_CHECK_LAUNCH("add_mixed_kernel");
    return;
  }
  dispatch_compute_dtype(out.dtype, "add output", [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = 16 / sizeof(T);
    const bool vectorised = out.cols % kVec == 0 && rows_aligned(a.data, a.ld, sizeof(T), 16) &&
                            rows_aligned(b.data, b.ld, sizeof(T), 16) && rows_aligned(out.data, out.ld, sizeof(T), 16);
    const auto* pa = static_cast<const T*>(a.data);
    const auto* pb = static_cast<const T*>(b.data);
    auto* po = static_cast<T*>(out.data);
    if (vectorised) {
      launch_dependent("add_kernel", add_kernel<T, kVec>, grid_for(out.rows * out.cols / kVec, kThreads), kThreads, 0,
                       stream, pa, a.ld, pb, b.ld, po, out.ld, out.rows, out.cols);
    } else {
      launch_dependent("add_kernel", add_kernel<T, 1>, grid_for(out.rows * out.cols, kThreads), kThreads, 0, stream, pa,
                       a.ld, pb, b.ld, po, out.ld, out.rows, out.cols);
    }
  });
}

void launch_convert(const RowMatrix& in, const RowMatrix& out, cudaStream_t stream) {
  if (out.rows == 0 || out.cols == 0) return;
  dispatch_compute_dtype(in.dtype, "convert input", [&](auto in_tag) {
    using Tin = decltype(in_tag);
    dispatch_compute_dtype(out.dtype, "convert output", [&](auto out_tag) {
      using To = decltype(out_tag);
      convert_kernel<Tin, To><<<grid_for(out.rows * out.cols, kThreads), kThreads, 0, stream>>>(
          static_cast<const Tin*>(in.data), in.ld, static_cast<To*>(out.data), out.ld, out.rows, out.cols);
      LATENTMOE_CUDA_CHECK_LAUNCH("convert_kernel");
    });
  });
}

void launch_add_scaled_rows(const RowMatrix& x, const float* scale, const RowMatrix& out, cudaStream_t stream) {
  if (out.rows == 0 || out.cols == 0) return;
  dispatch_compute_dtype(x.dtype, "add_scaled_rows input", [&](auto x_tag) {
    using Tx = decltype(x_tag);
    dispatch_compute_dtype(out.dtype, "add_scaled_rows output", [&](auto out_tag) {
      using To = decltype(out_tag);
      add_scaled_rows_kernel<Tx, To><<<grid_for(out.rows * out.cols, kThreads), kThreads, 0, stream>>>(
          static_cast<const Tx*>(x.data), x.ld, scale, static_cast<To*>(out.data), out.ld, out.rows, out.cols);
      LATENTMOE_CUDA_CHECK_LAUNCH("add_scaled_rows_kernel");
    });
  });
}

void launch_gated_activation(const ::latentmoe::detail::ActivationParams& activation, DType dtype, const void* gate,
                             const void* up, void* out, int64_t count, cudaStream_t stream) {
  if (count == 0) return;
  dispatch_compute_dtype(dtype, "activation", [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = 16 / sizeof(T);
    const bool gated = activation.activation != Activation::relu2;
    const bool vectorised = count % kVec == 0 && reinterpret_cast<uintptr_t>(up) % 16 == 0 &&
                            reinterpret_cast<uintptr_t>(out) % 16 == 0 &&
                            (!gated || reinterpret_cast<uintptr_t>(gate) % 16 == 0);
    const auto* g = static_cast<const T*>(gate);
    const auto* u = static_cast<const T*>(up);
    auto* o = static_cast<T*>(out);
    const float beta = activation.situ_beta, linear_beta = activation.situ_linear_beta;
    auto launch = [&](auto vec_tag) {
      constexpr int kV = decltype(vec_tag)::value;
      const int grid = grid_for(count / kV, kThreads);
      switch (activation.activation) {
        case Activation::silu:
          gated_activation_kernel<T, kV, Activation::silu>
              <<<grid, kThreads, 0, stream>>>(g, u, o, count, beta, linear_beta);
          break;
        case Activation::situ:
          gated_activation_kernel<T, kV, Activation::situ>
              <<<grid, kThreads, 0, stream>>>(g, u, o, count, beta, linear_beta);
          break;
        case Activation::relu2:
          gated_activation_kernel<T, kV, Activation::relu2>
              <<<grid, kThreads, 0, stream>>>(g, u, o, count, beta, linear_beta);
          break;
      }
      LATENTMOE_CUDA_CHECK_LAUNCH("gated_activation_kernel");
    };
    if (vectorised) {
      launch(std::integral_constant<int, kVec>{});
    } else {
      launch(std::integral_constant<int, 1>{});
    }
  });
}

void launch_combine(DType y_dtype, const void* y_rows, const int32_t* pair_rows, const float* weights, int top_k,
                    const RowMatrix& out, cudaStream_t stream) {
  if (out.rows == 0 || out.cols == 0) return;
  LATENTMOE_CHECK(top_k >= 1 && top_k <= kMaxTopK, "CUDA combine: top_k ", top_k, " is outside 1..", kMaxTopK);
  dispatch_compute_dtype(y_dtype, "expert output rows", [&](auto y_tag) {
    using Ty = decltype(y_tag);
    dispatch_compute_dtype(out.dtype, "routed expert output", [&](auto out_tag) {
      using To = decltype(out_tag);
      // 8 elements per thread when both sides allow it (16-byte loads of 16-bit rows).
      constexpr int kVec = 8;
      const bool vectorised = out.cols % kVec == 0 && rows_aligned(y_rows, out.cols, sizeof(Ty), sizeof(Ty) * kVec) &&
                              rows_aligned(out.data, out.ld, sizeof(To), sizeof(To) * kVec);
      const int vec = vectorised ? kVec : 1;
      const int64_t vectors = out.cols / vec;
      const int64_t blocks_per_token = (vectors + kCombineThreads - 1) / kCombineThreads;
      const int64_t blocks = blocks_per_token * out.rows;
      LATENTMOE_CHECK(blocks <= INT_MAX, "CUDA combine: ", out.rows, " x ", out.cols, " outputs need too many blocks");
      const auto* y = static_cast<const Ty*>(y_rows);
      auto* o = static_cast<To*>(out.data);
      const auto grid = static_cast<unsigned>(blocks);
      const auto per_token = static_cast<int>(blocks_per_token);
      if (vectorised) {
        launch_dependent("combine_kernel", combine_kernel<Ty, To, kVec>, grid, kCombineThreads, 0, stream, y, pair_rows,
                         weights, top_k, o, out.ld, out.cols, vectors, per_token);
      } else {
        launch_dependent("combine_kernel", combine_kernel<Ty, To, 1>, grid, kCombineThreads, 0, stream, y, pair_rows,
                         weights, top_k, o, out.ld, out.cols, vectors, per_token);
      }
    });
  });
}

}  // namespace latentmoe::cuda

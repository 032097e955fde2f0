#include "cuda/small_gemm.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "cuda/cuda_check.h"
#include "latentmoe/error.h"

namespace latentmoe::cuda {
namespace {

using ::latentmoe::detail::ActivationParams;

// What the kernel computes per output column: a plain projection (y or y += x w^T) or the dense
// MLP's activated intermediate (silu/situ: gate and up streamed together; relu2: up only).
enum class Op { linear, silu, situ, relu2 };

constexpr int kThreads = 128;
constexpr int kWarpsPerBlock = kThreads / 32;
constexpr int kVecElems = 8;  // 16 bytes of bf16/f16
constexpr int kVecBytes = 16;

// Weight rows per warp (each loaded weight vector is reused for all tokens of the bin, and each x
// vector for all rows) and 16-byte vectors per row in flight per thread. Rows x unroll loads of 16
// bytes stay in flight per thread (16 up to 8 tokens, 8 at 16 tokens where the accumulators need
// the registers); the accumulators are rows x tokens floats.
template <int kTok>
struct Shape {
  static constexpr int kRows = kTok <= 4 ? 2 : 4;
  static constexpr int kUnroll = kTok <= 4 ? 8 : (kTok <= 8 ? 4 : 2);
};

struct Params {
  const void* x = nullptr;
  int64_t ldx = 0;
  const void* w0 = nullptr;  // w (linear), gate (silu/situ) or up (relu2)
  int64_t ldw0 = 0;
  const void* w1 = nullptr;  // up (silu/situ)
  int64_t ldw1 = 0;
  void* y = nullptr;
  int64_t ldy = 0;
  int num_tokens = 0;
  int64_t cols = 0;   // n: output columns
  int64_t inner = 0;  // m
  bool accumulate = false;
  float beta = 0.0f, linear_beta = 0.0f;
};

// The activations of DESIGN section 1 step 3 in fp32: the same formulas as elementwise.cu's
// gated_activation_kernel, here applied to the unrounded sums (as the CPU reference does).
__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }

template <Op kOp>
__device__ __forceinline__ float activate(float gate, float up, float beta, float linear_beta) {
  if constexpr (kOp == Op::silu) {
    return gate * sigmoid_f(gate) * up;
  } else if constexpr (kOp == Op::situ) {
    return (beta * tanhf(gate / beta) * sigmoid_f(gate)) * (linear_beta * tanhf(up / linear_beta));
  } else {
    if (isnan(up)) return up;  // relu keeps NaN, as torch.relu does
    return up > 0.0f ? up * up : 0.0f;
  }
}

// The 8 values of a 16-byte vector as floats (exact).
template <class T>
__device__ __forceinline__ void unpack(const uint4& bits, float (&out)[kVecElems]);

template <>
__device__ __forceinline__ void unpack<__nv_bfloat16>(const uint4& bits, float (&out)[kVecElems]) {
  const uint32_t words[4] = {bits.x, bits.y, bits.z, bits.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = __uint_as_float(words[i] << 16);
    out[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
  }
}

template <>
__device__ __forceinline__ void unpack<__half>(const uint4& bits, float (&out)[kVecElems]) {
  const uint32_t words[4] = {bits.x, bits.y, bits.z, bits.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __half2 pair;
    static_assert(sizeof(pair) == sizeof(uint32_t));
    memcpy(&pair, &words[i], sizeof(pair));
    const float2 values = __half22float2(pair);
    out[2 * i] = values.x;
    out[2 * i + 1] = values.y;
  }
}

// Reduce-scatter of a warp's kUnits x kMats sums: at step s (lane bit 16 >> s) a lane keeps the half
// of its live units selected by that bit and adds its partner's copy of that half (kUnits - 1
// shuffles per matrix in all instead of 5 per unit). Once one unit is left, the remaining steps are
// plain butterfly sums. `base` gathers the index of the lane's first unit. Fixed order: deterministic.
template <int kLive, int kStep, int kUnits, int kMats>
__device__ __forceinline__ void reduce_scatter(float (&acc)[kUnits][kMats], int lane, int& base) {
  if constexpr (kStep < 5) {
    constexpr int kOffset = 16 >> kStep;
    if constexpr (kLive >= 2) {
      constexpr int kHalf = kLive / 2;
      const bool upper = (lane & kOffset) != 0;
#pragma unroll
      for (int i = 0; i < kHalf; ++i) {
#pragma unroll
        for (int mat = 0; mat < kMats; ++mat) {
          const float send = upper ? acc[i][mat] : acc[i + kHalf][mat];
          const float keep = upper ? acc[i + kHalf][mat] : acc[i][mat];
          acc[i][mat] = keep + __shfl_xor_sync(0xffffffffu, send, kOffset);
        }
      }
      if (upper) base += kHalf;
      reduce_scatter<kHalf, kStep + 1>(acc, lane, base);
    } else {
#pragma unroll
      for (int mat = 0; mat < kMats; ++mat) acc[0][mat] += __shfl_xor_sync(0xffffffffu, acc[0][mat], kOffset);
      reduce_scatter<1, kStep + 1>(acc, lane, base);
    }
  }
}

// One warp owns kOut consecutive output columns and streams their kRows = kOut * kMats weight rows
// (row o * kMats + mat: mat 0 = w0, mat 1 = w1) over the whole inner dimension; lane l reads the
// 16-byte vectors l, l + 32, ... of every row, kUnroll of them per row before using any. Each
// thread keeps one fp32 sum per (column, token, matrix); a reduce-scatter over the warp's lanes then
// leaves every sum on one lane, which writes it. Tokens past num_tokens (the bin is a power of two)
// are skipped by a warp-uniform branch; columns past cols load the last row and are not written.
template <class T, int kTok, Op kOp>
__global__ void __launch_bounds__(kThreads) small_gemm_kernel(Params p) {
  constexpr int kMats = (kOp == Op::silu || kOp == Op::situ) ? 2 : 1;
  constexpr int kRows = Shape<kTok>::kRows;
  constexpr int kOut = kRows / kMats;
  constexpr int kUnroll = Shape<kTok>::kUnroll;
  constexpr int kUnits = kOut * kTok;  // (column, token) pairs per warp; unit j = o * kTok + t
  static_assert((kUnits & (kUnits - 1)) == 0, "the reduce-scatter halves the unit count");

  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int64_t out0 = warp * kOut;
  if (out0 >= p.cols) return;  // the whole warp: the grid's last block may have spare warps

  const T* rows[kRows];
#pragma unroll
  for (int o = 0; o < kOut; ++o) {
    const int64_t c = min(out0 + o, p.cols - 1);
#pragma unroll
    for (int mat = 0; mat < kMats; ++mat) {
      const T* base = static_cast<const T*>(mat == 0 ? p.w0 : p.w1);
      rows[o * kMats + mat] = base + c * (mat == 0 ? p.ldw0 : p.ldw1);
    }
  }
  const T* x = static_cast<const T*>(p.x);

  float acc[kUnits][kMats];
#pragma unroll
  for (int j = 0; j < kUnits; ++j) {
#pragma unroll
    for (int mat = 0; mat < kMats; ++mat) acc[j][mat] = 0.0f;
  }

  const int64_t num_vecs = p.inner / kVecElems;
  for (int64_t v0 = lane; v0 < num_vecs; v0 += 32 * kUnroll) {
    uint4 wv[kUnroll][kRows];
    // All weight loads of this step first: kUnroll x kRows 16-byte loads in flight. Weights are
    // read once per call: streaming loads (evict-first), so x and y stay in L2.
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t v = v0 + 32 * u;
      if (v < num_vecs) {
#pragma unroll
        for (int r = 0; r < kRows; ++r) wv[u][r] = __ldcs(reinterpret_cast<const uint4*>(rows[r] + v * kVecElems));
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t v = v0 + 32 * u;
      if (v < num_vecs) {
        float wf[kRows][kVecElems];
#pragma unroll
        for (int r = 0; r < kRows; ++r) unpack<T>(wv[u][r], wf[r]);
#pragma unroll
        for (int t = 0; t < kTok; ++t) {
          if (kTok == 1 || t < p.num_tokens) {
            float xf[kVecElems];
            unpack<T>(__ldg(reinterpret_cast<const uint4*>(x + t * p.ldx + v * kVecElems)), xf);
#pragma unroll
            for (int o = 0; o < kOut; ++o) {
#pragma unroll
              for (int mat = 0; mat < kMats; ++mat) {
#pragma unroll
                for (int e = 0; e < kVecElems; ++e) {
                  acc[o * kTok + t][mat] = fmaf(wf[o * kMats + mat][e], xf[e], acc[o * kTok + t][mat]);
                }
              }
            }
          }
        }
      }
    }
  }
  // The last inner % 8 elements, one per lane (only views with 16-byte aligned row strides and an
  // inner size that is not a multiple of 8 get here).
  const int64_t k = num_vecs * kVecElems + lane;
  if (k < p.inner) {
    float wf[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) wf[r] = to_float(rows[r][k]);
#pragma unroll
    for (int t = 0; t < kTok; ++t) {
      if (kTok == 1 || t < p.num_tokens) {
        const float xv = to_float(x[t * p.ldx + k]);
#pragma unroll
        for (int o = 0; o < kOut; ++o) {
#pragma unroll
          for (int mat = 0; mat < kMats; ++mat) {
            acc[o * kTok + t][mat] = fmaf(wf[o * kMats + mat], xv, acc[o * kTok + t][mat]);
          }
        }
      }
    }
  }

  int base = 0;
  reduce_scatter<kUnits, 0>(acc, lane, base);
  constexpr int kFinal = kUnits >= 32 ? kUnits / 32 : 1;   // units per lane now: base, base + 1, ...
  constexpr int kCopies = kUnits >= 32 ? 1 : 32 / kUnits;  // lanes holding the same unit
  if (lane % kCopies != 0) return;

  T* y = static_cast<T*>(p.y);
#pragma unroll
  for (int i = 0; i < kFinal; ++i) {
    const int j = base + i;
    const int t = j % kTok;
    const int64_t c = out0 + j / kTok;
    if (t >= p.num_tokens || c >= p.cols) continue;
    T* dst = y + t * p.ldy + c;
    float value;
    if constexpr (kOp == Op::linear) {
      value = acc[i][0];
      if (p.accumulate) value += to_float(*dst);
    } else if constexpr (kMats == 2) {
      value = activate<kOp>(acc[i][0], acc[i][1], p.beta, p.linear_beta);
    } else {
      value = activate<kOp>(0.0f, acc[i][0], p.beta, p.linear_beta);
    }
    *dst = from_float<T>(value);
  }
}

template <class T, int kTok, Op kOp>
void launch_bin(const Params& p, cudaStream_t stream) {
  constexpr int kMats = (kOp == Op::silu || kOp == Op::situ) ? 2 : 1;
  constexpr int kOut = Shape<kTok>::kRows / kMats;
  const int64_t warps = (p.cols + kOut - 1) / kOut;
  const int64_t blocks = (warps + kWarpsPerBlock - 1) / kWarpsPerBlock;
  LATENTMOE_CHECK(blocks <= 0x7fffffff, "CUDA small GEMM: ", p.cols, " output columns are too many for one grid");
  small_gemm_kernel<T, kTok, kOp><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
  LATENTMOE_CUDA_CHECK_LAUNCH("small_gemm_kernel");
}

// The token bin: the next power of two (1, 2, 4, 8, 16).
template <Op kOp>
void launch_op(DType dtype, const Params& p, cudaStream_t stream) {
  auto with_type = [&](auto tag) {
    using T = decltype(tag);
    if (p.num_tokens <= 1) launch_bin<T, 1, kOp>(p, stream);
    else if (p.num_tokens <= 2) launch_bin<T, 2, kOp>(p, stream);
    else if (p.num_tokens <= 4) launch_bin<T, 4, kOp>(p, stream);
    else if (p.num_tokens <= 8) launch_bin<T, 8, kOp>(p, stream);
    else launch_bin<T, 16, kOp>(p, stream);
  };
  if (dtype == DType::bf16) with_type(__nv_bfloat16{});
  else with_type(__half{});
}

bool is_16bit(DType dtype) { return dtype == DType::bf16 || dtype == DType::f16; }

// The base pointer and every row start (ld elements of 2 bytes apart) on 16 bytes.
bool rows_aligned_16(const void* pointer, int64_t ld, int64_t rows) {
  return reinterpret_cast<uintptr_t>(pointer) % kVecBytes == 0 && (rows <= 1 || (ld * 2) % kVecBytes == 0);
}

}  // namespace

bool small_gemm_supports(const GemmProblem& problem) {
  return problem.rows >= 1 && problem.rows <= kSmallGemmMaxTokens && problem.cols >= 1 && problem.inner >= 1 &&
         is_16bit(problem.x_dtype) && problem.w_dtype == problem.x_dtype && problem.y_dtype == problem.x_dtype &&
         rows_aligned_16(problem.x, problem.ldx, problem.rows) && rows_aligned_16(problem.w, problem.ldw, problem.cols);
}

void launch_small_gemm(const GemmProblem& problem, cudaStream_t stream) {
  LATENTMOE_CHECK(small_gemm_supports(problem), "CUDA small GEMM: the problem [", problem.rows, ", ", problem.inner,
                  "] x [", problem.cols, ", ", problem.inner, "]^T (", dtype_name(problem.x_dtype), ", ",
                  dtype_name(problem.w_dtype), " -> ", dtype_name(problem.y_dtype),
                  ") is not supported: it needs T <= ", kSmallGemmMaxTokens,
                  ", one BF16/F16 dtype and 16-byte aligned rows");
  Params p;
  p.x = problem.x;
  p.ldx = problem.ldx;
  p.w0 = problem.w;
  p.ldw0 = problem.ldw;
  p.y = problem.y;
  p.ldy = problem.ldy;
  p.num_tokens = static_cast<int>(problem.rows);
  p.cols = problem.cols;
  p.inner = problem.inner;
  p.accumulate = problem.accumulate;
  launch_op<Op::linear>(problem.x_dtype, p, stream);
}

bool small_gate_up_supports(const ActivationParams& activation, const RowMatrix& x, const RowMatrix& gate,
                            const RowMatrix& up, const RowMatrix& out) {
  const bool gated = activation.activation != Activation::relu2;
  const DType dtype = x.dtype;
  if (!is_16bit(dtype) || up.dtype != dtype || out.dtype != dtype) return false;
  if (x.rows < 1 || x.rows > kSmallGemmMaxTokens || x.cols < 1 || up.rows < 1) return false;
  if (up.cols != x.cols || out.rows != x.rows || out.cols != up.rows) return false;
  if (!rows_aligned_16(x.data, x.ld, x.rows) || !rows_aligned_16(up.data, up.ld, up.rows)) return false;
  if (gated) {
    if (gate.dtype != dtype || gate.rows != up.rows || gate.cols != up.cols) return false;
    if (!rows_aligned_16(gate.data, gate.ld, gate.rows)) return false;
  }
  return true;
}

void launch_small_gate_up(const ActivationParams& activation, const RowMatrix& x, const RowMatrix& gate,
                          const RowMatrix& up, const RowMatrix& out, cudaStream_t stream) {
  LATENTMOE_CHECK(small_gate_up_supports(activation, x, gate, up, out), "CUDA small gate/up: x [", x.rows, ", ",
                  x.cols, "] ", dtype_name(x.dtype), " with up [", up.rows, ", ", up.cols, "] ", dtype_name(up.dtype),
                  " is not supported: it needs T <= ", kSmallGemmMaxTokens,
                  ", one BF16/F16 dtype and 16-byte aligned rows");
  const bool gated = activation.activation != Activation::relu2;
  Params p;
  p.x = x.data;
  p.ldx = x.ld;
  p.w0 = gated ? gate.data : up.data;
  p.ldw0 = gated ? gate.ld : up.ld;
  p.w1 = gated ? up.data : nullptr;
  p.ldw1 = gated ? up.ld : 0;
  p.y = out.data;
  p.ldy = out.ld;
  p.num_tokens = static_cast<int>(x.rows);
  p.cols = up.rows;
  p.inner = x.cols;
  p.beta = activation.situ_beta;
  p.linear_beta = activation.situ_linear_beta;
  switch (activation.activation) {
    case Activation::silu: launch_op<Op::silu>(x.dtype, p, stream); break;
    case Activation::situ: launch_op<Op::situ>(x.dtype, p, stream); break;
    case Activation::relu2: launch_op<Op::relu2>(x.dtype, p, stream); break;
  }
}

}  // namespace latentmoe::cuda

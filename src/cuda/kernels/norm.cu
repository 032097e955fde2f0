#include <algorithm>

#include "cuda/common/cuda_check.h"
#include "cuda/common/dtype_dispatch.cuh"
#include "cuda/common/pdl.cuh"
#include "cuda/common/reduce.cuh"
#include "cuda/kernels/norm.h"

namespace latentmoe::cuda {
namespace {

// Sum over the block in a fixed order (deterministic for a fixed launch configuration).
__device__ float block_sum(float value, float* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, num_warps = blockDim.x / 32;
  value = warp_sum(value);
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  float total = 0.0f;
  if (warp == 0) {
    total = lane < num_warps ? scratch[lane] : 0.0f;
    total = warp_sum(total);
    if (lane == 0) scratch[32] = total;
  }
  __syncthreads();
  return scratch[32];
}

template <class Tin, class To, int kVec>
__global__ void rms_norm_kernel(const Tin* in, int64_t ldi, const void* gamma, DType gamma_dtype, float eps, To* out,
                                int64_t ldo, int64_t cols) {
  __shared__ float scratch[33];
  pdl_wait();  // a programmatic dependent (src/cuda/common/pdl.cuh)
  using VIn = Vec<Tin, kVec>;
  using VOut = Vec<To, kVec>;
  const Tin* row = in + blockIdx.x * ldi;
  To* out_row = out + blockIdx.x * ldo;
  float sum_squares = 0.0f;
  for (int64_t c = static_cast<int64_t>(threadIdx.x) * kVec; c < cols; c += static_cast<int64_t>(blockDim.x) * kVec) {
    const VIn v = *reinterpret_cast<const VIn*>(row + c);
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const float x = to_float(v.values[i]);
      sum_squares = fmaf(x, x, sum_squares);
    }
  }
  const float total = block_sum(sum_squares, scratch);
  const float inverse_rms = 1.0f / sqrtf(total / static_cast<float>(cols) + eps);
  // The second pass re-reads the row (from L1/L2); `out` may alias `in`, and each element is read
  // before it is written by the same thread.
  for (int64_t c = static_cast<int64_t>(threadIdx.x) * kVec; c < cols; c += static_cast<int64_t>(blockDim.x) * kVec) {
    const VIn v = *reinterpret_cast<const VIn*>(row + c);
    VOut o;
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const float g = load_as_float_dev(gamma, gamma_dtype, c + i);
      o.values[i] = from_float<To>(to_float(v.values[i]) * inverse_rms * g);
    }
    *reinterpret_cast<VOut*>(out_row + c) = o;
  }
  pdl_trigger();
}

}  // namespace

void launch_rms_norm(const RowMatrix& in, const void* gamma, DType gamma_dtype, float eps, const RowMatrix& out,
                     cudaStream_t stream) {
  if (in.rows == 0 || in.cols == 0) return;
  dispatch_compute_dtype(gamma_dtype, "RMSNorm gamma", [](auto) {});
  dispatch_compute_dtype(in.dtype, "RMSNorm input", [&](auto in_tag) {
    using Tin = decltype(in_tag);
    dispatch_compute_dtype(out.dtype, "RMSNorm output", [&](auto out_tag) {
      using To = decltype(out_tag);
      // The vector width is set by the narrower type: 16 bytes of it per access.
      constexpr int kVec = 16 / std::min(sizeof(Tin), sizeof(To));
      const bool vectorised = in.cols % kVec == 0 && rows_aligned(in.data, in.ld, sizeof(Tin), sizeof(Tin) * kVec) &&
                              rows_aligned(out.data, out.ld, sizeof(To), sizeof(To) * kVec);
      const int vec = vectorised ? kVec : 1;
      const int64_t lanes = (in.cols + vec - 1) / vec;
      const int threads = static_cast<int>(std::clamp<int64_t>((lanes + 31) / 32 * 32, 32, 512));
      const auto grid = static_cast<unsigned>(in.rows);
      const auto* pin = static_cast<const Tin*>(in.data);
      auto* pout = static_cast<To*>(out.data);
      if (vectorised) {
        launch_dependent("rms_norm_kernel", rms_norm_kernel<Tin, To, kVec>, grid, threads, 0, stream, pin, in.ld, gamma,
                         gamma_dtype, eps, pout, out.ld, in.cols);
      } else {
        launch_dependent("rms_norm_kernel", rms_norm_kernel<Tin, To, 1>, grid, threads, 0, stream, pin, in.ld, gamma,
                         gamma_dtype, eps, pout, out.ld, in.cols);
      }
    });
  });
}

}  // namespace latentmoe::cuda

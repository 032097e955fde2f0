// MXFP4 routed experts at decode (mxfp4_decode.h): the host entry points, which hand bf16 and f16 calls
// to the tensor-core kernels (mxfp4_decode_mma.cu) and run the rest (f32 activations, rows not 16-byte
// aligned) on the CUDA-core kernels below.
//
// CUDA-core kernels. Layout read: a row of an [rows, cols] matrix is cols/2 packed bytes, each 32-bit word the
// 8 codes of 8 consecutive columns in the kernel order (mxfp4_device.cuh), and cols/32 scale bytes; one scale
// group of 32 columns is exactly 16 packed bytes, so a lane moves one group with one 16-byte load and one byte of
// scale.
//
// gate/up: one CTA per (pair, block of kRowsPerCta rows); the CTA stages z_t in shared memory as
// fp32; each warp takes rows of the block, its lanes take the row's groups in turn (lane q: groups q,
// q + 32, ...), then the warp sums the lanes in a fixed butterfly. down: one CTA per (token, block of
// rows); for each row, each of the token's real pairs in j order: the same lane split over the
// pair's act row (read through L1), the warp sum weighted by w_tj into a fp32 total, rounded once.
// (A baseline: on the H200 they ran at 5-13% of the byte floor, which is why bf16/f16 go to the
// tensor-core kernels.)
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/common/activation.cuh"
#include "cuda/common/convert.cuh"
#include "cuda/common/cuda_check.h"
#include "cuda/common/device.h"
#include "cuda/common/dtype_dispatch.cuh"
#include "cuda/gemm/mxfp4_decode.h"
#include "cuda/gemm/mxfp4_decode_mma.h"
#include "cuda/gemm/mxfp4_device.cuh"
#include "latentmoe/error.h"

namespace latentmoe::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kRowsPerCta = 32;      // 4 rows per warp
constexpr int kGroup = kMxfp4Group;  // columns per scale

// The dot product of group q of a packed row with x[32 q .. 32 q + 31]: X is float (the gate/up
// kernel's staged latent row, in shared memory) or the storage type (the down kernel's act row, read
// through L1), widened to fp32 per element; the products are added in column order.
template <class X>
__device__ __forceinline__ float group_dot(const uint8_t* packed_row, const uint8_t* scale_row, int64_t q, const X* x) {
  const uint4 raw = *reinterpret_cast<const uint4*>(packed_row + q * (kGroup / 2));
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
  const X* xs = x + q * kGroup;
  float partial = 0.0f;
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const float2 p0 = e2m1_pair_float<0>(words[w]), p1 = e2m1_pair_float<1>(words[w]);
    const float2 p2 = e2m1_pair_float<2>(words[w]), p3 = e2m1_pair_float<3>(words[w]);
    const float values[8] = {p0.x, p0.y, p1.x, p1.y, p2.x, p2.y, p3.x, p3.y};  // columns 8w .. 8w + 7
#pragma unroll
    for (int c = 0; c < 8; ++c) partial = fmaf(values[c], to_float(xs[w * 8 + c]), partial);
  }
  return partial * e8m0_scale(scale_row[q]);
}

__device__ __forceinline__ float warp_sum(float value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

template <class T>
__global__ void __launch_bounds__(kThreads) mxfp4_gate_up_kernel(Mxfp4GateUpCall p) {
  extern __shared__ float z_row[];  // [l]
  const int64_t pair = blockIdx.x;
  const int expert = p.ids[pair];
  if (expert < 0 || expert >= p.num_experts) return;  // a zero expert, or a pad: no row
  const int64_t token = pair / p.top_k;
  const int64_t intermediate = p.up.rows, latent = p.up.cols, groups = latent / kGroup;
  const T* z = static_cast<const T*>(p.z) + token * p.ld_z;
  for (int64_t c = threadIdx.x; c < latent; c += kThreads) z_row[c] = to_float(z[c]);
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const bool gated = p.gate.packed != nullptr;
  for (int r = warp; r < kRowsPerCta; r += kWarps) {
    const int64_t row = blockIdx.y * static_cast<int64_t>(kRowsPerCta) + r;
    if (row >= intermediate) break;
    const int64_t matrix_row = static_cast<int64_t>(expert) * intermediate + row;
    const uint8_t* up_packed = p.up.packed + matrix_row * (latent / 2);
    const uint8_t* up_scales = p.up.scales + matrix_row * groups;
    float up = 0.0f, gate = 0.0f;
    for (int64_t q = lane; q < groups; q += 32) {
      up += group_dot(up_packed, up_scales, q, z_row);
      if (gated) {
        gate += group_dot(p.gate.packed + matrix_row * (latent / 2), p.gate.scales + matrix_row * groups, q, z_row);
      }
    }
    up = warp_sum(up);
    gate = warp_sum(gate);
    if (lane == 0) {
      float value;
      if (p.activation.activation == Activation::relu2) {
        value = act::relu2(up);
      } else {
        value = act::gated(gate, up, p.activation.activation == Activation::situ, p.activation.situ_beta,
                           p.activation.situ_linear_beta);
      }
      static_cast<T*>(p.act)[pair * intermediate + row] = from_float<T>(value);
    }
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads) mxfp4_down_kernel(Mxfp4DownCall p) {
  const int64_t token = blockIdx.x;
  const int64_t latent = p.down.rows, intermediate = p.down.cols, groups = intermediate / kGroup;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int r = warp; r < kRowsPerCta; r += kWarps) {
    const int64_t row = blockIdx.y * static_cast<int64_t>(kRowsPerCta) + r;
    if (row >= latent) break;
    float total = 0.0f;
    for (int j = 0; j < p.top_k; ++j) {
      const int64_t pair = token * p.top_k + j;
      const int expert = p.ids[pair];
      if (expert < 0 || expert >= p.num_experts) continue;
      const int64_t matrix_row = static_cast<int64_t>(expert) * latent + row;
      const uint8_t* packed = p.down.packed + matrix_row * (intermediate / 2);
      const uint8_t* scales = p.down.scales + matrix_row * groups;
      const T* act_row = static_cast<const T*>(p.act) + pair * intermediate;
      float dot = 0.0f;
      for (int64_t q = lane; q < groups; q += 32) dot += group_dot(packed, scales, q, act_row);
      total = fmaf(p.weights[pair], warp_sum(dot), total);
    }
    if (lane == 0) static_cast<T*>(p.out)[token * p.ld_out + row] = from_float<T>(total);
  }
}

void check_matrices(const Mxfp4Matrices& m, const char* what) {
  LATENTMOE_CHECK(m.packed != nullptr && m.scales != nullptr && m.rows >= 1 && m.cols >= kGroup && m.cols % kGroup == 0,
                  "MXFP4 ", what, ": [", m.rows, ", ", m.cols, "] needs packed codes, scales and columns in whole ",
                  "groups of ", kGroup);
  LATENTMOE_CHECK(reinterpret_cast<uintptr_t>(m.packed) % 16 == 0, "MXFP4 ", what,
                  ": the packed codes must start on a 16-byte boundary");
}

}  // namespace

void mxfp4_routed_gate_up(const Mxfp4GateUpCall& call, cudaStream_t stream) {
  if (call.tokens == 0) return;
  LATENTMOE_CHECK(call.tokens >= 1 && call.tokens <= kMxfp4DecodeMaxRows, "MXFP4 routed experts: ", call.tokens,
                  " tokens; the decode kernels take 1..", kMxfp4DecodeMaxRows);
  check_matrices(call.up, "up");
  const bool gated = call.activation.activation != Activation::relu2;
  LATENTMOE_CHECK(gated == (call.gate.packed != nullptr),
                  "MXFP4 routed experts: ", to_string(call.activation.activation), gated ? " needs" : " takes no",
                  " gate weights");
  if (gated) {
    check_matrices(call.gate, "gate");
    LATENTMOE_CHECK(call.gate.rows == call.up.rows && call.gate.cols == call.up.cols,
                    "MXFP4 routed experts: gate and up differ");
  }
  if (mxfp4_mma_supported(call.dtype, call.tokens, call.top_k, call.z, call.ld_z)) {
    mxfp4_mma_gate_up(call, stream);
    return;
  }
  const dim3 grid(static_cast<unsigned>(call.tokens * call.top_k),
                  static_cast<unsigned>((call.up.rows + kRowsPerCta - 1) / kRowsPerCta));
  const size_t shared = static_cast<size_t>(call.up.cols) * sizeof(float);
  dispatch_compute_dtype(call.dtype, "MXFP4 routed experts", [&](auto tag) {
    using T = decltype(tag);
    if (shared > 48 * 1024) {
      LATENTMOE_CUDA_CHECK(cudaFuncSetAttribute(mxfp4_gate_up_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                static_cast<int>(shared)));
    }
    mxfp4_gate_up_kernel<T><<<grid, kThreads, shared, stream>>>(call);
  });
  LATENTMOE_CUDA_CHECK_LAUNCH("mxfp4_gate_up_kernel");
}

void mxfp4_routed_down(const Mxfp4DownCall& call, cudaStream_t stream) {
  if (call.tokens == 0) return;
  LATENTMOE_CHECK(call.tokens >= 1 && call.tokens <= kMxfp4DecodeMaxRows, "MXFP4 routed experts: ", call.tokens,
                  " tokens; the decode kernels take 1..", kMxfp4DecodeMaxRows);
  check_matrices(call.down, "down");
  LATENTMOE_CHECK(call.ld_out >= call.down.rows, "MXFP4 routed experts: output row stride ", call.ld_out, " < ",
                  call.down.rows);
  if (mxfp4_mma_supported(call.dtype, call.tokens, call.top_k, call.act, call.down.cols)) {
    mxfp4_mma_down(call, stream);
    return;
  }
  const dim3 grid(static_cast<unsigned>(call.tokens),
                  static_cast<unsigned>((call.down.rows + kRowsPerCta - 1) / kRowsPerCta));
  dispatch_compute_dtype(call.dtype, "MXFP4 routed experts", [&](auto tag) {
    using T = decltype(tag);
    mxfp4_down_kernel<T><<<grid, kThreads, 0, stream>>>(call);
  });
  LATENTMOE_CUDA_CHECK_LAUNCH("mxfp4_down_kernel");
}

}  // namespace latentmoe::cuda

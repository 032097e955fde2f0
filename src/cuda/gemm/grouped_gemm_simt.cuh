// The SIMT grouped GEMM: plain fp32 FMAs (true fp32, no TF32) for f32, for GPUs without mma.sync and
// for shapes the tensor-core path does not take (l or I_r not a multiple of 8). Any alignment, any
// shape. Same tile numbering as the tensor-core kernel (find_tile), 32 x 32 output tiles.
#pragma once

#include "cuda/gemm/grouped_gemm_common.cuh"

namespace latentmoe::cuda::gg {

constexpr int kSimtBlockM = 32;
constexpr int kSimtBlockN = 32;  // output columns
constexpr int kSimtBlockK = 32;
constexpr int kSimtThreads = 256;

template <class T, Mode kMode>
__global__ void __launch_bounds__(kSimtThreads) grouped_simt_kernel(const KernelArgs args) {
  constexpr bool kGated = kMode == Mode::gated;
  constexpr int kMats = kGated ? 2 : 1;
  __shared__ float s_a[kSimtBlockK][kSimtBlockM + 1];
  __shared__ float s_b[kMats][kSimtBlockK][kSimtBlockN + 1];
  __shared__ TileInfo s_tile;
  __shared__ int s_scan[kSimtThreads / 32];
  __shared__ int s_row_src[kSimtBlockM];

  if (!find_tile<kSimtThreads>(args.expert_offsets, args.num_experts, kSimtBlockM, blockIdx.x, &s_tile, s_scan)) {
    return;
  }
  const int tid = threadIdx.x;
  const int tx = tid % 16;
  const int ty = tid / 16;
  const int row_begin = s_tile.row_begin;
  const int rows = s_tile.row_end - row_begin;
  const int n = args.n;
  const int k = args.k;
  const int n0 = blockIdx.y * kSimtBlockN;
  if (tid < kSimtBlockM) {
    int src = -1;
    if (tid < rows) {
      const int r = row_begin + tid;
      src = args.sorted_pairs != nullptr ? args.sorted_pairs[r] / args.top_k : r;
    }
    s_row_src[tid] = src;
  }
  __syncthreads();

  const T* a = static_cast<const T*>(args.a);
  const size_t expert_stride = static_cast<size_t>(n) * k;
  const T* w[2] = {static_cast<const T*>(args.w0) + s_tile.expert * expert_stride,
                   kGated ? static_cast<const T*>(args.w1) + s_tile.expert * expert_stride : nullptr};

  float acc[kMats][2][2] = {};
  for (int k0 = 0; k0 < k; k0 += kSimtBlockK) {
#pragma unroll
    for (int it = 0; it < kSimtBlockM * kSimtBlockK / kSimtThreads; ++it) {
      const int e = tid + it * kSimtThreads;
      const int row = e / kSimtBlockK;
      const int kk = e % kSimtBlockK;
      const int src = s_row_src[row];
      s_a[kk][row] = (src >= 0 && k0 + kk < k) ? to_float<T>(a[static_cast<size_t>(src) * k + k0 + kk]) : 0.0f;
    }
#pragma unroll
    for (int m = 0; m < kMats; ++m) {
#pragma unroll
      for (int it = 0; it < kSimtBlockN * kSimtBlockK / kSimtThreads; ++it) {
        const int e = tid + it * kSimtThreads;
        const int col = e / kSimtBlockK;
        const int kk = e % kSimtBlockK;
        const bool ok = n0 + col < n && k0 + kk < k;
        s_b[m][kk][col] = ok ? to_float<T>(w[m][static_cast<size_t>(n0 + col) * k + k0 + kk]) : 0.0f;
      }
    }
    __syncthreads();
#pragma unroll 8
    for (int kk = 0; kk < kSimtBlockK; ++kk) {
      const float a0 = s_a[kk][ty];
      const float a1 = s_a[kk][ty + 16];
#pragma unroll
      for (int m = 0; m < kMats; ++m) {
        const float b0 = s_b[m][kk][tx];
        const float b1 = s_b[m][kk][tx + 16];
        acc[m][0][0] = fmaf(a0, b0, acc[m][0][0]);
        acc[m][0][1] = fmaf(a0, b1, acc[m][0][1]);
        acc[m][1][0] = fmaf(a1, b0, acc[m][1][0]);
        acc[m][1][1] = fmaf(a1, b1, acc[m][1][1]);
      }
    }
    __syncthreads();
  }

  T* out = static_cast<T*>(args.out);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = ty + 16 * i;
    if (row >= rows) continue;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int col = n0 + tx + 16 * j;
      if (col >= n) continue;
      float v;
      if (kMode == Mode::gated) {
        v = gated_act(acc[0][i][j], acc[kMats - 1][i][j], args);
      } else if (kMode == Mode::relu2) {
        v = act::relu2(acc[0][i][j]);
      } else {
        v = acc[0][i][j];
      }
      out[static_cast<size_t>(row_begin + row) * n + col] = from_float<T>(v);
    }
  }
}

}  // namespace latentmoe::cuda::gg

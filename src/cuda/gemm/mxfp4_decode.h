// MXFP4 routed experts at decode (latentmoe/mxfp4.h: E2M1 codes two a byte, one E8M0 scale per 32
// columns), on CUDA cores: every touched expert's packed weights are read straight from the layout the
// checkpoint ships (no repack, no dequantised copy) and decoded in registers, 32 values (one scale
// group, 16 bytes) per lane and step:
//
//   mxfp4_routed_gate_up  act[p, i] = act(z_t · Wg_e[i], z_t · Wu_e[i])  (relu2: (z_t · Wu_e[i])² for u > 0)
//   mxfp4_routed_down     out[t, r] = sum over j of w_tj · (act[t k + j] · Wd_e[r]), e = ids[t, j] < E
//
// Numerics: a group's 32 products E2M1 · z summed in fp32, times the group's power of two (exact),
// added in fp32 in group order; the routed combine summed in fp32 in j order and rounded once. The
// first design of issue 16, a baseline to measure the tensor-core kernels against; up to
// kMxfp4DecodeMaxRows tokens. Host interface; includable from C++.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/backend.h"
#include "latentmoe/dtype.h"

namespace latentmoe::cuda {

inline constexpr int kMxfp4DecodeMaxRows = 8;
// Up to how many tokens the layer runs MXFP4 experts (bf16/f16 activations) on these kernels (in batches of
// kMxfp4DecodeMaxRows above 8, where the setting raises it); the grouped GEMMs above (their rows kernel,
// grouped_gemm.h). Measured on an H100 (docs/MXFP4.md, da0f97a, kimi-k3 tp-shard 8, routed experts in the
// layer): at 16 tokens two batches took 325 µs against 299 for the rows kernel, at 8 one batch 162 against 184.
inline constexpr int kMxfp4DecodeTokens = 8;

// Stacked MXFP4 matrices [E, rows, cols]: packed [E, rows, cols/2] and scales [E, rows, cols/32]
// (U8, contiguous). cols is a multiple of 32.
struct Mxfp4Matrices {
  const uint8_t* packed = nullptr;
  const uint8_t* scales = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
};

// One gate/up call: act [tokens * top_k, I] (dtype bf16/f16/f32): row p = t * top_k + j for every
// pair whose expert ids[p] lies in [0, num_experts) (other rows are not written). z [tokens, l]
// (dtype), row stride ld_z. gate.packed == nullptr: relu2. I = up.rows, l = up.cols. Passed to the
// kernels as it is.
struct Mxfp4GateUpCall {
  DType dtype = DType::bf16;
  ::latentmoe::detail::ActivationParams activation;
  const int32_t* ids = nullptr;  // [tokens, top_k]
  int tokens = 0, top_k = 0, num_experts = 0;
  const void* z = nullptr;
  int64_t ld_z = 0;
  Mxfp4Matrices gate, up;
  void* act = nullptr;
  // The tensor-core kernel's warps per 16-row tile along K (mxfp4_decode_mma.cu): 1, 2 or 8; 0 (the
  // default): its measured rule (choose_gate_up_split). The CUDA-core kernel ignores it.
  int warps_per_tile = 0;
};
void mxfp4_routed_gate_up(const Mxfp4GateUpCall& call, cudaStream_t stream);

// One down call: out [tokens, l] (dtype, row stride ld_out): every row written (0 for a token with no
// real expert). act [tokens * top_k, I] as mxfp4_routed_gate_up left it; weights [tokens, top_k] f32.
// l = down.rows, I = down.cols. Passed to the kernels as it is.
struct Mxfp4DownCall {
  DType dtype = DType::bf16;
  const int32_t* ids = nullptr;
  const float* weights = nullptr;
  int tokens = 0, top_k = 0, num_experts = 0;
  const void* act = nullptr;
  Mxfp4Matrices down;
  void* out = nullptr;
  int64_t ld_out = 0;
};
// Ordering: call it on the stream right after mxfp4_routed_gate_up of the same call. On sm_90 the tensor-core
// kernel is launched as a programmatic dependent of the kernel before it: it reads ids, weights and its weights
// while that kernel finishes and waits for it before reading act or writing out (mxfp4_decode_mma.cu). So
// nothing enqueued between the two calls may write ids or weights.
void mxfp4_routed_down(const Mxfp4DownCall& call, cudaStream_t stream);

}  // namespace latentmoe::cuda

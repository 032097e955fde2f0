// Skinny GEMMs: up to kSkinnyMaxRows rows (decode) against weight matrices that are read once, at
// the memory bandwidth, with the work split evenly over the GPU. Two kernels serve every few-row
// projection of the layer (docs/SKINNY_GEMM.md):
//
//   skinny_gate_up   act[row] = act(x_t · Wg_e^T, x_t · Wu_e^T)   (or relu(x_t · Wu_e^T)^2)
//   skinny_down      out[t]  (+)= sum over the matrices e that row t uses of coef · (a_row · W_e^T)
//
// Either runs *dense* (one matrix, every row, coefficient 1: `linear`, the shared expert) or *routed*
// (the rows are tokens, topk_ids names each token's experts): the routed pair skinny_gate_up +
// skinny_down is the whole routed-expert computation of a decode step, the weighted combine over the
// top-k included, with no layout kernel and no per-pair output rows. Each CTA finds the distinct
// experts of the batch itself from topk_ids (at most kSkinnyMaxRows * top_k pairs), so every touched
// expert's weights are read once even when several tokens share it.
//
// Numerics: bf16/f16 operands on the tensor cores (mma.sync m16n8k16), fp32 accumulation, the
// activation applied to the fp32 accumulators, one rounding per stored value; the routed combine is
// summed in fp32 and rounded once (the y of each expert is never rounded).
// No allocation, no host synchronisation: capturable in a CUDA graph.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <initializer_list>

#include "core/backend.h"
#include "cuda/comm/lamport.h"
#include "latentmoe/dtype.h"

namespace latentmoe::cuda {

// The most rows (tokens) one skinny call takes: the N of one tensor-core MMA.
inline constexpr int kSkinnyMaxRows = 8;
// The largest top_k of a routed skinny call.
inline constexpr int kSkinnyMaxTopK = 32;

// Which weight matrix each row uses.
//   dense  (topk_ids == nullptr): matrix 0 for every row; input row t gives output row t.
//   routed: row t is a token; pair p = t * top_k + j uses matrix topk_ids[p] when it lies in
//           [0, num_experts) and is skipped otherwise (zero experts). A token that names one expert
//           twice uses it with the summed weight.
struct SkinnyRouting {
  const int32_t* topk_ids = nullptr;    // [rows, top_k] i32, or nullptr (dense)
  const float* topk_weights = nullptr;  // [rows, top_k] f32: the combine coefficients (skinny_down)
  int top_k = 1;
  int num_experts = 1;
};

// Stacked row-major weight matrices [E, n, k] (E = 1 dense) of the operands' dtype.
struct SkinnyWeights {
  const void* gate = nullptr;  // skinny_gate_up only; nullptr: relu2 of the up projection
  const void* w = nullptr;     // up (skinny_gate_up) or the projected matrix (skinny_down)
  int64_t n = 0;               // rows of each matrix: the output columns
  int64_t k = 0;               // the reduction length
  int64_t ld = 0;              // elements between consecutive rows of one matrix (>= k)
  int64_t expert_stride = 0;   // elements between consecutive matrices (routed)
};

// How a skinny call is spread over the GPU (skinny_gemm.cu, "Schedule"); 0 lets the launcher choose.
// Tests force other shapes to reach every path; results agree within rounding, and one shape gives
// the same bits on every run.
struct SkinnyShape {
  int warps = 0;     // warps per CTA, 1..16
  int split = 0;     // CTAs of a cluster that share each unit's reduction: 1, 2, 4 or 8 (> 1: sm_90+)
  int clusters = 0;  // clusters in the grid; each takes every clusters-th unit
};

// A row-major operand or result: element (r, c) at data[r * ld + c].
struct SkinnyRows {
  const void* data = nullptr;
  int64_t ld = 0;
};

// act (dtype): dense act[t, :] for t < rows; routed act[p, :] for every pair p = t * top_k + j whose
// expert is real and not named earlier by token t (other rows are not written).
// x [rows, k]. The activation is ActivationParams' (silu, situ or, with gate == nullptr, relu2).
void skinny_gate_up(DType dtype, const ::latentmoe::detail::ActivationParams& activation, const SkinnyRouting& routing,
                    const SkinnyRows& x, int64_t rows, const SkinnyWeights& weights, void* act, int64_t ld_act,
                    cudaStream_t stream, const SkinnyShape& shape = {});

// out [rows, n] (dtype) = (accumulate ? out : 0) + dense: a[t] · W^T; routed: the sum over the real
// experts e of token t of weight · (a[p] · W_e^T), p = the pair by which token t first names e, and
// weight the sum of the weights of its pairs naming e. Every row t < rows is written (0 for a token
// with no real expert). a: dense [rows, k], routed [rows * top_k, k] (the act of skinny_gate_up).
// Ordering: launched as a programmatic dependent (src/cuda/common/pdl.cuh); a routed call reads topk_ids and
// topk_weights and streams its first weights before it waits, so it must follow the skinny_gate_up
// of the same routing directly on the stream (routed_experts does).
// push_to (dense calls only): row t's results are not stored into `out` (still read when
// `accumulate`) but pushed, as this rank's [rows, n] block of an all-gather over the GPU group whose
// peers these are, into every rank's receive region of the rank's next call (lamport_device.cuh); a
// LamportCall with presend must follow on the stream to receive it.
void skinny_down(DType dtype, const SkinnyRouting& routing, const SkinnyRows& a, int64_t rows,
                 const SkinnyWeights& weights, void* out, int64_t ld_out, bool accumulate, cudaStream_t stream,
                 const SkinnyShape& shape = {}, const LamportPeers* push_to = nullptr);

// True when the skinny kernels take these operands: bf16 or f16, 1..kSkinnyMaxRows rows, k a multiple
// of 8, and every row of each given operand 16-byte aligned (data and ld). Null operands are ignored.
bool skinny_supported(DType dtype, int64_t rows, int64_t k, std::initializer_list<SkinnyRows> operands);

}  // namespace latentmoe::cuda

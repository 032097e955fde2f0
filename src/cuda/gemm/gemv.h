// The decode GEMV: a dense linear of 1..kGemvMaxRows rows that streams its weight matrix once, at the
// read bandwidth, and starts streaming before the kernel before it on the stream has finished.
//
// CudaBackend::linear takes it at one row by default (set_gemv_max_tokens): on an H100 its warp-rows
// kernel reads Kimi-K3's 51 MB W_down in 21.2 µs against cuBLAS's 23.4 and W_up in 22.0 against 22.4
// (bench/results/gemv_bench_h100_172fc2b.json), and the one-token layer graph is 3-5% faster with it
// (layer_ab_h100_session28.json); at 2-4 rows it made the layer slower. It is also what the decode tails
// want: their up-projection follows a collective that leaves the memory idle, and a weight stream that
// starts before the collective ends is what pays there. Two variants of the same kernel serve the rest
// of a decode step's dense work: gemv_gate_up (the shared expert's gate/up with its activation, then
// gemv for its down projection: CudaBackend::dense_mlp) and gemv_rms_norm (the one-rank tail's norm
// folded into W_up: CudaBackend::rms_norm_linear).
//
//   y[r, :] = x[r, :] · W^T  (+ y[r, :] when accumulate)   for r < rows
//
// W [n, k] row-major (row stride ldw), x [rows, k] (ldx), y [rows, n] (ldy); x, W and y of one dtype,
// bf16 or f16. Numerics: products and sums in fp32, one rounding of each stored value; with accumulate
// the fp32 sum of the old y and the product is rounded once (what cuBLASLt gives with beta = 1).
// Deterministic: one launch shape (the default one on a given GPU) gives the same bits on every run.
//
// Programmatic dependent launch (src/cuda/common/pdl.cuh): every thread issues its first weight loads before
// it waits for the previous kernel; x and y are read, and y written, only after the wait. So the
// weights must not be written by the kernel just before this one (weights never are), and y must not
// overlap x or W.
//
// No allocation, no host synchronisation: capturable in a CUDA graph. docs/CUDA_BACKEND.md, "Decode
// GEMV", has the design; the kernel's comment in gemv.cu has the protocol.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "core/backend.h"
#include "latentmoe/dtype.h"

namespace latentmoe::cuda {

// The most rows (tokens) one call takes.
inline constexpr int kGemvMaxRows = 4;
// The longest reduction: x (rows x k elements of the storage dtype, 128 KiB at most) is staged in
// each CTA's shared memory.
inline constexpr int64_t kGemvMaxK = 16384;

// Which kernel runs rows of k >= 256 (gemv.cu; rows shorter than that always take the short-row kernel).
//   ring       each warp streams a contiguous range of W through a cp.async ring in shared memory; rows
//              split between warps and CTAs (clusters) are summed from partials. The shape below applies.
//   warp_rows  a warp (or a team of warps of one CTA, where rows are few) per row, the rows dealt
//              round-robin over the grid's teams, two batches of loads in flight per lane in registers;
//              the order of every sum is fixed by k and the team, so every grid gives the same bits.
//              Only GemvShape::warps (per CTA), clusters (the CTA count) and team apply.
//   automatic  warp_rows.
enum class GemvKernel { automatic, ring, warp_rows };

// How a call is spread over the GPU; 0 lets the launcher choose (gemv.cu, "Work split"). Tests force
// other shapes to reach every path; shapes agree within rounding, and one shape gives the same bits
// on every run.
struct GemvShape {
  int warps = 0;     // warps per CTA, 1..16
  int split = 0;     // CTAs per cluster that share whole rows: 1, or 2, 4, 8 on sm_90 and later (ring)
  int clusters = 0;  // clusters in the grid (warp_rows: CTAs)
  GemvKernel kernel = GemvKernel::automatic;
  int team = 0;  // warp_rows: warps per row, a power of two up to 16 dividing `warps`
  // warp_rows: at most this many CTAs per SM (0: as many as the kernel is compiled for, two at one x
  // row). One leaves half of every SM to a kernel that runs beside the GEMV (the shared expert's beside
  // the routed experts).
  int ctas_per_sm = 0;
};

// True when gemv() takes these operands: bf16 or f16, 1..kGemvMaxRows rows, n >= 1, k a multiple of 8
// in 8..kGemvMaxK, and every row of x and W 16-byte aligned (data pointer and row stride), on a GPU
// of compute capability 8.0 or later. Otherwise the caller keeps cuBLASLt.
bool gemv_supported(DType dtype, int64_t rows, int64_t n, int64_t k, const void* x, int64_t ldx, const void* w,
                    int64_t ldw);

// y (+)= x · W^T as above, enqueued on `stream`. Throws latentmoe::Error naming the problem when
// gemv_supported() is false (which rule failed), when a stride is shorter than its row, or for an
// impossible shape. Nothing is launched then.
void gemv(DType dtype, const void* x, int64_t ldx, int64_t rows, const void* w, int64_t ldw, int64_t n, int64_t k,
          void* y, int64_t ldy, bool accumulate, cudaStream_t stream, const GemvShape& shape = {});

// The gate/up half of a dense MLP at decode (the shared expert), both matrices read once in one launch:
//   y[r, :] = act(x[r, :] · Wg^T, x[r, :] · Wu^T)   silu, situ (gated)
//   y[r, :] = relu2(x[r, :] · Wu^T)                 relu2 (gate null)
// Wg and Wu [n, k] with one row stride ldw; the operand rules and numerics of gemv(), the activation
// applied to the fp32 sums (the fast forms of activation.cuh, as the skinny kernels) and rounded once.
// Always the warp-rows kernel (a ring or split shape is refused). Throws latentmoe::Error naming the
// problem when gemv_gate_up_supported() is false; nothing is launched then.
bool gemv_gate_up_supported(DType dtype, Activation activation, int64_t rows, int64_t n, int64_t k, const void* x,
                            int64_t ldx, const void* gate, const void* up, int64_t ldw);
void gemv_gate_up(DType dtype, const ::latentmoe::detail::ActivationParams& activation, const void* x, int64_t ldx,
                  int64_t rows, const void* gate, const void* up, int64_t ldw, int64_t n, int64_t k, void* y,
                  int64_t ldy, cudaStream_t stream, const GemvShape& shape = {});

// The RMSNorm of x folded into the GEMV (the one-rank tail's norm(L) W_up^T at decode):
//   y[r, :] = RMSNorm(x[r, :]) · W^T  (+ y[r, :] when accumulate),
//   RMSNorm(x) = x / sqrt(mean(x²) + eps) · gamma, gamma [k] of f32, bf16 or f16 (contiguous).
// Each CTA normalises its copy of x in shared memory as the RMSNorm kernel (kernels/norm.h) computes each
// value, rounded once to the dtype, so the normalised x never goes to global memory and the norm costs
// no launch; the sum of squares is added in another order than the kernel's, so results agree with
// rms_norm() then gemv() within rounding, and one launch shape gives the same bits on every run (every
// grid of one team). The operand rules of gemv(); always the warp-rows kernel (a ring or split shape is
// refused).
bool gemv_rms_norm_supported(DType dtype, int64_t rows, int64_t n, int64_t k, const void* x, int64_t ldx,
                             const void* gamma, DType gamma_dtype, const void* w, int64_t ldw);
void gemv_rms_norm(DType dtype, const void* x, int64_t ldx, int64_t rows, const void* gamma, DType gamma_dtype,
                   float eps, const void* w, int64_t ldw, int64_t n, int64_t k, void* y, int64_t ldy, bool accumulate,
                   cudaStream_t stream, const GemvShape& shape = {});

// The warp-rows kernel's launch (gemv.cu has the rule), a pure function of the problem (gate_up: each
// row is a gate row and an up row), the GPU's SM count and the shared memory a CTA may take: what gemv()
// and gemv_gate_up() launch, exposed so that tests check the rule without a GPU.
struct GemvWarpRowsLaunch {
  int warps = 0;            // per CTA
  int ctas = 0;             // in the grid
  int team = 1;             // warps per row
  int segment = 0;          // vectors of a row per member of a team (a multiple of 32)
  size_t shared_bytes = 0;  // per CTA: x, and with a team the members' partial sums
};
GemvWarpRowsLaunch gemv_warp_rows_launch(int64_t rows, int64_t n, int64_t k, bool gate_up, int64_t sms,
                                         size_t shared_optin, const GemvShape& shape);

}  // namespace latentmoe::cuda

// The grouped expert GEMMs of the routed experts: one launch computes every touched expert's
// gate/up projection with the activation fused, one launch its down projection. Rows are grouped by
// expert as the MoeLayout says (src/cuda/kernels/moe_layout.h); how many rows each expert has is known only on
// the device, so every kernel finds its tile from expert_offsets on the device (no host sync, no
// allocation, CUDA-graph capturable). docs/GROUPED_GEMM.md says how the engine was chosen.
//
// Engines, dispatched on the device's compute capability at run time:
//   sm_80+ (bf16, f16): tensor-core kernels (mma.sync m16n8k16, fp32 accumulators, cp.async multi-stage
//                       pipeline, swizzled shared memory). The tile shape is picked from the host-known
//                       row bound (T) by a table measured on an H200 (grouped_gemm.cu).
//   any GPU, f32, or shapes whose l or I_r is not a multiple of 8: a SIMT kernel in true fp32 (no TF32).
// Any I_r and l are accepted: partial tiles are guarded inside, the caller never pads.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/backend.h"
#include "cuda/kernels/moe_layout.h"
#include "latentmoe/dtype.h"

namespace latentmoe::cuda {

// One rank's stacked routed-expert weights, row-major, in the compute dtype.
struct ExpertGemmWeights {
  const void* gate = nullptr;  // [E, I_r, l]; nullptr for relu2 (non-gated)
  const void* up = nullptr;    // [E, I_r, l]
  const void* down = nullptr;  // [E, l, I_r]
  int64_t intermediate = 0;    // I_r
  int64_t latent = 0;          // l
  int num_experts = 0;         // E (must equal layout.num_experts)
  // MXFP4 experts (latentmoe/mxfp4.h): gate, up and down hold the packed E2M1 codes ([E, I_r, l/2] and
  // [E, l, I_r/2], U8) and these their E8M0 scales ([E, I_r, l/32], [E, l, I_r/32]); null: the
  // weights are in the compute dtype. Only where grouped_mxfp4_supported() holds.
  const uint8_t* gate_scales = nullptr;
  const uint8_t* up_scales = nullptr;
  const uint8_t* down_scales = nullptr;
  bool mxfp4() const { return up_scales != nullptr; }
};

// Whether the grouped GEMMs take MXFP4 experts of this shape here: bf16 or f16 activations, a GPU of
// compute capability 8.0 or later, l and I_r multiples of 32. The tensor-core kernels then decode the
// codes into each shared-memory stage (grouped_gemm_mma.cuh, grouped_gemm_wgmma.cuh); the weights are
// never dequantised in memory.
bool grouped_mxfp4_supported(DType dtype, int64_t intermediate, int64_t latent);

// act_rows [T*k, I_r]: for grouped row i of expert e (expert_offsets[e] <= i < expert_offsets[e+1]),
// a[i] = act(u·Wg_e^T, u·Wu_e^T) with u = z[sorted_pairs[i] / top_k] (z [T, l]); fp32 accumulation, the
// activation applied to the fp32 accumulators, stored rounded to dtype. relu2: a = relu(u·Wu_e^T)^2.
// Rows past expert_offsets[E] are not written.
void grouped_gate_up(DType dtype, const latentmoe::detail::ActivationParams& act, const void* z,
                     const MoeLayout& layout, const ExpertGemmWeights& w, void* act_rows, void* workspace,
                     size_t workspace_bytes, cudaStream_t stream);

// y_rows [T*k, l]: y[i] = a[i]·Wd_e^T, fp32 accumulation, stored in dtype. Rows past expert_offsets[E]
// are not written.
// Ordering: call it on the stream right after grouped_gate_up of the same layout. On sm_90 it is
// launched as a programmatic dependent of the kernel before it: it reads expert_offsets and streams
// its weights while that kernel finishes, and waits for it before reading act_rows or writing y_rows.
// So nothing enqueued between the two calls may write the layout or the weights.
void grouped_down(DType dtype, const void* act_rows, const MoeLayout& layout, const ExpertGemmWeights& w, void* y_rows,
                  void* workspace, size_t workspace_bytes, cudaStream_t stream);

// Workspace of the split-K reduction (tile counters and fp32 partial sums), which the tensor-core
// kernels use when a problem has too few output tiles to fill the GPU (decode-sized batches). The
// same size for every shape. It must be zero-filled once before its first use (cudaMemset); every
// launch leaves it zeroed again. One workspace serves one stream: grouped_gate_up and grouped_down
// of the same stream may share it. With workspace == nullptr the kernels run without split-K.
size_t grouped_gemm_workspace_bytes(int64_t max_tokens, int top_k, int num_experts);

// --- For the benchmark and the tests: run one named kernel variant instead of the automatic choice.
namespace detail {

enum class GemmVariant {
  automatic,      // the table in grouped_gemm.cu
  simt,           // fp32 SIMT (every dtype; the only engine for f32)
  mma_s,          // mma.sync, 16-row tiles, 4 warps, 64 weight rows: small row counts (decode)
  mma_s_wide,     // mma.sync, 16-row tiles, 4 warps, 128 weight rows
  mma_s_k128,     // mma.sync, 16-row tiles, 4 warps, 64 weight rows, 128-deep k-tiles
  mma_m32,        // mma.sync, 32-row tiles, 8 warps, 5 stages
  mma_m,          // mma.sync, 64-row tiles, 8 warps
  mma_l4,         // mma.sync, 96-row tiles, 8 warps, 4 stages, 2 CTAs per SM
  mma_l,          // mma.sync, 128-row tiles, 8 warps, 3 stages, 2 CTAs per SM
  mma_xl,         // mma.sync, 128-row tiles, twice the columns, 1 CTA per SM (most reuse per byte)
  wgmma,          // sm_90a only: warpgroup MMA, weight rows as the MMA's M, the expert's rows as its N (<= 96)
  wgmma_tall,     // sm_90a only: the same with tiles of up to 256 expert rows against 128 weight rows
  wgmma_narrow,   // sm_90a only: tiles of up to 96 expert rows against 128 weight rows, two CTAs per SM
  wgmma_ws,       // sm_90a only: persistent and warp-specialised (a TMA/cp.async producer warpgroup, two wgmma
                  // consumer warpgroups, an mbarrier ring), tiles of up to 160 expert rows against 256 weight rows;
                  // GemmChoice::n_tiles_per_cta > 0 asks for at least that many tiles per CTA (a smaller grid)
  wgmma_ws_tall,  // sm_90a only: wgmma_ws with tiles of up to 256 expert rows against 128 weight rows (an expert of
                  // up to 256 rows reads its weights once; n-tiles of 128 weight rows)
  mxfp4_rows,     // MXFP4 weights only (bf16, f16): codes decoded straight into mma.sync fragments, a cp.async
                  // ring per CTA, each expert's weights read once per 16 of its rows (grouped_gemm_mxfp4_rows.cu);
                  // GemmChoice::n_tiles_per_cta: 0 or 1 (one 64-row block a CTA, 4 warps; a ring of 4 stages,
                  // 3 CTAs per SM); GemmChoice::option: the L2 prefetch size of its copies (0 the default,
                  // 1 none, 2 128 bytes for codes, 3 256 bytes for codes, 4 128 bytes for codes and scales)
};
// True for the variants that take MXFP4 weights only (mxfp4_rows).
bool is_mxfp4_only(GemmVariant variant);
// True for the variants that run the wgmma kernel (sm_90a only).
bool is_wgmma(GemmVariant variant);

// A variant, how many n-tiles one CTA computes (0: chosen from the shape) and how many CTAs split the
// reduction of one output tile (0: chosen from the shape; 1: no split-K; more needs a workspace large
// enough, else the call throws). Split-K runs one n-tile per CTA. `option`: a variant's own switch, 0 its
// default; wgmma_ws and wgmma_ws_tall, bits for comparison: 1 stores the outputs from registers (4 bytes a thread)
// instead of through shared memory (16 bytes a thread), 2 copies contiguous rows (the down projection's) by
// cp.async instead of TMA, 4 keeps the weights at normal L2 priority (not evict-first), 8 loads them without the
// 256-byte L2 promotion (both the default where K <= 512), 16 the weights' L2 handling before session 20 whatever K
// (not with 4 or 8); mxfp4_rows: the L2 prefetch size (above).
struct GemmChoice {
  GemmChoice(GemmVariant v = GemmVariant::automatic, int tiles_per_cta = 0, int splits = 0, int opt = 0)
      : variant(v), n_tiles_per_cta(tiles_per_cta), k_splits(splits), option(opt) {}
  GemmVariant variant;
  int n_tiles_per_cta;
  int k_splits;
  int option;
};

std::string to_string(GemmVariant variant);
std::vector<GemmVariant> all_variants();
// True when the current device can run the wgmma variants (is_wgmma): compute capability 9.0 and a
// binary that carries sm_90a code.
bool wgmma_available();
// Splits of the reduction for `ctas` output tiles of num_k_tiles k-tiles each, when `resident` CTAs fit
// on the GPU at once: 1 when the tiles fill at least half of it, else as many as fit in one wave
// (each split keeping at least 4 k-tiles).
int choose_k_splits(int64_t ctas, int num_k_tiles, int64_t resident);
// How wgmma_ws and wgmma_ws_tall load their bf16/f16 weights into the L2 for a reduction of length k and a
// GemmChoice::option: at normal priority (else evict-first, except an expert split over several row tiles) and with
// the 256-byte promotion. By default a short reduction (k <= kWsShortReductionK: the down projections at tp-shard 8)
// takes normal priority without the promotion and a longer one evict-first with it; option bits 4 (normal) and 8 (no
// promotion) force those, 16 the longer reductions' handling whatever k (the options' check refuses 16 with 4 or 8).
// Measured in docs/GROUPED_GEMM.md, "The weights' L2 handling".
inline constexpr int64_t kWsShortReductionK = 512;
struct WsWeightL2 {
  bool normal_priority;
  bool promote;
};
WsWeightL2 ws_weight_l2(int option, int64_t k);
// The variant `automatic` resolves to for this problem on the current device.
// gated: the gate/up projection of silu/situ (two weight matrices); false for relu2's and for down.
GemmVariant choose_variant(DType dtype, bool down, bool gated, int64_t num_tokens, int top_k, int num_experts,
                           int64_t intermediate, int64_t latent);
// The tile shape `automatic` takes with MXFP4 weights, by rows per touched expert: mxfp4_rows up to
// kMxfp4RowsMaxMeanRows; above, on Hopper, the persistent tall tiles (wgmma_ws_tall) above
// kMxfp4WsTallMinMeanRows and wgmma_narrow below where at least 384 output columns; else mma_m up to 48 and
// mma_l4 above.
// 18: Kimi-K3 at 1024 tokens (18 rows per expert) took the rows kernel 1.21x faster than wgmma_narrow (H100,
// 2b0f8f2, kimi-k3 tp-shard 8 gate/up + down 1731 against 2098 µs; at 512 tokens 1047 against 2000;
// bench/results/issue31_h100_2b0f8f2.json); at 2048 tokens (36 rows) wgmma_narrow was 1.33x faster (H100, a1e373f,
// 2243 against 2987 µs, issue31_h100_a1e373f.json); 19-35 rows are not measured.
inline constexpr int64_t kMxfp4RowsMaxMeanRows = 18;
// 96: on an H100 (session 25, grouped_gemm_bench --weights mxfp4, gate/up + down µs,
// bench/results/issue32_h100_s25.json) wgmma_ws_tall against wgmma_narrow: Kimi-K3 tp-shard 8 at 109 and 146 rows
// (6144, 8192 tokens) 4237 against 4626-4649 and 4551-4611 against 5093-5216; tp-shard 1 at 146 rows 33338 against
// 38605; Nemotron3-super tp-shard 1 at 132, 176 and 352 rows (3072, 4096, 8192 tokens) 3041-3062 against 3669,
// 3315-3431 against 4103-4117 and 6632 against 7806; but at 88 rows (Nemotron, 2048 tokens) 2761 against 2303 and at 73
// (Kimi-K3, 4096) 3864 against 2666. The bound lies between 88 and 109 (not measured inside): 96, where the 96-row
// tiles of wgmma_narrow start to split an expert and read its weights twice, and the tall tiles' 256 rows are 38% full.
inline constexpr int64_t kMxfp4WsTallMinMeanRows = 96;
GemmVariant choose_mxfp4_variant(DType dtype, bool down, bool gated, int64_t num_tokens, int top_k, int num_experts,
                                 int64_t intermediate, int64_t latent);

void grouped_gate_up_variant(GemmChoice choice, DType dtype, const latentmoe::detail::ActivationParams& act,
                             const void* z, const MoeLayout& layout, const ExpertGemmWeights& w, void* act_rows,
                             void* workspace, size_t workspace_bytes, cudaStream_t stream);
void grouped_down_variant(GemmChoice choice, DType dtype, const void* act_rows, const MoeLayout& layout,
                          const ExpertGemmWeights& w, void* y_rows, void* workspace, size_t workspace_bytes,
                          cudaStream_t stream);

}  // namespace detail
}  // namespace latentmoe::cuda

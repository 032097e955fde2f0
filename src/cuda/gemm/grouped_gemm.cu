// The grouped expert GEMMs' entry points: argument checks, the choice of engine and tile variant,
// and the launch. No host synchronisation and no allocation: safe inside CUDA-graph capture.
#include <algorithm>
#include <array>
#include <atomic>

#include "cuda/common/device.h"
#include "cuda/gemm/grouped_gemm.h"
#include "cuda/gemm/grouped_gemm_launch.cuh"
#include "cuda/gemm/grouped_gemm_wgmma_launch.cuh"
#include "latentmoe/error.h"

namespace latentmoe::cuda {
namespace gg {

void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  LATENTMOE_CHECK(err == cudaSuccess, what, ": launch failed: ", cudaGetErrorString(err));
}

void attach_split_k(MmaLaunch& launch, void* workspace, size_t workspace_bytes, int64_t counters, size_t partial_bytes,
                    const char* what) {
  if (workspace == nullptr) return;
  const size_t needed = static_cast<size_t>(counters) * sizeof(int) + partial_bytes;
  LATENTMOE_CHECK(workspace_bytes >= needed, what, ": a workspace of ", workspace_bytes, " bytes is smaller than the ",
                  needed, " its split-K needs");
  LATENTMOE_CHECK((reinterpret_cast<uintptr_t>(workspace) & 15) == 0, what, ": the workspace is not 16-byte aligned");
  launch.tile_counters = static_cast<int*>(workspace);
  launch.num_tile_counters = counters;
  launch.partials = reinterpret_cast<float*>(static_cast<char*>(workspace) + counters * sizeof(int));
  launch.partial_floats = partial_bytes / sizeof(float);
}

namespace {

int current_device() {
  int device = 0;
  const cudaError_t err = cudaGetDevice(&device);
  LATENTMOE_CHECK(err == cudaSuccess, "grouped GEMM: cudaGetDevice failed: ", cudaGetErrorString(err));
  return device;
}

}  // namespace

void ensure_smem_limit(const void* kernel, int bytes, std::atomic<uint64_t>* done_mask) {
  const int device = current_device();
  const uint64_t bit = device < 64 ? (uint64_t{1} << device) : 0;
  if (bit != 0 && (done_mask->load(std::memory_order_acquire) & bit) != 0) return;
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  LATENTMOE_CHECK(err == cudaSuccess, "grouped GEMM: cannot give a kernel ", bytes,
                  " bytes of shared memory: ", cudaGetErrorString(err));
  done_mask->fetch_or(bit, std::memory_order_acq_rel);
}

int choose_tiles_per_cta(int n_tiles, int num_k_tiles, int stages, int block_m, const MmaLaunch& launch,
                         int num_experts) {
  // Expected m-tiles: touched experts (at most T*k) times the m-tiles of an average expert.
  const int64_t touched = std::max<int64_t>(1, std::min<int64_t>(num_experts, launch.max_rows));
  const int64_t mean_rows = (launch.max_rows + touched - 1) / touched;
  const int64_t entries = touched * ((mean_rows + block_m - 1) / block_m);
  // Two n-tiles per CTA paid off for the down projection at every size measured (one pipeline across
  // the n-tile boundary, half the tile look-ups), as long as every SM still gets a CTA; a short k
  // (fewer steps than twice the pipeline) asks for the same.
  if (!launch.prefer_two_tiles && num_k_tiles >= 2 * stages) return 1;
  if (n_tiles < 2 || entries * ((n_tiles + 1) / 2) < launch.sm_count) return 1;
  return 2;
}

}  // namespace gg

namespace detail {

int choose_k_splits(int64_t ctas, int num_k_tiles, int64_t resident) {
  // The kernels are bound by streaming weights, and every CTA pays a fixed start (tile look-up, the
  // first DRAM round trip) before it streams. So: no split while the tiles alone give most SMs a CTA;
  // else as many splits as keep all CTAs in one wave (more bytes in flight, no second wave), each
  // split keeping at least kMinKTiles k-tiles so that its copy pipeline fills before it drains.
  constexpr int kMinKTiles = 4;
  if (ctas <= 0 || resident <= 0 || 2 * ctas > resident) return 1;
  const int64_t max_splits = std::max(1, num_k_tiles / kMinKTiles);
  return static_cast<int>(std::clamp<int64_t>(resident / ctas, 1, max_splits));
}

std::string to_string(GemmVariant variant) {
  switch (variant) {
    case GemmVariant::automatic:
      return "automatic";
    case GemmVariant::simt:
      return "simt";
    case GemmVariant::mma_s:
      return "mma_s";
    case GemmVariant::mma_s_wide:
      return "mma_s_wide";
    case GemmVariant::mma_s_k128:
      return "mma_s_k128";
    case GemmVariant::mma_m32:
      return "mma_m32";
    case GemmVariant::mma_m:
      return "mma_m";
    case GemmVariant::mma_l4:
      return "mma_l4";
    case GemmVariant::mma_l:
      return "mma_l";
    case GemmVariant::mma_xl:
      return "mma_xl";
    case GemmVariant::wgmma:
      return "wgmma";
    case GemmVariant::wgmma_tall:
      return "wgmma_tall";
    case GemmVariant::wgmma_narrow:
      return "wgmma_narrow";
    case GemmVariant::wgmma_ws:
      return "wgmma_ws";
    case GemmVariant::wgmma_ws_tall:
      return "wgmma_ws_tall";
    case GemmVariant::mxfp4_rows:
      return "mxfp4_rows";
  }
  return "unknown";
}

std::vector<GemmVariant> all_variants() {
  return {GemmVariant::simt,     GemmVariant::mma_s,         GemmVariant::mma_s_wide, GemmVariant::mma_s_k128,
          GemmVariant::mma_m32,  GemmVariant::mma_m,         GemmVariant::mma_l4,     GemmVariant::mma_l,
          GemmVariant::mma_xl,   GemmVariant::wgmma,         GemmVariant::wgmma_tall, GemmVariant::wgmma_narrow,
          GemmVariant::wgmma_ws, GemmVariant::wgmma_ws_tall, GemmVariant::mxfp4_rows};
}

bool is_mxfp4_only(GemmVariant variant) { return variant == GemmVariant::mxfp4_rows; }

bool is_wgmma(GemmVariant variant) {
  return variant == GemmVariant::wgmma || variant == GemmVariant::wgmma_tall || variant == GemmVariant::wgmma_narrow ||
         variant == GemmVariant::wgmma_ws || variant == GemmVariant::wgmma_ws_tall;
}

namespace {

// The experts T tokens touch at most (min(E, T*k), at least 1), and their mean row count: what both
// tile-shape choices key on.
int64_t touched_experts(int64_t num_tokens, int top_k, int num_experts) {
  return std::max<int64_t>(1, std::min<int64_t>(num_experts, num_tokens * top_k));
}
int64_t mean_rows_per_touched_expert(int64_t num_tokens, int top_k, int num_experts) {
  return num_tokens * top_k / touched_experts(num_tokens, top_k, num_experts);
}
// Whether the persistent warp-specialised kernels (wgmma_ws, wgmma_ws_tall) can take the call: Hopper with sm_90a
// code, and at most kWgmmaWsMaxExperts experts (their per-expert prefix in shared memory).
bool persistent_kernels_available(int num_experts) {
  return wgmma_available() && num_experts <= gg::kWgmmaWsMaxExperts;
}

}  // namespace

GemmVariant choose_variant(DType dtype, bool down, bool gated, int64_t num_tokens, int top_k, int num_experts,
                           int64_t intermediate, int64_t latent) {
  if (dtype == DType::f32 || current_compute_capability() < 80) return GemmVariant::simt;
  if (latent % 8 != 0 || intermediate % 8 != 0) return GemmVariant::simt;
  // Measured on an H200 (docs/GROUPED_GEMM.md). Decode-sized batches: small m-tiles; deep copy
  // pipelines (mma_s_k128) while the CTAs fit in about one wave, wider tiles (mma_s_wide) when there are
  // many. Larger batches: m-tiles that cover a touched expert's mean row count.
  // An expert gets at most one row per token (top-k picks distinct experts), so T bounds its rows.
  const int64_t touched = touched_experts(num_tokens, top_k, num_experts);
  const int64_t mean_rows = mean_rows_per_touched_expert(num_tokens, top_k, num_experts);
  if (num_tokens <= 16) {
    if (down) return GemmVariant::mma_s_wide;
    const int64_t cols = gated ? 32 : 64;  // output columns of an mma_s_k128 gate/up CTA
    const int64_t ctas = touched * ((intermediate + cols - 1) / cols);
    return ctas <= 9 * current_sm_count() ? GemmVariant::mma_s_k128 : GemmVariant::mma_s_wide;
  }
  // The persistent warp-specialised kernels (Hopper; at most kWgmmaWsMaxExperts experts, more keep the kernels
  // further down). Measured on an H100 with the producer's per-tile row offsets (session 19, grouped_gemm_bench
  // alternating, bench/results/issue32_h100_s19.json; gate/up / down µs):
  // - The tall tiles (wgmma_ws_tall: 256 expert rows against 128 weight rows) for relu2's gate/up above 64 rows per
  //   expert, and for a down projection into a latent under 2048 above 32 rows (short reduction, I_r <= 1024) or 64
  //   (long). Nemotron tp-shard 8 at 88, 176 and 352 rows (2048, 4096, 8192 tokens): gate/up 158-160 against mma_l4's
  //   207-210, 220-222 against wgmma_tall's 308, 468 against wgmma_ws's 511-518; down 240, 324-325 (wgmma_ws 319),
  //   480 against wgmma_ws's 519-522. Tp-shard 1 (I_r 2688): gate/up 1128-1135 against wgmma's 1335-1355, 1500-1554
  //   against wgmma_tall's 2051-2114, level with wgmma_ws at 352 rows (3296-3426 against 3310); down 1173 against
  //   wgmma's 1322-1334, 1543-1563 against wgmma_tall's 1906-1910, 2738-2763 against wgmma_ws's 3118-3132. The short
  //   reduction's bound of 32 is session 17's (8% faster than the 96-row tiles at 44 rows, 22% slower at 11); 64: the
  //   fewest rows measured for the others are 88, and 44 (1024 tokens) was not measured.
  // - The 160-row tiles (wgmma_ws: 160 expert rows against 256 weight rows) where the 96-row tiles split an expert
  //   and read its weights once per tile (session 18, bench/results/issue32_h100_s18.json): gated gate/up above 96
  //   rows (Kimi-K3 at 8192 tokens, 146 rows: tp-shard 8 2811 against 3100-3197 µs on wgmma, tp-shard 1 21476 against
  //   26469; at 73 rows, 4096 tokens, 3-5% slower than wgmma in session 19), and a down projection with a short
  //   reduction into a latent of 2048+ above 64 rows (session 18: Kimi-K3 tp-shard 8 at 8192, 1581 against
  //   wgmma_tall's 1828; session 22, with the short reductions' weights at normal L2 priority since f4981f7, H200,
  //   bench/results/issue32_h200_s22.json: at 4096 tokens, 73 rows, 767 against wgmma's 906-907, and 905 with option
  //   16, the old L2 handling; 36 rows, 2048 tokens, not measured, so the bound stays above them). Kimi-K3 tp-shard
  //   1's down (a long reduction) keeps wgmma_tall (not measured on these kernels).
  const bool ws_ok = persistent_kernels_available(num_experts);
  if (ws_ok) {
    if (!down && !gated && mean_rows > 64) return GemmVariant::wgmma_ws_tall;
    if (down && latent < 2048 && mean_rows > (intermediate <= 1024 ? 32 : 64)) return GemmVariant::wgmma_ws_tall;
    if (!down && gated && mean_rows > 96) return GemmVariant::wgmma_ws;
    if (down && latent >= 2048 && intermediate <= 1024 && mean_rows > 64) return GemmVariant::wgmma_ws;
  }
  // Nemotron's shapes (relu2's gate/up, a down projection into a latent under 2048) from 8 rows per touched expert,
  // where the decode-sized tiles below (mma_s_wide up to 16 rows) measured 7-42% slower (session 25, H100,
  // grouped_gemm_bench, bench/results/issue32_h100_s25.json, µs): at 256 tokens (11 rows) tp-shard 8 gate/up mma_m
  // 123 against mma_s_wide's 132, down wgmma_ws 135 against 192; tp-shard 1 gate/up wgmma 965 against 1045, down 937
  // against 1098; at 512 tokens (22 rows) tp-shard 8's down wgmma_ws 140 against wgmma's 187. So a short-reduction
  // down (I_r <= 1024) takes the 160-row persistent tiles up to 32 rows (the tall ones above, the rule further up),
  // and below 16 rows the others take what they take from 16 (wgmma from 384 output columns, else mma_m). Kimi-K3's
  // shapes (gated, a latent of 3584) keep mma_s_wide below 16 rows: 0.98 of their floor at 256 tokens (4 rows).
  const int64_t out_cols = down ? latent : intermediate;
  if ((down ? latent < 2048 : !gated) && mean_rows >= 8) {
    if (ws_ok && down && intermediate <= 1024 && mean_rows <= 32) return GemmVariant::wgmma_ws;
    if (mean_rows < 16) return out_cols >= 384 && wgmma_available() ? GemmVariant::wgmma : GemmVariant::mma_m;
  }
  // Hopper, more than 96 rows per touched expert, where the persistent kernels are not taken: the tall wgmma tiles
  // (up to 256 rows, an expert's weights read once) where they measured faster than the 96-row tiles (H200, 4096
  // and 8192 tokens, bench/results/grouped_gemm_tall_aabf667.json): relu2's gate/up (Nemotron: 2-18 %) and a down
  // projection into a latent of 2048 or more (Kimi: 8-10 %). Gated gate/up (Kimi: 3-5 % slower) keeps the 96-row
  // tiles. A down projection into a narrower latent (Nemotron's 1024) with a long reduction takes them up to 256
  // rows (session 17, H100, bench/results/issue32_h100_1c0245b.json: 18% faster at 176 rows; 4% slower at 352).
  if (mean_rows > 96 && wgmma_available() && (down ? latent >= 2048 : !gated)) return GemmVariant::wgmma_tall;
  if (down && latent < 2048 && intermediate > 1024 && mean_rows > 96 && mean_rows <= 256 && wgmma_available()) {
    return GemmVariant::wgmma_tall;
  }
  // Hopper, at least 16 rows per touched expert and 384 output columns: the wgmma kernel (5-23 % faster
  // than mma.sync at 1024 and 4096 tokens; at 336 columns, Nemotron's I/8, mma.sync stays ahead).
  if (mean_rows >= 16 && out_cols >= 384 && wgmma_available()) return GemmVariant::wgmma;
  if (mean_rows <= 16) return GemmVariant::mma_s_wide;
  if (mean_rows <= 48) return GemmVariant::mma_m;
  return GemmVariant::mma_l4;
}

GemmVariant choose_mxfp4_variant(DType dtype, bool down, bool gated, int64_t num_tokens, int top_k, int num_experts,
                                 int64_t intermediate, int64_t latent) {
  // By rows per touched expert, measured on an H200 (grouped_gemm_bench --weights mxfp4 --variants all,
  // docs/MXFP4.md; kimi-k3 tp-shard 8 and 1, 256-4096 tokens): up to kMxfp4RowsMaxMeanRows rows the rows
  // kernel (replaced mma_s_wide, 0.35-0.38 of the byte floor at 8-256 tokens; on an H100 at da0f97a 0.58-0.66 at
  // 16-256 tokens, mxfp4_rows_h100_da0f97a.json; at 1024 tokens, 18 rows, wgmma_narrow was 10% ahead on the H200
  // before the rows kernel's cursor walk, and 1.21x behind it on an H100 at 2b0f8f2, hence 18); above, on
  // Hopper, the wgmma kernel where bf16 takes it (at least 384 output columns), 6-18% faster than the best mma.sync
  // shape at 1024 and 4096 tokens, in its narrow shape (128 weight rows, two CTAs per SM): 3-8% faster than the 256-row
  // one at 256-4096 tokens, both presets (140c3c2, grouped_gemm_mxfp4_narrow_h200_140c3c2.json); else mma_m up to 48
  // rows, mma_l4 above. The tall wgmma tiles measured 1.6-1.8x slower than the 96-row ones with MXFP4 and are not
  // chosen. Above kMxfp4WsTallMinMeanRows rows the persistent tall tiles (wgmma_ws_tall, whose producer decodes
  // the codes while the consumers multiply) measured 1.09-1.24x faster than wgmma_narrow (grouped_gemm.h).
  (void)gated;
  const int64_t mean_rows = mean_rows_per_touched_expert(num_tokens, top_k, num_experts);
  if (num_tokens <= 16 || mean_rows <= kMxfp4RowsMaxMeanRows) return GemmVariant::mxfp4_rows;
  // wgmma_ws takes MXFP4 where the grouped kernels do (n and k multiples of 32: grouped_mxfp4_supported).
  if (mean_rows > kMxfp4WsTallMinMeanRows && persistent_kernels_available(num_experts) &&
      grouped_mxfp4_supported(dtype, intermediate, latent)) {
    return GemmVariant::wgmma_ws_tall;
  }
  const int64_t out_cols = down ? latent : intermediate;
  if (out_cols >= 384 && wgmma_available()) return GemmVariant::wgmma_narrow;
  if (mean_rows <= 48) return GemmVariant::mma_m;
  return GemmVariant::mma_l4;
}

namespace {

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

void check_common(DType dtype, const MoeLayout& layout, const ExpertGemmWeights& w, const char* what) {
  LATENTMOE_CHECK(is_compute_dtype(dtype), what, ": dtype ", dtype_name(dtype),
                  " is not a compute dtype (f32, bf16, f16)");
  LATENTMOE_CHECK(w.num_experts > 0 && layout.num_experts == w.num_experts, what, ": the layout has ",
                  layout.num_experts, " experts but the weights have ", w.num_experts);
  LATENTMOE_CHECK(layout.top_k > 0 && layout.num_tokens >= 0, what, ": bad layout (top_k ", layout.top_k,
                  ", num_tokens ", layout.num_tokens, ")");
  LATENTMOE_CHECK(
      w.intermediate > 0 && w.latent > 0 && w.intermediate < (int64_t{1} << 30) && w.latent < (int64_t{1} << 30), what,
      ": bad expert shape (intermediate ", w.intermediate, ", latent ", w.latent, ")");
  LATENTMOE_CHECK(layout.num_tokens * layout.top_k < (int64_t{1} << 31), what, ": too many rows (", layout.num_tokens,
                  " tokens x top_k ", layout.top_k, ")");
  LATENTMOE_CHECK(layout.num_tokens == 0 || (layout.expert_offsets != nullptr && layout.sorted_pairs != nullptr), what,
                  ": the layout's device arrays are missing");
}

void run(GemmChoice choice, DType dtype, gg::Mode mode, const gg::KernelArgs& args, int64_t num_tokens,
         int64_t intermediate, int64_t latent, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  const bool down = mode == gg::Mode::plain;
  const bool mxfp4 = args.s0 != nullptr;
  GemmVariant variant = choice.variant;
  if (variant == GemmVariant::automatic) {
    variant = mxfp4 ? choose_mxfp4_variant(dtype, down, mode == gg::Mode::gated, num_tokens, args.top_k,
                                           args.num_experts, intermediate, latent)
                    : choose_variant(dtype, down, mode == gg::Mode::gated, num_tokens, args.top_k, args.num_experts,
                                     intermediate, latent);
  }
  LATENTMOE_CHECK(!is_mxfp4_only(variant) || mxfp4, "grouped GEMM: the ", to_string(variant),
                  " variant takes MXFP4 weights only");
  // GemmChoice::option: mxfp4_rows 0-4 (its L2 prefetch size), wgmma_ws and wgmma_ws_tall 0-31 (bits: 1 the register
  // epilogue, 2 contiguous rows by cp.async instead of TMA, 4 the weights at normal L2 priority, 8 their TMA without
  // the L2 promotion, 16 the weights' L2 handling of before session 20 whatever K; 16 with 4 or 8 is refused).
  const bool persistent = variant == GemmVariant::wgmma_ws || variant == GemmVariant::wgmma_ws_tall;
  const int max_option = variant == GemmVariant::mxfp4_rows ? 4 : persistent ? 31 : 0;
  LATENTMOE_CHECK(choice.option >= 0 && choice.option <= max_option, "grouped GEMM: the ", to_string(variant),
                  " variant takes options 0 to ", max_option, ", not ", choice.option);
  LATENTMOE_CHECK(!persistent || (choice.option & 16) == 0 || (choice.option & 12) == 0, "grouped GEMM: the ",
                  to_string(variant), " variant's option ", choice.option,
                  " asks for the old weights' L2 handling (16) and for a new one (4 or 8) at once");
  const bool tensor_core_ok = dtype != DType::f32 && current_compute_capability() >= 80 && args.n % 8 == 0 &&
                              args.k % 8 == 0 && aligned16(args.a) && aligned16(args.w0) &&
                              (args.w1 == nullptr || aligned16(args.w1)) && aligned16(args.out);
  const int64_t max_rows = num_tokens * args.top_k;
  if (mxfp4) {
    // Only the tensor-core kernels decode MXFP4 (a variant without an MXFP4 instance, simt included,
    // is refused by launch_mma_mxfp4).
    LATENTMOE_CHECK(grouped_mxfp4_supported(dtype, intermediate, latent),
                    "grouped GEMM: MXFP4 experts need bf16 or f16 activations, compute capability 8.0 and l, I_r "
                    "multiples of 32 (dtype ",
                    dtype_name(dtype), ", l ", latent, ", I_r ", intermediate, ")");
    LATENTMOE_CHECK(tensor_core_ok, "grouped GEMM: MXFP4 experts need 16-byte aligned activations, outputs and codes");
  } else if (variant == GemmVariant::simt || !tensor_core_ok) {
    gg::launch_simt(dtype, mode, args, max_rows, stream);
    return;
  }
  gg::MmaLaunch launch;
  launch.max_rows = max_rows;
  launch.num_tokens = num_tokens;
  launch.n_tiles_per_cta = choice.n_tiles_per_cta;
  // Programmatic dependent launches on sm_90 (src/cuda/common/pdl.cuh): the gate/up kernel waits for the
  // layout kernel before it looks up its tiles; the down kernel looks up its tiles (written two kernels
  // back) and streams its first weights before it waits for gate/up. Both kernels (mma.sync and wgmma)
  // trigger their dependent after their own wait.
  const bool hopper = current_compute_capability() >= 90;
  launch.programmatic = hopper;
  launch.wait_before_tile = hopper && !down;
  launch.trigger = hopper;
  launch.sm_count = current_sm_count();
  launch.variant_option = choice.option;
  launch.prefer_two_tiles = down;
  launch.k_splits = choice.k_splits;
  gg::attach_split_k(launch, workspace, workspace_bytes, gg::kSplitKCounters, gg::kSplitKPartialBytes, "grouped GEMM");
  if (is_mxfp4_only(variant)) {
    gg::launch_mxfp4_rows(dtype, mode, args, choice.n_tiles_per_cta, launch, hopper, stream);
    return;
  }
  const bool wgmma = detail::is_wgmma(variant);
  const gg::WgmmaShape shape = variant == GemmVariant::wgmma_tall     ? gg::WgmmaShape::tall
                               : variant == GemmVariant::wgmma_narrow ? gg::WgmmaShape::narrow
                                                                      : gg::WgmmaShape::wide;
  if (wgmma) {
    LATENTMOE_CHECK(detail::wgmma_available(), "grouped GEMM: the ", detail::to_string(variant),
                    " variant needs an sm_90 device and sm_90a code");
  }
  if (persistent) {
    gg::launch_wgmma_ws(dtype, variant == GemmVariant::wgmma_ws_tall ? gg::WgmmaWsShape::tall : gg::WgmmaWsShape::wide,
                        mode, args, launch, stream);
    return;
  }
  if (mxfp4 && wgmma) {
    gg::launch_wgmma_mxfp4(dtype, shape, mode, args, launch, stream);
    return;
  }
  if (mxfp4) {
    gg::launch_mma_mxfp4(dtype, variant, mode, args, launch, stream);
    return;
  }
  if (wgmma) {
    gg::launch_wgmma(dtype, shape, mode, args, launch, stream);
    return;
  }
  if (dtype == DType::bf16) {
    gg::launch_mma_bf16(variant, mode, args, launch, stream);
  } else {
    gg::launch_mma_f16(variant, mode, args, launch, stream);
  }
}

}  // namespace

void grouped_gate_up_variant(GemmChoice choice, DType dtype, const latentmoe::detail::ActivationParams& act,
                             const void* z, const MoeLayout& layout, const ExpertGemmWeights& w, void* act_rows,
                             void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  check_common(dtype, layout, w, "grouped_gate_up");
  if (layout.num_tokens == 0) return;
  const bool gated = act.activation != Activation::relu2;
  LATENTMOE_CHECK(w.up != nullptr && (!gated || w.gate != nullptr), "grouped_gate_up: the ",
                  gated ? "gate or up" : "up", " weights are missing");
  LATENTMOE_CHECK(z != nullptr && act_rows != nullptr, "grouped_gate_up: z or act_rows is null");
  gg::KernelArgs args;
  args.a = z;
  args.w0 = gated ? w.gate : w.up;
  args.w1 = gated ? w.up : nullptr;
  if (w.mxfp4()) {
    LATENTMOE_CHECK(!gated || w.gate_scales != nullptr, "grouped_gate_up: the MXFP4 gate scales are missing");
    args.s0 = gated ? w.gate_scales : w.up_scales;
    args.s1 = gated ? w.up_scales : nullptr;
  }
  args.out = act_rows;
  args.expert_offsets = layout.expert_offsets;
  args.sorted_pairs = layout.sorted_pairs;
  args.top_k = layout.top_k;
  args.num_experts = layout.num_experts;
  args.n = static_cast<int>(w.intermediate);
  args.k = static_cast<int>(w.latent);
  args.situ = act.activation == Activation::situ;
  args.situ_beta = act.situ_beta;
  args.situ_linear_beta = act.situ_linear_beta;
  run(choice, dtype, gated ? gg::Mode::gated : gg::Mode::relu2, args, layout.num_tokens, w.intermediate, w.latent,
      workspace, workspace_bytes, stream);
}

void grouped_down_variant(GemmChoice choice, DType dtype, const void* act_rows, const MoeLayout& layout,
                          const ExpertGemmWeights& w, void* y_rows, void* workspace, size_t workspace_bytes,
                          cudaStream_t stream) {
  check_common(dtype, layout, w, "grouped_down");
  if (layout.num_tokens == 0) return;
  LATENTMOE_CHECK(w.down != nullptr, "grouped_down: the down weights are missing");
  LATENTMOE_CHECK(act_rows != nullptr && y_rows != nullptr, "grouped_down: act_rows or y_rows is null");
  gg::KernelArgs args;
  args.a = act_rows;
  args.w0 = w.down;
  if (w.mxfp4()) {
    LATENTMOE_CHECK(w.down_scales != nullptr, "grouped_down: the MXFP4 down scales are missing");
    args.s0 = w.down_scales;
  }
  args.out = y_rows;
  args.expert_offsets = layout.expert_offsets;
  args.sorted_pairs = nullptr;
  args.top_k = layout.top_k;
  args.num_experts = layout.num_experts;
  args.n = static_cast<int>(w.latent);
  args.k = static_cast<int>(w.intermediate);
  run(choice, dtype, gg::Mode::plain, args, layout.num_tokens, w.intermediate, w.latent, workspace, workspace_bytes,
      stream);
}

}  // namespace detail

void grouped_gate_up(DType dtype, const latentmoe::detail::ActivationParams& act, const void* z,
                     const MoeLayout& layout, const ExpertGemmWeights& w, void* act_rows, void* workspace,
                     size_t workspace_bytes, cudaStream_t stream) {
  detail::grouped_gate_up_variant(detail::GemmVariant::automatic, dtype, act, z, layout, w, act_rows, workspace,
                                  workspace_bytes, stream);
}

void grouped_down(DType dtype, const void* act_rows, const MoeLayout& layout, const ExpertGemmWeights& w, void* y_rows,
                  void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  detail::grouped_down_variant(detail::GemmVariant::automatic, dtype, act_rows, layout, w, y_rows, workspace,
                               workspace_bytes, stream);
}

bool grouped_mxfp4_supported(DType dtype, int64_t intermediate, int64_t latent) {
  return (dtype == DType::bf16 || dtype == DType::f16) && current_compute_capability() >= 80 &&
         intermediate % 32 == 0 && latent % 32 == 0;
}

size_t grouped_gemm_workspace_bytes(int64_t max_tokens, int top_k, int num_experts) {
  return gg::kSplitKWorkspaceBytes;
}

}  // namespace latentmoe::cuda

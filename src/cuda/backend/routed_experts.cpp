// CudaBackend's routed experts: which kernels run a call, by the experts' format and the token count —
// the skinny decode kernels, the MXFP4 decode kernels, or the grouped GEMMs (MoE layout, gate/up, down,
// combine) — and how each is fed.
#include "cuda/backend/backend_state.h"
#include "cuda/gemm/grouped_gemm.h"
#include "cuda/gemm/mxfp4_decode.h"
#include "cuda/gemm/mxfp4_pairs.h"
#include "cuda/gemm/skinny_gemm.h"
#include "cuda/kernels/elementwise.h"
#include "cuda/kernels/moe_layout.h"
#include "cuda/kernels/routing.h"

namespace latentmoe::cuda {

namespace {

// The grouped GEMMs' view of one rank's stacked experts; MXFP4: the codes, with their scales.
ExpertGemmWeights expert_gemm_weights(const MlpWeights& experts, bool gated, int64_t intermediate, int64_t latent) {
  ExpertGemmWeights w;
  w.gate = gated ? experts.gate.data() : nullptr;
  w.up = experts.up.data();
  w.down = experts.down.data();
  if (experts.format == ExpertWeightFormat::mxfp4) {
    w.gate_scales = gated ? experts.gate_scale.data_as<uint8_t>() : nullptr;
    w.up_scales = experts.up_scale.data_as<uint8_t>();
    w.down_scales = experts.down_scale.data_as<uint8_t>();
  }
  w.intermediate = intermediate;
  w.latent = latent;
  w.num_experts = static_cast<int>(experts.up.size(0));
  return w;
}

// The weight bytes a call streams at most: every matrix (and MXFP4 scale) of min(E, tokens x top_k) experts.
int64_t routed_weight_bytes(const MlpWeights& experts, int64_t tokens, int64_t top_k) {
  const int64_t num_experts = experts.up.size(0);
  if (num_experts <= 0) return 0;
  size_t all = 0;
  for (const TensorView* view :
       {&experts.gate, &experts.up, &experts.down, &experts.gate_scale, &experts.up_scale, &experts.down_scale}) {
    if (view->defined()) all += static_cast<size_t>(view->numel()) * dtype_size(view->dtype());
  }
  return static_cast<int64_t>(all) / num_experts * std::min(num_experts, tokens * top_k);
}

}  // namespace

void CudaBackend::routed_experts(const ActivationParams& activation, const TensorView& z, const TensorView& topk_ids,
                                 const TensorView& topk_weights, const MlpWeights& experts, const TensorView& out) {
  State& s = *state_;
  DeviceGuard guard(s.ordinal);
  const bool gated = activation.activation != Activation::relu2;
  // On the main side of run_overlapped: what the shared expert beside streams against (dense_mlp's rule).
  if (s.overlapping && s.current == s.bound && topk_ids.rank() == 2) {
    s.beside_bytes = routed_weight_bytes(experts, topk_ids.size(0), topk_ids.size(1));
  }
  if (experts.format == ExpertWeightFormat::mxfp4) {
    mxfp4_routed_experts(activation, z, topk_ids, topk_weights, experts, out);
    return;
  }
  debug_require_compute_dtype(z.dtype(), "routed expert input");
  debug_require_compute_dtype(out.dtype(), "routed expert output");
  debug_require_dtype(topk_ids.dtype(), DType::i32, "topk_ids");
  debug_require_dtype(topk_weights.dtype(), DType::f32, "topk_weights");
  debug_require_contiguous_device(z, "routed expert input");
  debug_require_contiguous_device(topk_ids, "topk_ids");
  debug_require_contiguous_device(topk_weights, "topk_weights");
  debug_require_contiguous_device(experts.up, "expert up weights");
  debug_require_contiguous_device(experts.down, "expert down weights");
  if (gated) {
    LATENTMOE_DEBUG_CHECK(experts.gate.defined(), "CUDA routed experts: ", to_string(activation.activation),
                          " needs expert gate weights");
    debug_require_contiguous_device(experts.gate, "expert gate weights");
  }
  LATENTMOE_DEBUG_CHECK(experts.up.rank() == 3 && experts.down.rank() == 3 && (!gated || experts.gate.rank() == 3),
                        "CUDA routed experts: expert weights must be stacked [E, rows, cols]");
  LATENTMOE_DEBUG_CHECK(experts.up.dtype() == z.dtype() && experts.down.dtype() == z.dtype() &&
                            (!gated || experts.gate.dtype() == z.dtype()),
                        "CUDA routed experts: the expert weights' dtype is not the input's, ", dtype_name(z.dtype()));
  const RowMatrix input = as_rows(z, "routed expert input");
  const RowMatrix output = as_rows(out, "routed expert output");
  const int64_t num_experts = experts.up.size(0);
  const int64_t intermediate = experts.up.size(1);
  const int64_t latent = experts.up.size(2);
  const int64_t num_tokens = input.rows;
  const int64_t k = topk_ids.rank() == 2 ? topk_ids.size(1) : topk_ids.numel();
  LATENTMOE_DEBUG_CHECK(input.cols == latent && output.rows == num_tokens && output.cols == latent &&
                            experts.down.size(0) == num_experts && experts.down.size(1) == latent &&
                            experts.down.size(2) == intermediate &&
                            (!gated || experts.gate.shape() == experts.up.shape()),
                        "CUDA routed experts: z ", z.shape_string(), ", up ", experts.up.shape_string(), ", down ",
                        experts.down.shape_string(), " and out ", out.shape_string(), " do not match");
  LATENTMOE_DEBUG_CHECK(topk_ids.numel() == num_tokens * k && topk_weights.numel() == num_tokens * k,
                        "CUDA routed experts: topk_ids ", topk_ids.shape_string(), " and topk_weights ",
                        topk_weights.shape_string(), " do not match ", num_tokens, " tokens");
  if (num_tokens == 0) return;
  LATENTMOE_CHECK(k >= 1 && k <= kMaxRouteTopK, "CUDA routed experts: top_k ", k, " is outside 1..", kMaxRouteTopK);
  s.mark_slot(s.routed_slots, "routed_experts");

  const RoutedBuffers buffers = routed_buffers(z.dtype(), num_tokens, k, num_experts, intermediate, latent);
  void* act_rows = buffers.act_rows;

  // Decode: two skinny kernels do the whole step, the distinct experts found from topk_ids and the
  // combine folded into the down projection (act rows indexed by pair).
  const bool same_dtype = out.dtype() == z.dtype();
  if (s.skinny(num_tokens) &&
      (s.skinny_always || skinny_pays(*s.dispatch, SkinnyOp::routed_experts, num_tokens, latent, intermediate)) &&
      same_dtype && k <= kSkinnyMaxTopK &&
      skinny_supported(
          z.dtype(), num_tokens, latent,
          {{z.data(), latent}, {experts.up.data(), latent}, {gated ? experts.gate.data() : nullptr, latent}}) &&
      skinny_supported(z.dtype(), num_tokens, intermediate,
                       {{act_rows, intermediate}, {experts.down.data(), intermediate}})) {
    const SkinnyRouting routing{topk_ids.data_as<const int32_t>(), topk_weights.data_as<const float>(),
                                static_cast<int>(k), static_cast<int>(num_experts)};
    const SkinnyWeights gate_up{
        gated ? experts.gate.data() : nullptr, experts.up.data(), intermediate, latent, latent, intermediate * latent};
    const SkinnyWeights down{nullptr, experts.down.data(), latent, intermediate, intermediate, latent * intermediate};
    skinny_gate_up(z.dtype(), activation, routing, {z.data(), latent}, num_tokens, gate_up, act_rows, intermediate,
                   s.current, s.skinny_shape);
    skinny_down(z.dtype(), routing, {act_rows, intermediate}, num_tokens, down, output.data, output.ld, false,
                s.current, s.skinny_shape);
    return;
  }
  grouped_routed_experts(activation, z, topk_ids, topk_weights,
                         expert_gemm_weights(experts, gated, intermediate, latent), out);
}

void CudaBackend::mxfp4_routed_experts(const ActivationParams& activation, const TensorView& z,
                                       const TensorView& topk_ids, const TensorView& topk_weights,
                                       const MlpWeights& experts, const TensorView& out) {
  State& s = *state_;
  const bool gated = activation.activation != Activation::relu2;
  // gate/up: codes [E, I_r, l/2] and scales [E, I_r, l/32]; down: [E, l, I_r/2] and [E, l, I_r/32].
  const int64_t num_tokens = z.size(0), k = topk_ids.size(1), num_experts = experts.up.size(0);
  const int64_t intermediate = experts.up.size(1), latent = 2 * experts.up.size(2);
  if (num_tokens == 0) return;
  s.mark_slot(s.routed_slots, "routed_experts");
  // Above s.mxfp4_decode_max_tokens (kMxfp4DecodeTokens unless the setting says otherwise): the grouped GEMMs
  // with MXFP4 weights (grouped_gemm.h), whose automatic choice takes the rows kernel (each touched expert's
  // weights read once per 16 of its rows) while experts hold few rows, and the tensor-core tile kernels above.
  // More than 8 tokens on the decode kernels (up to that bound, and f32 at any count) run in batches of 8, each
  // batch reading its touched experts again (docs/MXFP4.md).
  if (num_tokens > s.mxfp4_decode_max_tokens && grouped_mxfp4_supported(z.dtype(), intermediate, latent)) {
    grouped_routed_experts(activation, z, topk_ids, topk_weights,
                           expert_gemm_weights(experts, gated, intermediate, latent), out);
    return;
  }
  // The activations of at most kMxfp4DecodeMaxRows tokens at a time (the workspace holds max_tokens').
  const int64_t chunk_tokens = std::min<int64_t>(num_tokens, kMxfp4DecodeMaxRows);
  const size_t act_needed = static_cast<size_t>(chunk_tokens * k * intermediate) * dtype_size(z.dtype());
  LATENTMOE_CHECK(s.prepared && act_needed <= s.act_bytes, "CUDA routed experts: the workspace prepared for ",
                  "max_tokens = ", s.spec.max_tokens, " does not hold ", chunk_tokens, " tokens' activations");
  void* act = static_cast<char*>(s.routed_workspace.get()) + s.layout_bytes;
  auto matrices = [](const TensorView& packed, const TensorView& scales, int64_t rows, int64_t cols) {
    return Mxfp4Matrices{packed.data_as<uint8_t>(), scales.data_as<uint8_t>(), rows, cols};
  };
  Mxfp4GateUpCall gate_up;
  gate_up.dtype = z.dtype();
  gate_up.activation = activation;
  gate_up.top_k = static_cast<int>(k);
  gate_up.num_experts = static_cast<int>(num_experts);
  gate_up.ld_z = z.stride(0);
  gate_up.up = matrices(experts.up, experts.up_scale, intermediate, latent);
  if (gated) gate_up.gate = matrices(experts.gate, experts.gate_scale, intermediate, latent);
  gate_up.act = act;
  gate_up.warps_per_tile = s.mxfp4_gate_up_warps_per_tile;
  Mxfp4DownCall down;
  down.dtype = z.dtype();
  down.top_k = gate_up.top_k;
  down.num_experts = gate_up.num_experts;
  down.act = act;
  down.down = matrices(experts.down, experts.down_scale, latent, intermediate);
  down.ld_out = out.stride(0);
  // The decode kernels take up to kMxfp4DecodeMaxRows tokens; more, where the grouped kernels do not
  // take them (f32 activations), run through them in consecutive batches of that many, each batch
  // reading its touched experts again.
  for (int64_t first = 0; first < num_tokens; first += kMxfp4DecodeMaxRows) {
    const int tokens = static_cast<int>(std::min<int64_t>(kMxfp4DecodeMaxRows, num_tokens - first));
    gate_up.tokens = down.tokens = tokens;
    gate_up.ids = down.ids = topk_ids.data_as<int32_t>() + first * k;
    gate_up.z = static_cast<const char*>(z.data()) + first * z.stride(0) * dtype_size(z.dtype());
    down.weights = topk_weights.data_as<float>() + first * k;
    down.out = static_cast<char*>(out.data()) + first * out.stride(0) * dtype_size(out.dtype());
    // Up to s.mxfp4_pairs_max_tokens tokens of bf16 activations: the pair kernels, both calls or neither (each
    // kernel family writes and reads its own act rows).
    if (num_tokens <= s.mxfp4_pairs_max_tokens && mxfp4_pairs_supported(gate_up, down)) {
      mxfp4_pairs_gate_up(gate_up, s.current);
      mxfp4_pairs_down(down, s.current);
      continue;
    }
    mxfp4_routed_gate_up(gate_up, s.current);
    mxfp4_routed_down(down, s.current);
  }
}

void CudaBackend::grouped_routed_experts(const ActivationParams& activation, const TensorView& z,
                                         const TensorView& topk_ids, const TensorView& topk_weights,
                                         const ExpertGemmWeights& weights, const TensorView& out) {
  State& s = *state_;
  const int64_t num_tokens = z.size(0), k = topk_ids.size(1);
  const RoutedBuffers buffers =
      routed_buffers(z.dtype(), num_tokens, k, weights.num_experts, weights.intermediate, weights.latent);
  const MoeLayout layout = build_moe_layout(topk_ids.data_as<const int32_t>(), num_tokens, static_cast<int>(k),
                                            weights.num_experts, buffers.layout, s.layout_bytes, s.current);
  grouped_gate_up(z.dtype(), activation, z.data(), layout, weights, buffers.act_rows, buffers.grouped, s.grouped_bytes,
                  s.current);
  grouped_down(z.dtype(), buffers.act_rows, layout, weights, buffers.y_rows, buffers.grouped, s.grouped_bytes,
               s.current);
  launch_combine(z.dtype(), buffers.y_rows, layout.pair_rows, topk_weights.data_as<const float>(), static_cast<int>(k),
                 as_rows(out, "routed expert output"), s.current);
}

}  // namespace latentmoe::cuda

// The layer's forward pass on one rank, against the Backend interface (DESIGN sections 1-2). The steps
// below are numbered as DESIGN section 1 numbers them; they run in the order the data allows.
#include "core/layer_forward.h"

namespace latentmoe::detail {
namespace {

// The first `rows` rows of a workspace.
TensorView rows_of(const DeviceTensor& tensor, int64_t rows) { return tensor.view.slice_rows(0, rows); }

MlpWeights routed_expert_weights(const RunnerState& state) {
  return {state.expert_gate.view,      state.expert_up.view,         state.expert_down.view,
          state.config.experts_format, state.expert_gate_scale.view, state.expert_up_scale.view,
          state.expert_down_scale.view};
}

MlpWeights shared_expert_weights(const RunnerState& state) {
  return {state.shared_gate.view, state.shared_up.view, state.shared_down.view, ExpertWeightFormat::dense, {}, {}, {}};
}

}  // namespace

TailTensors tail_tensors(RunnerState& state, TailTier tier, const TensorView& out, int64_t num_tokens) {
  const TailScratch scratch{state.latent_partial.view, state.latent_reduced.view,
                            state.config.has_shared_expert() ? state.shared_partial.view : TensorView(),
                            state.hidden_shard.view};
  return tail_tensors(scratch, tier, state.parallel.tp_size, out, num_tokens);
}

void run_layer(RunnerState& state, const ForwardInputs& inputs, const ForwardOutputs& outputs, TailTier tier,
               int64_t num_tokens) {
  Backend& backend = *state.backend;
  const TensorView& x = inputs.hidden_states;

  // Step 1, routing: the logits (unless given), then the top-k.
  TensorView logits = inputs.router_logits;
  if (!logits.defined()) {
    logits = rows_of(state.logits, num_tokens);
    backend.router_logits(x, state.gate.view, logits);
  }
  const TensorView topk_ids = rows_of(state.topk_ids, num_tokens);
  const TensorView topk_weights = rows_of(state.topk_weights, num_tokens);
  const TensorView zero_weight_sum = state.zero_weight_sum.view.slice_rows(0, num_tokens);
  auto route = [&] {
    backend.route(state.routing, logits, state.score_bias.view, topk_ids, topk_weights, zero_weight_sum);
  };

  // Step 2, the latent down-projection, unless the caller already ran it. Routing does not need it, so
  // the two run side by side (on a GPU the routing kernel hides behind the weight stream of W_down).
  TensorView latent_in = inputs.latent_states;
  if (!latent_in.defined()) {
    latent_in = rows_of(state.latent_in, num_tokens);
    backend.run_overlapped([&] { backend.linear(x, state.down_proj.view, latent_in, /*accumulate=*/false); }, route);
  } else {
    route();
  }

  // Steps 3-4, this rank's routed experts: the un-reduced latent partial L_r; beside them step 6, this
  // rank's shared-expert shard: the un-reduced partial S_r, which needs only x. Tier column_parallel
  // writes S_r straight into the output, which its tail then accumulates into and reduces in place.
  const TailTensors t = tail_tensors(state, tier, outputs.output, num_tokens);
  auto routed = [&] {
    backend.routed_experts(state.activation, latent_in, topk_ids, topk_weights, routed_expert_weights(state),
                           t.latent_partial);
  };
  if (state.config.has_shared_expert()) {
    backend.run_overlapped(
        routed, [&] { backend.dense_mlp(state.activation, x, shared_expert_weights(state), t.shared_partial); });
  } else {
    routed();
  }

  // Steps 5 and 8, the tail: R = norm(L) W_up^T and out = R + S, replicated on every rank.
  run_tail(state.tail_operands(), tier, t);

  // Step 7, the zero experts: identity experts weighted by their routing weights, added to the
  // replicated output (out = R + S + Zout).
  if (state.config.zero_expert_num > 0) backend.add_scaled_rows(x, zero_weight_sum, t.out);

  if (outputs.topk_ids.defined()) backend.copy(topk_ids, outputs.topk_ids);
  if (outputs.topk_weights.defined()) backend.copy(topk_weights, outputs.topk_weights);
}

}  // namespace latentmoe::detail

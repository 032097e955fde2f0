// The layer's forward pass on one rank, against the Backend interface (DESIGN sections 1-2).
//
// Every rank holds un-reduced partials L_r = its routed experts' latent output and S_r = its
// shared-expert shard's output; the tail of the chosen tier turns them into the same `out` on
// every rank:
//   native            L = AR(L_r); out = norm(L) W_up^T; S = AR(S_r); out += S
//   tail_fusion       Lhat = norm(AR(L_r)), Sh_r = RS(S_r)   (one collective step)
//                     out_r = Lhat W_up[shard_r]^T + Sh_r;  out = AG(out_r)
//   allreduce_overlap Lhat = AR+norm(L_r); out = Lhat W_up^T  ||  S = AR(S_r) on the aux stream;
//                     out += S
//   column_parallel   Lhat = AR+norm(L_r); out = S_r; out[:, shard_r] += Lhat W_up[shard_r]^T;
//                     out = AR(out)
// and finally out += (summed zero-expert weights) · x on every rank.
#include "core/tails.h"

#include "latentmoe/error.h"

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

void native_tail(RunnerState& state, const TailTensors& t) {
  Backend& backend = *state.backend;
  Communicator& comm = state.comm;
  // The native path keeps the reduction and the norm as separate steps, as a framework's default
  // MoE path does; the fused tiers use all_reduce_rms_norm.
  if (comm.size() > 1) comm.all_reduce_sum(t.latent_partial, backend.stream());
  TensorView latent = t.latent_partial;
  if (state.config.use_latent_norm) {
    backend.rms_norm(t.latent_partial, state.latent_norm.view, static_cast<float>(state.config.rms_norm_eps),
                     t.latent_reduced);
    latent = t.latent_reduced;
  }
  backend.linear(latent, state.up_proj.view, t.out, /*accumulate=*/false);
  if (t.shared_partial.defined()) {
    if (comm.size() > 1) comm.all_reduce_sum(t.shared_partial, backend.stream());
    backend.add(t.out, t.shared_partial, t.out);
  }
}

TensorView up_proj_shard(const RunnerState& state) {
  const int64_t shard = state.config.hidden_size / state.parallel.tp_size;
  return state.up_proj.view.slice_rows(state.parallel.rank * shard, (state.parallel.rank + 1) * shard);
}

void tail_fusion_tail(RunnerState& state, const TailTensors& t) {
  Backend& backend = *state.backend;
  backend.tail_fusion_collective(state.comm, t.latent_partial, t.shared_partial, state.latent_norm.view,
                                 static_cast<float>(state.config.rms_norm_eps), t.latent_reduced, t.hidden_shard);
  backend.up_projection_all_gather(state.comm, t.latent_reduced, up_proj_shard(state), t.hidden_shard, t.out);
}

void allreduce_overlap_tail(RunnerState& state, const TailTensors& t) {
  Backend& backend = *state.backend;
  backend.all_reduce_rms_norm(state.comm, t.latent_partial, state.latent_norm.view,
                              static_cast<float>(state.config.rms_norm_eps), t.latent_reduced);
  backend.run_overlapped([&] { backend.linear(t.latent_reduced, state.up_proj.view, t.out, /*accumulate=*/false); },
                         [&] { state.comm.all_reduce_sum(t.shared_partial, backend.stream()); });
  backend.add(t.out, t.shared_partial, t.out);
}

void column_parallel_tail(RunnerState& state, const TailTensors& t) {
  Backend& backend = *state.backend;
  backend.all_reduce_rms_norm(state.comm, t.latent_partial, state.latent_norm.view,
                              static_cast<float>(state.config.rms_norm_eps), t.latent_reduced);
  // The shared partial was written straight into `out` (see run_layer), so the up-projection
  // shard accumulates into it and one all-reduce stitches the routed shards and the shared sum.
  const int64_t shard = state.config.hidden_size / state.parallel.tp_size;
  const TensorView out_shard = t.out.slice_cols(state.parallel.rank * shard, (state.parallel.rank + 1) * shard);
  backend.linear(t.latent_reduced, up_proj_shard(state), out_shard, /*accumulate=*/true);
  state.comm.all_reduce_sum(t.out, backend.stream());
}

}  // namespace

TailTensors tail_tensors(RunnerState& state, TailTier tier, const TensorView& out, int64_t num_tokens) {
  TailTensors t;
  t.latent_partial = rows_of(state.latent_partial, num_tokens);
  t.out = out;
  t.latent_reduced = rows_of(state.latent_reduced, num_tokens);
  t.hidden_shard = rows_of(state.hidden_shard, num_tokens);
  if (state.config.has_shared_expert()) {
    t.shared_partial = tier == TailTier::column_parallel ? out : rows_of(state.shared_partial, num_tokens);
  }
  return t;
}

void run_tail(RunnerState& state, TailTier tier, const TailTensors& t) {
  switch (tier) {
    case TailTier::native:
      native_tail(state, t);
      break;
    case TailTier::tail_fusion:
      tail_fusion_tail(state, t);
      break;
    case TailTier::allreduce_overlap:
      allreduce_overlap_tail(state, t);
      break;
    case TailTier::column_parallel:
      column_parallel_tail(state, t);
      break;
  }
}

void run_layer(RunnerState& state, const ForwardInputs& inputs, const ForwardOutputs& outputs, TailTier tier,
               int64_t num_tokens) {
  Backend& backend = *state.backend;
  const TensorView& x = inputs.hidden_states;

  // 1. Routing.
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

  // 2. The latent down-projection, unless the caller already ran it. Routing does not need it, so the
  // two run side by side (on a GPU the routing kernel hides behind the weight stream of W_down).
  TensorView latent_in = inputs.latent_states;
  if (!latent_in.defined()) {
    latent_in = rows_of(state.latent_in, num_tokens);
    backend.run_overlapped([&] { backend.linear(x, state.down_proj.view, latent_in, /*accumulate=*/false); }, route);
  } else {
    route();
  }

  // 3-4. This rank's routed experts: the un-reduced latent partial L_r; beside them (6.) this rank's
  // shared-expert shard: the un-reduced partial S_r, which needs only x. Tier column_parallel writes
  // S_r straight into the output, which its tail then accumulates into and reduces in place.
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

  // 5 + 8. The tail.
  run_tail(state, tier, t);

  // 7. Zero experts: identity experts weighted by their routing weights, on the replicated output.
  if (state.config.zero_expert_num > 0) backend.add_scaled_rows(x, zero_weight_sum, t.out);

  if (outputs.topk_ids.defined()) backend.copy(topk_ids, outputs.topk_ids);
  if (outputs.topk_weights.defined()) backend.copy(topk_weights, outputs.topk_weights);
}

}  // namespace latentmoe::detail

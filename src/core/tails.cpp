// The four tails on one rank, against the Backend interface (DESIGN section 2). Every rank holds
// un-reduced partials L_r = its routed experts' latent output and S_r = its shared-expert shard's
// output; the tail of the chosen tier turns them into the same `out` on every rank:
//   native            L = AR(L_r); out = norm(L) W_up^T; S = AR(S_r); out += S
//                     (one rank: out = S_r, then out += norm(L_r) W_up^T in the up-projection's epilogue)
//   tail_fusion       Lhat = norm(AR(L_r)), Sh_r = RS(S_r)   (one collective step)
//                     out_r = Lhat W_up[shard_r]^T + Sh_r;  out = AG(out_r)
//   allreduce_overlap Lhat = AR+norm(L_r); out = Lhat W_up^T  ||  S = AR(S_r) on the aux stream;
//                     out += S
//   column_parallel   Lhat = AR+norm(L_r); out = S_r; out[:, shard_r] += Lhat W_up[shard_r]^T;
//                     out = AR(out)
#include "core/tails.h"

namespace latentmoe::detail {
namespace {

void native_tail(const TailOperands& o, const TailTensors& t) {
  Backend& backend = *o.backend;
  Communicator& comm = *o.comm;
  // The native path keeps the reduction and the norm as separate steps, as a framework's default
  // MoE path does; the fused tiers use all_reduce_rms_norm.
  if (comm.size() > 1) comm.all_reduce_sum(t.latent_partial, backend.stream());
  // One rank: the shared partial is `out` itself (tail_tensors), so the up-projection adds into it.
  const bool into_shared = t.shared_partial.defined() && shared_partial_is_out(TailTier::native, o.parallel.tp_size);
  if (o.latent_norm.defined()) {
    backend.rms_norm_linear(t.latent_partial, o.latent_norm, o.eps, t.latent_reduced, o.up_proj, t.out, into_shared);
  } else {
    backend.linear(t.latent_partial, o.up_proj, t.out, into_shared);
  }
  if (into_shared) return;
  if (t.shared_partial.defined()) {
    if (comm.size() > 1) comm.all_reduce_sum(t.shared_partial, backend.stream());
    backend.add(t.out, t.shared_partial, t.out);
  }
}

// Columns [r d/tp, (r+1) d/tp) of the output, and the rows of W_up that make them.
int64_t shard_begin(const TailOperands& o) { return o.parallel.rank * (o.hidden_size / o.parallel.tp_size); }
int64_t shard_end(const TailOperands& o) { return (o.parallel.rank + 1) * (o.hidden_size / o.parallel.tp_size); }
TensorView up_proj_shard(const TailOperands& o) { return o.up_proj.slice_rows(shard_begin(o), shard_end(o)); }

void tail_fusion_tail(const TailOperands& o, const TailTensors& t) {
  Backend& backend = *o.backend;
  backend.tail_fusion_collective(*o.comm, t.latent_partial, t.shared_partial, o.latent_norm, o.eps, t.latent_reduced,
                                 t.hidden_shard);
  backend.up_projection_all_gather(*o.comm, t.latent_reduced, up_proj_shard(o), t.hidden_shard, t.out);
}

void allreduce_overlap_tail(const TailOperands& o, const TailTensors& t) {
  Backend& backend = *o.backend;
  backend.all_reduce_rms_norm(*o.comm, t.latent_partial, o.latent_norm, o.eps, t.latent_reduced);
  backend.run_overlapped([&] { backend.linear(t.latent_reduced, o.up_proj, t.out, /*accumulate=*/false); },
                         [&] { o.comm->all_reduce_sum(t.shared_partial, backend.stream()); });
  backend.add(t.out, t.shared_partial, t.out);
}

void column_parallel_tail(const TailOperands& o, const TailTensors& t) {
  Backend& backend = *o.backend;
  backend.all_reduce_rms_norm(*o.comm, t.latent_partial, o.latent_norm, o.eps, t.latent_reduced);
  // The shared partial is `out` itself (TailTensors), so the up-projection shard accumulates into it and
  // one all-reduce stitches the routed shards and the shared sum.
  backend.linear(t.latent_reduced, up_proj_shard(o), t.out.slice_cols(shard_begin(o), shard_end(o)),
                 /*accumulate=*/true);
  o.comm->all_reduce_sum(t.out, backend.stream());
}

}  // namespace

bool shared_partial_is_out(TailTier tier, int tp_size) {
  return tier == TailTier::column_parallel || (tier == TailTier::native && tp_size == 1);
}

TailTensors tail_tensors(const TailScratch& scratch, TailTier tier, int tp_size, const TensorView& out,
                         int64_t num_tokens) {
  TailTensors t;
  t.latent_partial = scratch.latent_partial.slice_rows(0, num_tokens);
  t.latent_reduced = scratch.latent_reduced.slice_rows(0, num_tokens);
  t.hidden_shard = scratch.hidden_shard.slice_rows(0, num_tokens);
  if (scratch.shared_partial.defined()) {
    t.shared_partial = shared_partial_is_out(tier, tp_size) ? out : scratch.shared_partial.slice_rows(0, num_tokens);
  }
  t.out = out;
  return t;
}

void run_tail(const TailOperands& operands, TailTier tier, const TailTensors& tensors) {
  switch (tier) {
    case TailTier::native:
      native_tail(operands, tensors);
      break;
    case TailTier::tail_fusion:
      tail_fusion_tail(operands, tensors);
      break;
    case TailTier::allreduce_overlap:
      allreduce_overlap_tail(operands, tensors);
      break;
    case TailTier::column_parallel:
      column_parallel_tail(operands, tensors);
      break;
  }
}

}  // namespace latentmoe::detail

// CudaBackend's fused collective steps of the tails: with a GPU group whose one-shot (Lamport) kernels
// run (Communicator::one_shot_kernels), the fused all-reduce + RMSNorm, tier 0's collective (the latent's
// all-reduce + norm and the shared partial's reduce-scatter in one kernel) and tier 0's up-projection
// pushing into the peers from its epilogue; otherwise the composed defaults of src/core/backend.h.
#include "cuda/backend/backend_state.h"
#include "cuda/comm/lamport_call.h"
#include "cuda/comm/lamport_communicator.h"
#include "cuda/gemm/dense_push_gemm.h"
#include "cuda/gemm/skinny_gemm.h"

namespace latentmoe::cuda {

namespace {

// The GPU group behind `comm` when its one-shot Lamport kernels run and can carry `dtype`, else nullptr.
LamportCommunicator* lamport_group(Communicator& comm, DType dtype) {
  LamportCommunicator* group = comm.one_shot_kernels();
  return group != nullptr && group->one_shot() && group->lamport_dtype() == dtype ? group : nullptr;
}

// Whether `call` fits the group's one-shot capacity; a group with another path (NCCL above the capacity)
// composes the step from its collectives otherwise. A group without one launches anyway and fails with
// the capacity Error (tier support keeps the runner inside the capacity).
bool one_shot_fits(const LamportCommunicator& group, const LamportCall& call) {
  const LamportPeers& peers = group.lamport_peers();
  return group.fallback_elements() == 0 || lamport_message_bytes(call, peers.size) <= peers.capacity_bytes;
}

// The fused all-reduce + RMSNorm (gamma undefined: the all-reduce alone) of `partial` into `out`.
LamportCall all_reduce_call(const TensorView& partial, const TensorView& gamma, float eps, const TensorView& out) {
  LamportCall call = make_lamport_call(LamportOp::all_reduce, partial, out);
  if (gamma.defined()) {
    call.gamma = gamma.data();
    call.gamma_dtype = gamma.dtype();
  }
  call.eps = eps;
  return call;
}

}  // namespace

void CudaBackend::all_reduce_rms_norm(Communicator& comm, const TensorView& partial, const TensorView& gamma, float eps,
                                      const TensorView& out) {
  LamportCommunicator* group = lamport_group(comm, partial.dtype());
  if (group == nullptr || !gamma.defined() || out.dtype() != partial.dtype()) {
    Backend::all_reduce_rms_norm(comm, partial, gamma, eps, out);
    return;
  }
  const LamportCall call = all_reduce_call(partial, gamma, eps, out);
  if (!one_shot_fits(*group, call)) {
    Backend::all_reduce_rms_norm(comm, partial, gamma, eps, out);
    return;
  }
  State& s = *state_;
  DeviceGuard guard(s.ordinal);
  group->launch(call, s.current);
}

void CudaBackend::tail_fusion_collective(Communicator& comm, const TensorView& latent_partial,
                                         const TensorView& shared_partial, const TensorView& gamma, float eps,
                                         const TensorView& latent_out, const TensorView& shared_shard_out) {
  LamportCommunicator* group = lamport_group(comm, latent_partial.dtype());
  if (group == nullptr || latent_out.dtype() != latent_partial.dtype() ||
      shared_partial.dtype() != latent_partial.dtype() || shared_shard_out.dtype() != latent_partial.dtype()) {
    Backend::tail_fusion_collective(comm, latent_partial, shared_partial, gamma, eps, latent_out, shared_shard_out);
    return;
  }
  LamportCall call = all_reduce_call(latent_partial, gamma, eps, latent_out);
  call.scatter_in = shared_partial.data();
  call.ld_scatter_in = shared_partial.stride(0);
  call.scatter_out = shared_shard_out.data();
  call.ld_scatter_out = shared_shard_out.stride(0);
  call.scatter_cols = shared_partial.size(1);
  if (!one_shot_fits(*group, call)) {
    Backend::tail_fusion_collective(comm, latent_partial, shared_partial, gamma, eps, latent_out, shared_shard_out);
    return;
  }
  State& s = *state_;
  DeviceGuard guard(s.ordinal);
  group->launch(call, s.current);
}

void CudaBackend::up_projection_all_gather(Communicator& comm, const TensorView& x, const TensorView& w_shard,
                                           const TensorView& shard, const TensorView& out) {
  State& s = *state_;
  LamportCommunicator* group = lamport_group(comm, out.dtype());
  const int64_t rows = x.size(0), latent = x.size(1);
  const bool pushable = group != nullptr && rows >= 1 && rows <= s.fused_up_projection_max_tokens &&
                        (s.fused_up_projection_max_latent < 0 || latent <= s.fused_up_projection_max_latent) &&
                        x.dtype() == out.dtype() && w_shard.dtype() == out.dtype() && shard.dtype() == out.dtype() &&
                        x.stride(1) == 1 && w_shard.stride(1) == 1 && shard.stride(1) == 1 && out.stride(1) == 1;
  // Which GEMM pushes: the skinny kernel where the decode dispatch finds it pays, else the tensor-core
  // kernel (dense_push_gemm.h) where the dispatch finds that one pays; a latent bound, when set, replaces
  // both rules (decode_dispatch.h).
  const bool bound_set = s.fused_up_projection_max_latent >= 0;
  const bool skinny =
      pushable && s.skinny(rows) && (bound_set || skinny_pays(*s.dispatch, SkinnyOp::tier0_push, rows, latent, 0)) &&
      skinny_supported(x.dtype(), rows, latent, {{x.data(), x.stride(0)}, {w_shard.data(), w_shard.stride(0)}});
  const DensePushProblem dense{out.dtype(),     x.data(), rows,         w_shard.data(),
                               w_shard.size(0), latent,   shard.data(), shard.stride(0)};
  const bool tensor_core = pushable && !skinny &&
                           (bound_set || latent <= s.dispatch->tier0_tensor_core_push_max_latent) &&
                           x.stride(0) == latent && w_shard.stride(0) == latent && dense_push_supported(dense);
  if (!skinny && !tensor_core) {
    Backend::up_projection_all_gather(comm, x, w_shard, shard, out);
    return;
  }
  // The receiving half, checked before the GEMM pushes anything.
  LamportCall gather = make_lamport_call(LamportOp::all_gather, TensorView(), out);
  gather.presend = true;
  const LamportPeers& peers = group->lamport_peers();
  if (!one_shot_fits(*group, gather)) {
    Backend::up_projection_all_gather(comm, x, w_shard, shard, out);
    return;
  }
  check_lamport_call(peers, gather);
  LATENTMOE_CHECK(
      shard.size(0) == rows && shard.size(1) * peers.size == out.size(1) && w_shard.size(0) == shard.size(1),
      "CUDA tier 0: up-projection shard ", w_shard.shape_string(), ", block ", shard.shape_string(), " and output ",
      out.shape_string(), " do not fit ", peers.size, " ranks");
  DeviceGuard guard(s.ordinal);
  // The GEMM's push is the all-gather's send; keep the two adjacent on the stream, each rank in step.
  if (skinny) {
    const SkinnyWeights weights{nullptr, w_shard.data(), w_shard.size(0), latent, w_shard.stride(0), 0};
    skinny_down(x.dtype(), SkinnyRouting{}, {x.data(), x.stride(0)}, rows, weights, shard.data(), shard.stride(0),
                /*accumulate=*/true, s.current, s.skinny_shape, &peers);
  } else {
    dense_push_gemm(dense, peers, s.push_buffer(), dense_push_workspace_bytes(), s.current);
  }
  group->launch(gather, s.current);
}

}  // namespace latentmoe::cuda

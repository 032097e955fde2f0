// The runner's private state, shared by runner.cpp (construction, validation) and layer_forward.cpp
// (the forward pass). The layer's own part (weights, parameters, tier support) is made at construction; the
// backend, the communicator and the scratch belong to the rank context (core/rank_context_state.h),
// whose buffers the layer views with its own shapes. forward() only reads and writes them.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>

#include "core/backend.h"
#include "core/rank_context_state.h"
#include "core/tails.h"
#include "latentmoe/rank_context.h"
#include "latentmoe/runner.h"

namespace latentmoe {

namespace detail {

// A tensor on the backend's device with the memory that backs it (undefined view: absent).
struct DeviceTensor {
  DeviceBuffer buffer;
  TensorView view;
};

struct RunnerState {
  RunnerState(const LayerConfig& config, const ParallelConfig& parallel, RankContext& context, const TierPolicy& policy)
      : config(config),
        parallel(parallel),
        context(&context),
        context_state(&RankContextAccess::state(context)),
        comm(context.communicator()),
        backend(context_state->backend.get()) {
    const RankContextOptions& context_options = context.options();
    options.backend = context_options.backend;
    options.policy = policy;
    options.max_tokens = context_options.max_tokens;
    options.device_ordinal = context_options.device_ordinal;
    options.host_staging = context_options.host_staging;
  }

  // Points the scratch views below at the context's buffers when they moved since the last binding
  // (another layer registered with the context). Makes views only: no allocation.
  void bind_scratch();

  // What the tails need of this layer (core/tails.h): the rank's backend and group, the replicated norm
  // and up-projection.
  TailOperands tail_operands() const {
    return {backend,
            &comm,
            parallel,
            config.hidden_size,
            latent_norm.view,
            up_proj.view,
            static_cast<float>(config.rms_norm_eps)};
  }

  FusedPathConditions fused_path_conditions() const {
    FusedPathConditions conditions;
    conditions.tp_size = parallel.tp_size;
    conditions.has_shared_expert = config.has_shared_expert();
    conditions.sequence_parallel = parallel.sequence_parallel;
    // partials_unreduced keeps its default (true): every rank's experts produce partial sums. What the
    // backend runs is in `support` (Backend::tier_support), not in tail_fusion_supported.
    return conditions;
  }

  // The private context of the constructors that take a communicator (null on a shared one). First,
  // so that it outlives the weights placed on its backend.
  std::unique_ptr<RankContext> owned_context;
  LayerConfig config;
  ParallelConfig parallel;
  RankContext* context;
  RankContextState* context_state;  // the context's backend and scratch, shared by its layers
  Communicator& comm;
  // The context's options and this layer's policy.
  RunnerOptions options;
  // How long forward_host and the local group wait for this rank's device work (host_wait_limit below).
  std::chrono::milliseconds host_wait_limit{0};
  // The structural requirements and the backend's report, made at construction (Runner::tier_support()).
  TierSupport support;
  DType dtype = DType::f32;
  Backend* backend;  // the context's
  RoutingParams routing;
  ActivationParams activation;

  // Weights on the device (this rank's shard).
  DeviceTensor gate, score_bias, down_proj, latent_norm, up_proj;
  DeviceTensor expert_gate, expert_up, expert_down;
  DeviceTensor expert_gate_scale, expert_up_scale, expert_down_scale;  // MXFP4 experts only
  DeviceTensor shared_gate, shared_up, shared_down;

  // Views of the context's scratch with this layer's shapes, [max_tokens, ...] (buffer empty: the
  // context owns the memory); forward uses their first T rows. Bound by bind_scratch().
  DeviceTensor logits;           // [max_T, E+Z] f32
  DeviceTensor topk_ids;         // [max_T, k] i32
  DeviceTensor topk_weights;     // [max_T, k] f32
  DeviceTensor zero_weight_sum;  // [max_T] f32
  DeviceTensor latent_in;        // [max_T, l]   z = x W_down^T
  DeviceTensor latent_partial;   // [max_T, l]   L_r
  DeviceTensor latent_reduced;   // [max_T, l]   Lhat = norm(AR(L_r))
  DeviceTensor shared_partial;   // [max_T, d]   S_r
  DeviceTensor hidden_shard;     // [max_T, d/tp] tier 0's reduce-scattered shared shard

  // forward_host's staging views (device backends with host_staging; the context's buffers).
  struct Staging {
    DeviceTensor hidden_states, router_logits, latent_states, output, topk_ids, topk_weights;
  };
  std::unique_ptr<Staging> staging;

  // This layer's view of each scratch buffer, and the context generation the views were bound at.
  std::array<ScratchShape, kNumScratch> scratch_shapes{};
  uint64_t bound_generation = 0;
  bool bound = false;
};

// The one way into a Runner's state (its friend): for the library's own modules (local_group.cpp) and
// the benchmark's door (src/bench_access.h).
struct RunnerAccess {
  static RunnerState& state(Runner& runner) { return *runner.impl_; }
};

// One weight on the backend's device: a host view is copied there, a view already on the device is
// used in place; undefined views stay undefined. `name` names it in the error for a GPU view on a CPU
// backend. (Runner and Tail construction.)
DeviceTensor place(Backend& backend, const TensorView& weight, const char* name);
// place() for MXFP4 expert codes declared in `order`: device views must be in the backend's order
// (Backend::mxfp4_code_order; Error naming the tensor and the conversion otherwise); host codes (canonical)
// copied to a backend whose kernels read the kernel order are converted there after the copy.
DeviceTensor place_mxfp4_codes(Backend& backend, const TensorView& codes, Mxfp4CodeOrder order, const char* name);

// Whether two tensors (contiguous, as check_tensor requires) share any byte of memory on one device.
bool tensors_overlap(const TensorView& a, const TensorView& b);

// Throws Error unless `tensor` is defined, of `shape` and `dtype`, contiguous, on `device` and has data
// (`name` names it). Allocates nothing on success (forward validates every call).
void check_tensor(const TensorView& tensor, const char* name, DType dtype, std::initializer_list<int64_t> shape,
                  Device device);

// How long a host waits for a rank's device work before it gives up: twice the communicator's collective
// timeout, or twice default_collective_timeout() (LATENTMOE_COLLECTIVE_TIMEOUT_MS) where it states none.
// Read once per runner, at construction (RunnerState::host_wait_limit).
std::chrono::milliseconds host_wait_limit(const Communicator& comm);
// Waits for the device work this rank has enqueued (its backend's streams), at most
// state.host_wait_limit: the one-shot kernels end themselves at their deadline, NCCL's collectives have
// none, so a collective that never completes would otherwise hold the host for ever. Past the limit it
// aborts the group (which stops the peers' waits and NCCL's in-flight operations) and throws Error naming
// the rank, `what` and the collectives it enqueued last.
void wait_for_device(RunnerState& state, const char* what);
// The same for any wait: `wait(limit)` returns whether the work completed within `limit`; past it,
// `comm` is aborted and the Error names `rank`, `what` and comm.recent_collectives().
void wait_or_abort(const std::function<bool(std::chrono::milliseconds)>& wait, std::chrono::milliseconds limit,
                   Communicator& comm, int rank, const char* what);

}  // namespace detail
}  // namespace latentmoe

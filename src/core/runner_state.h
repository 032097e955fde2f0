// The runner's private state, shared by runner.cpp (construction, validation) and tails.cpp (the
// forward pass). Everything here is sized at construction; forward() only reads and writes it.
#pragma once

#include <memory>

#include "core/backend.h"
#include "latentmoe/runner.h"

namespace latentmoe {

namespace detail {

// A tensor on the backend's device with the memory that backs it (undefined view: absent).
struct DeviceTensor {
  DeviceBuffer buffer;
  TensorView view;
};

struct RunnerState {
  RunnerState(const LayerConfig& config, const ParallelConfig& parallel, Communicator& comm,
              const RunnerOptions& options)
      : config(config), parallel(parallel), comm(comm), options(options) {}

  FusedPathConditions fused_path_conditions() const {
    FusedPathConditions conditions;
    conditions.tp_size = parallel.tp_size;
    conditions.has_shared_expert = config.has_shared_expert();
    conditions.sequence_parallel = parallel.sequence_parallel;
    // partials_unreduced keeps its default (true): every rank's experts produce partial sums. What the
    // backend runs is in `support` (Backend::tier_support), not in tail_fusion_supported.
    return conditions;
  }

  LayerConfig config;
  ParallelConfig parallel;
  Communicator& comm;
  RunnerOptions options;
  // The structural requirements and the backend's report, made at construction (Runner::tier_support()).
  TierSupport support;
  DType dtype = DType::f32;
  std::unique_ptr<Backend> backend;
  RoutingParams routing;
  ActivationParams activation;

  // Weights on the device (this rank's shard).
  DeviceTensor gate, score_bias, down_proj, latent_norm, up_proj;
  DeviceTensor expert_gate, expert_up, expert_down;
  DeviceTensor expert_gate_scale, expert_up_scale, expert_down_scale;  // MXFP4 experts only
  DeviceTensor shared_gate, shared_up, shared_down;

  // Workspaces sized for max_tokens rows; forward uses their first T rows.
  DeviceTensor logits;           // [max_T, E+Z] f32
  DeviceTensor topk_ids;         // [max_T, k] i32
  DeviceTensor topk_weights;     // [max_T, k] f32
  DeviceTensor zero_weight_sum;  // [max_T] f32
  DeviceTensor latent_in;        // [max_T, l]   z = x W_down^T
  DeviceTensor latent_partial;   // [max_T, l]   L_r
  DeviceTensor latent_reduced;   // [max_T, l]   Lhat = norm(AR(L_r))
  DeviceTensor shared_partial;   // [max_T, d]   S_r
  DeviceTensor hidden_shard;     // [max_T, d/tp] tier 0's reduce-scattered shared shard

  // forward_host's staging buffers (device backends with RunnerOptions::host_staging; made at construction).
  struct Staging {
    DeviceTensor hidden_states, router_logits, latent_states, output, topk_ids, topk_weights;
  };
  std::unique_ptr<Staging> staging;
};

}  // namespace detail
}  // namespace latentmoe

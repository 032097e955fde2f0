// Default implementations of the tails' collective steps (composed from the communicator and the
// backend's own operations) and the parameter structs derived from the config.
#include "core/backend.h"

#include <algorithm>
#include <string>

#include "latentmoe/device.h"
#include "latentmoe/error.h"
#include "latentmoe/runner.h"

namespace latentmoe::detail {

RoutingParams RoutingParams::from_config(const LayerConfig& config) {
  RoutingParams params;
  params.scoring = config.scoring;
  params.num_experts = config.num_experts;
  params.num_zero_experts = config.zero_expert_num;
  params.top_k = config.top_k;
  params.n_group = config.n_group;
  params.topk_group = config.topk_group;
  params.norm_topk_prob = config.norm_topk_prob;
  params.routed_scaling_factor = static_cast<float>(config.routed_scaling_factor);
  return params;
}

ActivationParams ActivationParams::from_config(const LayerConfig& config) {
  ActivationParams params;
  params.activation = config.activation;
  params.situ_beta = static_cast<float>(config.situ_beta);
  params.situ_linear_beta = static_cast<float>(config.situ_linear_beta);
  return params;
}

WorkspaceSpec WorkspaceSpec::for_layer(const LayerConfig& config, DType dtype, int64_t max_tokens, int tp_size) {
  LATENTMOE_CHECK(tp_size >= 1, "workspace spec: tp_size ", tp_size, " must be positive");
  WorkspaceSpec spec;
  spec.max_tokens = max_tokens;
  spec.element_size = dtype_size(dtype);
  spec.hidden_size = config.hidden_size;
  spec.num_experts = config.num_experts;
  spec.top_k = config.top_k;
  spec.latent_size = config.latent_size;
  spec.expert_intermediate = config.intermediate_size / tp_size;
  spec.dense_intermediate = config.has_shared_expert() ? config.shared_intermediate_size / tp_size : 0;
  return spec;
}

WorkspaceSpec WorkspaceSpec::max(const WorkspaceSpec& a, const WorkspaceSpec& b) {
  WorkspaceSpec spec;
  spec.max_tokens = std::max(a.max_tokens, b.max_tokens);
  spec.element_size = std::max(a.element_size, b.element_size);
  spec.hidden_size = std::max(a.hidden_size, b.hidden_size);
  spec.num_experts = std::max(a.num_experts, b.num_experts);
  spec.top_k = std::max(a.top_k, b.top_k);
  spec.latent_size = std::max(a.latent_size, b.latent_size);
  spec.expert_intermediate = std::max(a.expert_intermediate, b.expert_intermediate);
  spec.dense_intermediate = std::max(a.dense_intermediate, b.dense_intermediate);
  return spec;
}

bool WorkspaceSpec::covers(const WorkspaceSpec& other) const {
  return max_tokens >= other.max_tokens && element_size >= other.element_size && hidden_size >= other.hidden_size &&
         num_experts >= other.num_experts && top_k >= other.top_k && latent_size >= other.latent_size &&
         expert_intermediate >= other.expert_intermediate && dense_intermediate >= other.dense_intermediate;
}

void Backend::rms_norm_linear(const TensorView& in, const TensorView& gamma, float eps, const TensorView& normed,
                              const TensorView& w, const TensorView& y, bool accumulate) {
  rms_norm(in, gamma, eps, normed);
  linear(normed, w, y, accumulate);
}

void Backend::all_reduce_rms_norm(Communicator& comm, const TensorView& partial, const TensorView& gamma, float eps,
                                  const TensorView& out) {
  if (comm.size() > 1) comm.all_reduce_sum(partial, stream());
  if (gamma.defined()) {
    rms_norm(partial, gamma, eps, out);
  } else {
    copy(partial, out);
  }
}

void Backend::tail_fusion_collective(Communicator& comm, const TensorView& latent_partial,
                                     const TensorView& shared_partial, const TensorView& gamma, float eps,
                                     const TensorView& latent_out, const TensorView& shared_shard_out) {
  all_reduce_rms_norm(comm, latent_partial, gamma, eps, latent_out);
  comm.reduce_scatter_sum(shared_partial, shared_shard_out, stream());
}

void Backend::up_projection_all_gather(Communicator& comm, const TensorView& x, const TensorView& w_shard,
                                       const TensorView& shard, const TensorView& out) {
  linear(x, w_shard, shard, /*accumulate=*/true);
  comm.all_gather(shard, out, stream());
}

TierSupport Backend::tier_support(const LayerConfig& config, DType dtype, int tp_size, const Communicator& comm) const {
  TierSupport support;
  support.collectives = "the communicator's collectives, composed";
  return support;
}

void Backend::mxfp4_codes_to_kernel_order(const TensorView&) {
  throw_error("this backend reads MXFP4 codes in the canonical order: it has no kernel order to convert them to");
}

void Backend::run_overlapped(const std::function<void()>& main, const std::function<void()>& aux) {
  main();
  aux();
}

#ifndef LATENTMOE_WITH_CUDA
// Built without CUDA: no device, and asking for the backend is an error (src/cuda/backend/factory.cpp
// defines both otherwise).
std::unique_ptr<Backend> make_cuda_backend(int) {
  throw_error("the CUDA backend is not available: latentmoe was built without CUDA");
}
#endif

}  // namespace latentmoe::detail

#ifndef LATENTMOE_WITH_CUDA
namespace latentmoe {  // latentmoe/runner.h's device conversion without CUDA
void mxfp4_to_kernel_order(const TensorView&, StreamHandle) {
  detail::throw_error("mxfp4_to_kernel_order: latentmoe was built without CUDA (host codes stay canonical)");
}
}  // namespace latentmoe

namespace latentmoe {  // latentmoe/device.h without CUDA: no device
int cuda_device_count() noexcept { return 0; }
CudaDeviceProperties cuda_device_properties(int) {
  detail::throw_error("no CUDA device: latentmoe was built without CUDA");
}
std::string cuda_device_name(int) { detail::throw_error("no CUDA device: latentmoe was built without CUDA"); }
bool cuda_peer_access_between(int) noexcept { return false; }
}  // namespace latentmoe
#endif

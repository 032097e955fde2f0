// The runner: validation, weight placement and the binding of the rank context's scratch; forward
// validates its arguments and picks the tier, then runs the layer (layer_forward.cpp, whose tails are in
// tails.cpp), written once against the Backend interface.
#include "latentmoe/runner.h"

#include <array>
#include <chrono>
#include <string>

#include "core/backend.h"
#include "core/layer_forward.h"
#include "core/runner_state.h"
#include "latentmoe/error.h"
#include "latentmoe/gpu_group.h"

namespace latentmoe {

namespace detail {

DeviceTensor place(Backend& backend, const TensorView& weight, const char* name) {
  DeviceTensor placed;
  if (!weight.defined()) return placed;
  if (weight.device() == backend.device() && backend.device() != Device::cpu) {
    placed.view = weight;
    return placed;
  }
  LATENTMOE_CHECK(weight.device() == Device::cpu, "layer weights: ", name,
                  " is on a GPU but the runner's backend is on the CPU");
  placed.buffer = backend.allocate(static_cast<size_t>(weight.numel()) * dtype_size(weight.dtype()));
  placed.view = TensorView(placed.buffer.get(), weight.dtype(), weight.shape(), backend.device());
  backend.copy(weight, placed.view);
  return placed;
}

DeviceTensor place_mxfp4_codes(Backend& backend, const TensorView& codes, Mxfp4CodeOrder order, const char* name) {
  if (!codes.defined()) return {};
  const bool in_place = codes.device() == backend.device() && backend.device() != Device::cpu;
  const Mxfp4CodeOrder wanted = backend.mxfp4_code_order();
  // Host codes are canonical (validate_layer_weights refuses host views declared kernel).
  LATENTMOE_CHECK(!in_place || order == wanted, "layer weights: ", name, " holds MXFP4 codes on the GPU in the ",
                  to_string(order), " order but the CUDA kernels read the ", to_string(wanted), " order; ",
                  // Separate parts: an error message cuts each part at 200 characters (latentmoe/error.h).
                  "convert the tensor once in place with mxfp4_to_kernel_order (latentmoe/runner.h; C: ",
                  "lmoe_mxfp4_to_kernel_order, Python: latentmoe.mxfp4_to_kernel_order) ",
                  "and set LayerWeightViews::expert_code_order to kernel, ",
                  "or pass host codes (copied and converted)");
  DeviceTensor placed = place(backend, codes, name);
  if (!in_place && wanted != Mxfp4CodeOrder::canonical) backend.mxfp4_codes_to_kernel_order(placed.view);
  return placed;
}

bool tensors_overlap(const TensorView& a, const TensorView& b) {
  if (!a.defined() || !b.defined() || a.device() != b.device()) return false;
  const auto bytes = [](const TensorView& t) { return static_cast<uintptr_t>(t.numel()) * dtype_size(t.dtype()); };
  if (bytes(a) == 0 || bytes(b) == 0) return false;
  const auto begin_a = reinterpret_cast<uintptr_t>(a.data()), begin_b = reinterpret_cast<uintptr_t>(b.data());
  return begin_a < begin_b + bytes(b) && begin_b < begin_a + bytes(a);
}

void check_tensor(const TensorView& tensor, const char* name, DType dtype, std::initializer_list<int64_t> shape,
                  Device device) {
  LATENTMOE_CHECK(tensor.defined(), name, " is missing");
  // Compared in place: forward() validates every call, so the success path allocates nothing.
  bool same_shape = tensor.rank() == static_cast<int>(shape.size());
  int dim = 0;
  for (int64_t extent : shape) same_shape = same_shape && tensor.size(dim++) == extent;
  LATENTMOE_CHECK(same_shape, name, " has shape ", tensor.shape_string(), ", expected ",
                  TensorView(nullptr, dtype, shape).shape_string());
  LATENTMOE_CHECK(tensor.dtype() == dtype, name, " has dtype ", dtype_name(tensor.dtype()), ", expected ",
                  dtype_name(dtype));
  LATENTMOE_CHECK(tensor.is_contiguous(), name, " must be contiguous");
  LATENTMOE_CHECK(tensor.device() == device, name, " is on the ", device == Device::cpu ? "GPU" : "CPU",
                  " but the runner's backend is on the ", device == Device::cpu ? "CPU" : "GPU");
  LATENTMOE_CHECK(tensor.data() != nullptr || tensor.numel() == 0, name, " has no data");
}

}  // namespace detail

using detail::check_tensor;
using detail::Scratch;

Runner::Runner(const LayerConfig& config, const ParallelConfig& parallel, const LayerWeights& weights,
               Communicator& communicator, const RunnerOptions& options)
    : Runner(config, parallel, views_of(weights), communicator, options) {}

Runner::Runner(const LayerConfig& config, const ParallelConfig& parallel, const LayerWeightViews& weights,
               Communicator& communicator, const RunnerOptions& options) {
  // The layer's own checks first, as before the context existed (the first error a caller sees).
  config.validate();
  validate_parallel(config, parallel);
  RankContextOptions context_options;
  context_options.backend = options.backend;
  context_options.device_ordinal = options.device_ordinal;
  context_options.max_tokens = options.max_tokens;
  context_options.host_staging = options.host_staging;
  auto context = std::make_unique<RankContext>(parallel, communicator, context_options);
  RankContext& own = *context;
  construct(own, config, parallel, weights, options.policy, std::move(context));
}

Runner::Runner(RankContext& context, const LayerConfig& config, const ParallelConfig& parallel,
               const LayerWeights& weights, const TierPolicy& policy)
    : Runner(context, config, parallel, views_of(weights), policy) {}

Runner::Runner(RankContext& context, const LayerConfig& config, const ParallelConfig& parallel,
               const LayerWeightViews& weights, const TierPolicy& policy) {
  construct(context, config, parallel, weights, policy, nullptr);
}

void Runner::construct(RankContext& context, const LayerConfig& config, const ParallelConfig& parallel,
                       const LayerWeightViews& weights, const TierPolicy& policy, std::unique_ptr<RankContext> owned) {
  config.validate();
  validate_parallel(config, parallel);
  const ParallelConfig& own = context.parallel();
  LATENTMOE_CHECK(parallel.tp_size == own.tp_size && parallel.rank == own.rank &&
                      parallel.sequence_parallel == own.sequence_parallel,
                  "the layer is sharded for rank ", parallel.rank, " of tp ", parallel.tp_size,
                  parallel.sequence_parallel ? " (sequence parallel)" : "", " but its rank context is rank ", own.rank,
                  " of tp ", own.tp_size, own.sequence_parallel ? " (sequence parallel)" : "");
  LATENTMOE_CHECK(is_compute_dtype(weights.dtype), "weights dtype ", dtype_name(weights.dtype),
                  " is not a compute dtype (F32, BF16, F16)");
  validate_layer_weights(weights, config, parallel.tp_size);

  impl_ = std::make_unique<detail::RunnerState>(config, parallel, context, policy);
  detail::RunnerState& state = *impl_;
  // Held from here on, so that whatever is placed on its backend is released before it, even when a
  // later step throws.
  state.owned_context = std::move(owned);
  state.dtype = weights.dtype;
  detail::Backend& backend = *state.backend;
  state.routing = detail::RoutingParams::from_config(config);
  state.activation = detail::ActivationParams::from_config(config);
  // The backend's own limits (kernel limits, weight formats it cannot run) and the context's scratch
  // before any weight is copied to the device: a layer refused costs no device memory.
  backend.check_layer(config, state.dtype, parallel.tp_size);
  state.context_state->reserve(config, state.dtype);
  state.scratch_shapes = detail::scratch_shapes(config, state.dtype, state.options.max_tokens, parallel.tp_size);

  state.gate = detail::place(backend, weights.gate, "gate");
  state.score_bias = detail::place(backend, weights.score_bias, "score_bias");
  state.down_proj = detail::place(backend, weights.down_proj, "down_proj");
  state.latent_norm = detail::place(backend, weights.latent_norm, "latent_norm");
  state.up_proj = detail::place(backend, weights.up_proj, "up_proj");
  if (config.has_mxfp4_experts()) {
    // The codes in the order the backend's kernels read: copies converted on the device, views checked.
    const Mxfp4CodeOrder order = weights.expert_code_order;
    state.expert_gate = detail::place_mxfp4_codes(backend, weights.expert_gate, order, "expert_gate");
    state.expert_up = detail::place_mxfp4_codes(backend, weights.expert_up, order, "expert_up");
    state.expert_down = detail::place_mxfp4_codes(backend, weights.expert_down, order, "expert_down");
  } else {
    state.expert_gate = detail::place(backend, weights.expert_gate, "expert_gate");
    state.expert_up = detail::place(backend, weights.expert_up, "expert_up");
    state.expert_down = detail::place(backend, weights.expert_down, "expert_down");
  }
  state.expert_gate_scale = detail::place(backend, weights.expert_gate_scale, "expert_gate_scale");
  state.expert_up_scale = detail::place(backend, weights.expert_up_scale, "expert_up_scale");
  state.expert_down_scale = detail::place(backend, weights.expert_down_scale, "expert_down_scale");
  state.shared_gate = detail::place(backend, weights.shared_gate, "shared_gate");
  state.shared_up = detail::place(backend, weights.shared_up, "shared_up");
  state.shared_down = detail::place(backend, weights.shared_down, "shared_down");

  state.host_wait_limit = detail::host_wait_limit(state.comm);  // read here, never on a forward
  state.support = structural_tier_support(state.fused_path_conditions());
  state.support.restrict_to(backend.tier_support(config, state.dtype, parallel.tp_size, state.comm));
  if (state.context_state->has_staging()) state.staging = std::make_unique<detail::RunnerState::Staging>();
  state.bind_scratch();
  // forward may run on any stream of the caller's: the weights must be in place.
  backend.synchronize();
  ++state.context_state->num_layers;
}

Runner::~Runner() {
  if (impl_ != nullptr) --impl_->context_state->num_layers;
}

void detail::RunnerState::bind_scratch() {
  if (bound && bound_generation == context_state->generation) return;
  auto bind = [this](DeviceTensor& tensor, Scratch which) {
    tensor.view = context_state->view(which, scratch_shapes[static_cast<int>(which)]);
  };
  bind(logits, Scratch::logits);
  bind(topk_ids, Scratch::topk_ids);
  bind(topk_weights, Scratch::topk_weights);
  bind(zero_weight_sum, Scratch::zero_weight_sum);
  bind(latent_in, Scratch::latent_in);
  bind(latent_partial, Scratch::latent_partial);
  bind(latent_reduced, Scratch::latent_reduced);
  bind(shared_partial, Scratch::shared_partial);
  bind(hidden_shard, Scratch::hidden_shard);
  if (staging != nullptr) {
    bind(staging->hidden_states, Scratch::staging_hidden_states);
    bind(staging->router_logits, Scratch::staging_router_logits);
    bind(staging->latent_states, Scratch::staging_latent_states);
    bind(staging->output, Scratch::staging_output);
    bind(staging->topk_ids, Scratch::staging_topk_ids);
    bind(staging->topk_weights, Scratch::staging_topk_weights);
  }
  bound_generation = context_state->generation;
  bound = true;
}

DType Runner::dtype() const { return impl_->dtype; }
Device Runner::device() const { return impl_->backend->device(); }

const TierSupport& Runner::tier_support() const { return impl_->support; }

TailTier Runner::select_tier(int64_t num_tokens) const {
  return select_tail_tier(impl_->options.policy, impl_->support, num_tokens);
}

TailTier Runner::check_forward(const ForwardInputs& inputs, const ForwardOutputs& outputs) const {
  const detail::RunnerState& state = *impl_;
  const LayerConfig& config = state.config;
  const Device device = state.backend->device();
  const int64_t d = config.hidden_size, l = config.latent_size, k = config.top_k;

  LATENTMOE_CHECK(inputs.hidden_states.defined() && inputs.hidden_states.rank() == 2,
                  "hidden_states must be a rank-2 tensor [tokens, hidden_size]");
  const int64_t num_tokens = inputs.hidden_states.size(0);
  LATENTMOE_CHECK(num_tokens <= state.options.max_tokens, "forward got ", num_tokens,
                  " tokens but the runner was built for at most max_tokens = ", state.options.max_tokens);
  check_tensor(inputs.hidden_states, "hidden_states", state.dtype, {num_tokens, d}, device);
  if (inputs.router_logits.defined()) {
    check_tensor(inputs.router_logits, "router_logits", DType::f32, {num_tokens, config.num_router_outputs()}, device);
  } else {
    LATENTMOE_CHECK(state.gate.view.defined(),
                    "router_logits were not given and the weights have no gate.weight to compute them");
  }
  if (inputs.latent_states.defined()) {
    check_tensor(inputs.latent_states, "latent_states", state.dtype, {num_tokens, l}, device);
  }
  check_tensor(outputs.output, "output", state.dtype, {num_tokens, d}, device);
  if (outputs.topk_ids.defined()) check_tensor(outputs.topk_ids, "topk_ids", DType::i32, {num_tokens, k}, device);
  if (outputs.topk_weights.defined()) {
    check_tensor(outputs.topk_weights, "topk_weights", DType::f32, {num_tokens, k}, device);
  }

  // The output is written while the inputs are still read (the shared expert writes it beside the routed
  // experts in the column_parallel tier and on one rank), so it may not share memory with any of them.
  for (const auto& [name, input] : {std::pair<const char*, const TensorView&>{"hidden_states", inputs.hidden_states},
                                    {"router_logits", inputs.router_logits},
                                    {"latent_states", inputs.latent_states}}) {
    LATENTMOE_CHECK(!detail::tensors_overlap(outputs.output, input), "output shares memory with ", name,
                    "; the layer cannot run in place (give output a buffer of its own)");
  }

  // A forced tier and the policy's choice meet the same check: the policy stays inside the support,
  // so only a forced tier (or no tier at all) can fail it.
  const TailTier tier =
      inputs.tier.has_value() ? *inputs.tier : select_tail_tier(state.options.policy, state.support, num_tokens);
  state.support.check(tier, num_tokens);
  return tier;
}

TailTier Runner::forward(const ForwardInputs& inputs, const ForwardOutputs& outputs, StreamHandle stream) {
  detail::RunnerState& state = *impl_;
  const TailTier tier = check_forward(inputs, outputs);
  const int64_t num_tokens = inputs.hidden_states.size(0);
  if (num_tokens == 0) return tier;  // every rank sees the same T, so all skip the collectives together

  // From the first forward on, the context's buffers never move (graphs captured from it hold them).
  state.context_state->frozen = true;
  state.bind_scratch();

  // The caller's stream for this call only; the backend's own again afterwards, even on an error.
  struct StreamBinding {
    detail::Backend& backend;
    ~StreamBinding() { backend.bind_stream(nullptr); }
  } binding{*state.backend};
  state.backend->bind_stream(stream);
  detail::run_layer(state, inputs, outputs, tier, num_tokens);
  return tier;
}

}  // namespace latentmoe

namespace latentmoe {

std::chrono::milliseconds detail::host_wait_limit(const Communicator& comm) {
  const std::chrono::milliseconds own = comm.timeout();
  return 2 * (own.count() > 0 ? own : default_collective_timeout());
}

void detail::wait_or_abort(const std::function<bool(std::chrono::milliseconds)>& wait, std::chrono::milliseconds limit,
                           Communicator& comm, int rank, const char* what) {
  if (wait(limit)) return;
  comm.abort();
  const std::string recent = comm.recent_collectives();
  detail::throw_error("rank ", rank, ": ", what, " did not finish on the device within ", limit.count(),
                      " ms (twice the collective timeout): most likely a collective that never completed; the group "
                      "was aborted",
                      recent.empty() ? std::string() : "; this rank's last collectives, oldest first: " + recent);
}

void detail::wait_for_device(RunnerState& state, const char* what) {
  Backend& backend = *state.backend;
  wait_or_abort([&](std::chrono::milliseconds limit) { return backend.synchronize_for(limit); }, state.host_wait_limit,
                state.comm, state.parallel.rank, what);
}

TailTier Runner::forward_host(const ForwardInputs& inputs, const ForwardOutputs& outputs) {
  detail::RunnerState& state = *impl_;
  detail::Backend& backend = *state.backend;
  if (backend.device() == Device::cpu) return forward(inputs, outputs);

  const int64_t max_tokens = state.options.max_tokens;
  LATENTMOE_CHECK(
      state.staging != nullptr,
      "forward_host on a GPU runner needs RunnerOptions::host_staging (its buffers are made at construction)");
  state.context_state->frozen = true;
  state.bind_scratch();
  detail::RunnerState::Staging& staging = *state.staging;
  // Shapes and dtypes are checked by forward(); here only what staging needs.
  auto stage = [&](const TensorView& host, const detail::DeviceTensor& buffer, bool copy_in) -> TensorView {
    if (!host.defined()) return {};
    LATENTMOE_CHECK(host.device() == Device::cpu, "forward_host takes host tensors");
    LATENTMOE_CHECK(host.rank() == 2 && host.size(0) <= max_tokens && host.size(1) == buffer.view.size(1) &&
                        host.dtype() == buffer.view.dtype() && host.is_contiguous(),
                    "forward_host: input of shape ", host.shape_string(), " and dtype ", dtype_name(host.dtype()),
                    " does not fit ", buffer.view.shape_string(), " ", dtype_name(buffer.view.dtype()));
    TensorView device_view = buffer.view.slice_rows(0, host.size(0));
    if (copy_in) backend.copy(host, device_view);
    return device_view;
  };
  ForwardInputs device_inputs = inputs;
  device_inputs.hidden_states = stage(inputs.hidden_states, staging.hidden_states, true);
  device_inputs.router_logits = stage(inputs.router_logits, staging.router_logits, true);
  device_inputs.latent_states = stage(inputs.latent_states, staging.latent_states, true);
  ForwardOutputs device_outputs;
  device_outputs.output = stage(outputs.output, staging.output, false);
  device_outputs.topk_ids = stage(outputs.topk_ids, staging.topk_ids, false);
  device_outputs.topk_weights = stage(outputs.topk_weights, staging.topk_weights, false);
  const TailTier tier = forward(device_inputs, device_outputs);
  detail::wait_for_device(state, "the forward");
  backend.copy(device_outputs.output, outputs.output);
  state.comm.check();
  if (outputs.topk_ids.defined()) backend.copy(device_outputs.topk_ids, outputs.topk_ids);
  if (outputs.topk_weights.defined()) backend.copy(device_outputs.topk_weights, outputs.topk_weights);
  return tier;
}

}  // namespace latentmoe

// The tail alone (include/latentmoe/tail.h) on the machinery of the Runner's tails: the rank context's
// scratch for L_r, Lhat, S_r and tier 0's shard (registered like a layer's), and detail::run_tail over a
// TailTensors with the tail's TailOperands, exactly as a layer's forward runs it (core/layer_forward.cpp).
#include "latentmoe/tail.h"

#include <array>
#include <string>
#include <vector>

#include "core/rank_context_state.h"
#include "core/runner_state.h"
#include "core/tails.h"
#include "latentmoe/error.h"

namespace latentmoe {
namespace detail {

struct TailState {
  ParallelConfig parallel;
  LayerConfig config;  // the layer the tails see: d, l, the norm, a shared expert (tail_config)
  DType dtype = DType::f32;
  TierPolicy policy;
  int64_t max_tokens = 0;
  TierSupport support;
  RankContextState* context_state = nullptr;
  Communicator* comm = nullptr;
  DeviceTensor latent_norm, up_proj;
  // The scratch buffers as this tail sees them, and its views of them ([max_T, ...]), rebound when another
  // layer of the context moved the buffers (a new generation).
  std::array<ScratchShape, kNumScratch> shapes{};
  TensorView latent_partial, latent_reduced, shared_partial, hidden_shard;
  uint64_t bound_generation = 0;
  bool bound = false;

  void bind() {
    if (bound && bound_generation == context_state->generation) return;
    auto view = [this](Scratch which) { return context_state->view(which, shapes[static_cast<int>(which)]); };
    latent_partial = view(Scratch::latent_partial);
    latent_reduced = view(Scratch::latent_reduced);
    shared_partial = view(Scratch::shared_partial);
    hidden_shard = view(Scratch::hidden_shard);
    bound_generation = context_state->generation;
    bound = true;
  }

  TailOperands operands() const {
    return {context_state->backend.get(),           comm, parallel, config.hidden_size, latent_norm.view, up_proj.view,
            static_cast<float>(config.rms_norm_eps)};
  }

  // The tensors as the layer's forward takes them (core/tails.h): column_parallel's shared partial is `out`, and
  // native's on one rank.
  TailTensors tensors(TailTier tier, const TensorView& out, int64_t num_tokens) const {
    return tail_tensors(TailScratch{latent_partial, latent_reduced, shared_partial, hidden_shard}, tier,
                        parallel.tp_size, out, num_tokens);
  }
};

}  // namespace detail

namespace {

// The layer the tails see: d, l, the latent norm and its eps, and a shared expert. The caller's S_r is
// what the tails call the shared partial, so has_shared_expert() must hold (it decides the fused tiers and
// the widest collective a GPU group carries); no shared-expert weights exist and no step reads them.
LayerConfig tail_config(int64_t hidden_size, int64_t latent_size, bool latent_norm, float eps, int tp_size) {
  LayerConfig config;
  config.hidden_size = hidden_size;
  config.latent_size = latent_size;
  config.use_latent_norm = latent_norm;
  config.rms_norm_eps = eps;
  config.num_shared_experts = 1;
  config.shared_intermediate_size = tp_size;
  return config;
}

// The scratch a tail uses: L_r, Lhat, S_r and tier 0's shard of S_r. The routing and down-projection
// buffers and the host staging stay at zero bytes, so a tail never grows them.
std::array<detail::ScratchShape, detail::kNumScratch> tail_scratch(const LayerConfig& config, DType dtype,
                                                                   int64_t max_tokens, int tp_size) {
  using detail::Scratch;
  auto shapes = detail::scratch_shapes(config, dtype, max_tokens, tp_size);
  for (int i = 0; i < detail::kNumScratch; ++i) {
    const auto which = static_cast<Scratch>(i);
    const bool used = which == Scratch::latent_partial || which == Scratch::latent_reduced ||
                      which == Scratch::shared_partial || which == Scratch::hidden_shard;
    if (!used) shapes[i] = detail::ScratchShape{shapes[i].dtype, {0, 0}, 2};
  }
  return shapes;
}

FusedPathConditions tail_conditions(const ParallelConfig& parallel) {
  FusedPathConditions conditions;
  conditions.tp_size = parallel.tp_size;
  conditions.has_shared_expert = true;  // S_r is the caller's
  conditions.sequence_parallel = parallel.sequence_parallel;
  return conditions;
}

}  // namespace

void Tail::validate(int tp, int64_t hidden_size, int64_t latent_size, const TailWeights& weights, float eps,
                    DType dtype) {
  LATENTMOE_CHECK(hidden_size >= 1 && latent_size >= 1, "tail: hidden_size (", hidden_size, ") and latent_size (",
                  latent_size, ") must be positive");
  LATENTMOE_CHECK(tp >= 1 && hidden_size % tp == 0 && latent_size % tp == 0, "tail: tp ", tp,
                  " must divide hidden_size (", hidden_size, ") and latent_size (", latent_size, ")");
  LATENTMOE_CHECK(is_compute_dtype(dtype), "tail: dtype ", dtype_name(dtype),
                  " is not a compute dtype (F32, BF16, F16)");
  LATENTMOE_CHECK(eps > 0.0f, "tail: eps must be positive, got ", eps);
  LATENTMOE_CHECK(weights.up_proj.defined(), "tail: up_proj (W_up [", hidden_size, ", ", latent_size, "]) is missing");
  auto check_weight = [](const TensorView& weight, const char* name, DType expected_dtype,
                         std::initializer_list<int64_t> shape) {
    LATENTMOE_CHECK(weight.shape() == std::vector<int64_t>(shape), "tail: ", name, " has shape ", weight.shape_string(),
                    ", expected ", shape_string(std::vector<int64_t>(shape)));
    LATENTMOE_CHECK(weight.dtype() == expected_dtype, "tail: ", name, " has dtype ", dtype_name(weight.dtype()),
                    ", expected ", dtype_name(expected_dtype));
    LATENTMOE_CHECK(weight.is_contiguous(), "tail: ", name, " must be contiguous");
    LATENTMOE_CHECK(weight.data() != nullptr, "tail: ", name, " has no data");
  };
  check_weight(weights.up_proj, "up_proj", dtype, {hidden_size, latent_size});
  if (weights.latent_norm.defined()) check_weight(weights.latent_norm, "latent_norm", DType::f32, {latent_size});
}

Tail::Tail(RankContext& context, int64_t hidden_size, int64_t latent_size, const TailWeights& weights, float eps,
           DType dtype, const TierPolicy& policy) {
  const ParallelConfig& parallel = context.parallel();
  const int tp = parallel.tp_size;
  validate(tp, hidden_size, latent_size, weights, eps, dtype);
  auto state = std::make_unique<detail::TailState>();
  state->parallel = parallel;
  state->config = tail_config(hidden_size, latent_size, weights.latent_norm.defined(), eps, tp);
  state->dtype = dtype;
  state->policy = policy;
  state->max_tokens = context.options().max_tokens;
  state->context_state = &detail::RankContextAccess::state(context);
  state->comm = &context.communicator();
  detail::Backend& backend = *state->context_state->backend;
  state->shapes = tail_scratch(state->config, dtype, state->max_tokens, tp);
  // No backend workspace: the tails' steps (linear, rms_norm, add, copy and the collectives) need none.
  // The smallest element size, so that this spec never raises a layer's.
  detail::WorkspaceSpec no_workspace;
  no_workspace.element_size = 1;
  state->context_state->reserve(state->shapes, no_workspace,
                                "this tail (d " + std::to_string(hidden_size) + ", l " + std::to_string(latent_size) +
                                    ", " + std::string(dtype_name(dtype)) + ")");
  state->up_proj = detail::place(backend, weights.up_proj, "up_proj");
  state->latent_norm = detail::place(backend, weights.latent_norm, "latent_norm");
  state->support = structural_tier_support(tail_conditions(parallel));
  state->support.restrict_to(backend.tier_support(state->config, dtype, tp, *state->comm));
  state->bind();
  // forward may run on any stream of the caller's: the weights must be in place.
  backend.synchronize();
  ++state->context_state->num_layers;
  state_ = std::move(state);
}

Tail::~Tail() {
  if (state_ != nullptr) --state_->context_state->num_layers;
}

DType Tail::dtype() const { return state_->dtype; }
Device Tail::device() const { return state_->context_state->backend->device(); }
const TierSupport& Tail::tier_support() const { return state_->support; }

TailTier Tail::select_tier(int64_t num_tokens) const {
  return select_tail_tier(state_->policy, state_->support, num_tokens);
}

TailTier Tail::check_forward(const TensorView& shared_partial, const TensorView& latent_partial, const TensorView& out,
                             std::optional<TailTier> tier) const {
  const detail::TailState& state = *state_;
  const Device device = state.context_state->backend->device();
  const int64_t d = state.config.hidden_size, l = state.config.latent_size;
  LATENTMOE_CHECK(shared_partial.defined() && shared_partial.rank() == 2,
                  "shared_partial must be a rank-2 tensor [tokens, hidden_size]");
  const int64_t num_tokens = shared_partial.size(0);
  LATENTMOE_CHECK(num_tokens <= state.max_tokens, "tail got ", num_tokens,
                  " tokens but its rank context was built for at most max_tokens = ", state.max_tokens);
  detail::check_tensor(shared_partial, "shared_partial", state.dtype, {num_tokens, d}, device);
  detail::check_tensor(latent_partial, "latent_partial", state.dtype, {num_tokens, l}, device);
  detail::check_tensor(out, "out", state.dtype, {num_tokens, d}, device);
  const TailTier chosen = tier.has_value() ? *tier : select_tail_tier(state.policy, state.support, num_tokens);
  state.support.check(chosen, num_tokens);
  return chosen;
}

TailTier Tail::forward(const TensorView& shared_partial, const TensorView& latent_partial, const TensorView& out,
                       std::optional<TailTier> tier, StreamHandle stream) {
  detail::TailState& state = *state_;
  const TailTier chosen = check_forward(shared_partial, latent_partial, out, tier);
  const int64_t num_tokens = shared_partial.size(0);
  if (num_tokens == 0) return chosen;  // every rank sees the same T, so all skip the collectives together

  // From the first forward on, the context's buffers never move (graphs captured from it hold them).
  state.context_state->frozen = true;
  state.bind();
  detail::Backend& backend = *state.context_state->backend;
  struct StreamBinding {
    detail::Backend& backend;
    ~StreamBinding() { backend.bind_stream(nullptr); }
  } binding{backend};
  backend.bind_stream(stream);

  // The tiers reduce their partials in place (the native and overlapped all-reduces, and column_parallel
  // and one rank's native accumulate their up-projection into S_r held in `out`), so the caller's partials are copied
  // first, on the stream, where a layer's forward would have written them.
  const detail::TailTensors t = state.tensors(chosen, out, num_tokens);
  backend.copy(latent_partial, t.latent_partial);
  backend.copy(shared_partial, t.shared_partial);
  detail::run_tail(state.operands(), chosen, t);
  return chosen;
}

}  // namespace latentmoe

// The C ABI's layers (latentmoe::Runner) and tails (latentmoe::Tail): construction from this rank's weight
// views or a checkpoint, and the forward calls. A call first runs the library's own validation (the
// caller's input: LMOE_INVALID_ARGUMENT), then the work (anything failing there: LMOE_RUNTIME_ERROR).
#include <cstdint>
#include <string>
#include <utility>

#include "capi_internal.h"
#include "latentmoe/checkpoint.h"
#include "latentmoe/config.h"
#include "latentmoe/mxfp4.h"
#include "latentmoe/weights.h"

namespace latentmoe::capi {
namespace {

LayerConfig parse_config(const char* config_json) {
  require(config_json, "config_json");
  return as_invalid_argument([&] { return LayerConfig::from_json(config_json, "config"); });
}

LayerWeightViews weight_views(const lmoe_layer_weights& w, const Placement& placement) {
  require_struct(w.struct_size, sizeof(lmoe_layer_weights), "lmoe_layer_weights");
  LayerWeightViews views;
  views.dtype = dtype_from_code(w.dtype, "lmoe_layer_weights.dtype");
  auto view = [&](const lmoe_tensor& tensor, const char* name) { return view_of(&tensor, name, placement, true); };
  views.gate = view(w.gate, "gate");
  views.score_bias = view(w.score_bias, "score_bias");
  views.down_proj = view(w.down_proj, "down_proj");
  views.latent_norm = view(w.latent_norm, "latent_norm");
  views.up_proj = view(w.up_proj, "up_proj");
  views.expert_gate = view(w.expert_gate, "expert_gate");
  views.expert_up = view(w.expert_up, "expert_up");
  views.expert_down = view(w.expert_down, "expert_down");
  views.expert_gate_scale = view(w.expert_gate_scale, "expert_gate_scale");
  views.expert_up_scale = view(w.expert_up_scale, "expert_up_scale");
  views.expert_down_scale = view(w.expert_down_scale, "expert_down_scale");
  views.shared_gate = view(w.shared_gate, "shared_gate");
  views.shared_up = view(w.shared_up, "shared_up");
  views.shared_down = view(w.shared_down, "shared_down");
  // The experts' format follows what the tensors are: U8 codes are MXFP4 (validate_layer_weights then
  // holds them against the config's quantization_config).
  views.experts_format = views.expert_up.defined() && views.expert_up.dtype() == DType::u8 ? ExpertWeightFormat::mxfp4
                                                                                           : ExpertWeightFormat::dense;
  switch (w.expert_code_order) {
    case LMOE_MXFP4_ORDER_CANONICAL:
      views.expert_code_order = Mxfp4CodeOrder::canonical;
      break;
    case LMOE_MXFP4_ORDER_KERNEL:
      views.expert_code_order = Mxfp4CodeOrder::kernel;
      break;
    default:
      throw InvalidArgument("lmoe_layer_weights.expert_code_order: unknown code " +
                            std::to_string(w.expert_code_order) +
                            " (LMOE_MXFP4_ORDER_CANONICAL 0 or LMOE_MXFP4_ORDER_KERNEL 1)");
  }
  return views;
}

// The stream a call runs on. The Runner and Tail take nullptr as "the context's own stream", while the C
// ABI's 0 is CUDA's legacy default stream (PyTorch's default), so 0 becomes cudaStreamLegacy. Ranks
// simulated on one GPU must not share a stream: their collectives wait for one another.
StreamHandle stream_for(const ContextState& state, void* stream) {
  if (state.placement.device != Device::cuda) return nullptr;
  // cudaStreamLegacy, as driver_types.h defines it; this file includes no CUDA header.
  void* const legacy = reinterpret_cast<void*>(uintptr_t{0x1});
  if (stream == nullptr) stream = legacy;
  if (state.parallel.tp_size > 1 && state.group != nullptr && state.group->simulated_gpu && stream == legacy) {
    throw InvalidArgument(
        "ranks simulated on one GPU must each run on a stream of their own (e.g. a torch.cuda.Stream per rank "
        "thread), not the default stream: their collectives wait for one another");
  }
  return stream;
}

template <class Handle>
void check_handle(const Handle* handle, const char* what) {
  require(handle, what);
}

}  // namespace
}  // namespace latentmoe::capi

using namespace latentmoe;
using namespace latentmoe::capi;

namespace {

lmoe_layer* make_layer(const std::shared_ptr<ContextState>& state, const LayerConfig& config,
                       const LayerWeightViews& views, const lmoe_tier_policy* policy) {
  const ParallelConfig& parallel = state->parallel;
  as_invalid_argument([&] {
    validate_parallel(config, parallel);
    validate_layer_weights(views, config, parallel.tp_size);
  });
  // The Runner refuses MXFP4 codes on the GPU in the canonical order too; here the refusal is the caller's input.
  if (views.experts_format == ExpertWeightFormat::mxfp4 && views.expert_code_order == Mxfp4CodeOrder::canonical) {
    for (const auto& [name, codes] : {std::pair<const char*, const TensorView&>{"expert_gate", views.expert_gate},
                                      {"expert_up", views.expert_up},
                                      {"expert_down", views.expert_down}}) {
      if (!codes.defined() || codes.device() != Device::cuda) continue;
      throw InvalidArgument(std::string("lmoe_layer_weights.") + name +
                            ": MXFP4 codes on the GPU in the canonical order; the CUDA kernels read the kernel "
                            "order: convert the tensor once with lmoe_mxfp4_to_kernel_order and set "
                            "expert_code_order to LMOE_MXFP4_ORDER_KERNEL (or pass host codes)");
    }
  }
  const std::string device = state->policy_device();
  const TierPolicy tier_policy = as_invalid_argument([&] {
    return policy_for(policy, parallel.tp_size, views.dtype, config.hidden_size, config.latent_size, device);
  });
  RankContext& context = state->ensure(views.dtype, config.hidden_size + config.latent_size);
  auto layer = std::make_unique<lmoe_layer>();
  layer->context = state;
  layer->runner = std::make_unique<Runner>(context, config, parallel, views, tier_policy);
  layer->hidden_size = config.hidden_size;
  layer->latent_size = config.latent_size;
  layer->top_k = config.top_k;
  layer->num_router_outputs = config.num_router_outputs();
  layer->has_gate = views.gate.defined();
  return layer.release();
}

// The compute dtype of a checkpoint: that of its latent down-projection (either alias).
DType checkpoint_dtype(const Checkpoint& checkpoint, const std::string& prefix) {
  const SafetensorsEntry* entry = checkpoint.find(prefix + "routed_expert_down_proj.weight");
  if (entry == nullptr) entry = checkpoint.find(prefix + "fc1_latent_proj.weight");
  if (entry == nullptr) {
    throw InvalidArgument(checkpoint.path() + ": missing tensor " + prefix + "routed_expert_down_proj.weight (or " +
                          prefix + "fc1_latent_proj.weight), whose dtype would be the layer's");
  }
  if (!is_compute_dtype(entry->dtype)) {
    throw InvalidArgument(checkpoint.path() + ": tensor " + entry->name + " has dtype " +
                          std::string(dtype_name(entry->dtype)) + "; weights must be F32, BF16 or F16");
  }
  return entry->dtype;
}

// The tier queries of a Runner or a Tail (`what` names the handle in the error when it is NULL).
template <class Model>
int select_tier_of(const Model* model, const char* what, int64_t num_tokens, int32_t* tier) {
  return guarded([&] {
    require(model, what);
    require(tier, "tier");
    *tier = tier_code(model->select_tier(num_tokens));
  });
}

template <class Model>
int describe_tiers_of(const Model* model, const char* what, char* out, size_t out_size, size_t* needed) {
  return guarded([&] {
    require(model, what);
    write_text(describe_tiers(model->tier_support()), out, out_size, needed);
  });
}

void write_info(const lmoe_layer& layer, lmoe_layer_info* info) {
  require(info, "info");
  require_struct(info->struct_size, sizeof(lmoe_layer_info), "lmoe_layer_info");
  const ContextState& state = *layer.context;
  info->dtype = dtype_code(layer.runner->dtype());
  info->device_type = state.placement.device == Device::cpu ? LMOE_DEVICE_CPU : LMOE_DEVICE_CUDA;
  info->device_index = state.placement.index;
  info->has_gate = layer.has_gate ? 1 : 0;
  info->hidden_size = layer.hidden_size;
  info->latent_size = layer.latent_size;
  info->top_k = layer.top_k;
  info->num_router_outputs = layer.num_router_outputs;
  info->max_tokens = state.max_tokens;
}

}  // namespace

extern "C" {

int lmoe_layer_create(lmoe_context* context, const char* config_json, const lmoe_layer_weights* weights,
                      const lmoe_tier_policy* policy, lmoe_layer** out) {
  return guarded([&] {
    require(out, "out");
    *out = nullptr;
    check_handle(context, "context");
    require(weights, "weights");
    const LayerConfig config = parse_config(config_json);
    const LayerWeightViews views = weight_views(*weights, context->state->placement);
    *out = make_layer(context->state, config, views, policy);
  });
}

int lmoe_mxfp4_to_kernel_order(const lmoe_tensor* codes, void* stream) {
  return guarded([&] {
    require(codes, "codes");
    const TensorView view = as_invalid_argument([&] {
      const Placement placement{Device::cuda, codes->device_index};
      const TensorView v = view_of(codes, "codes", placement, true);
      if (!v.defined()) throw InvalidArgument("lmoe_mxfp4_to_kernel_order: codes has no dimensions (ndim 0)");
      if (v.dtype() != DType::u8) {
        throw InvalidArgument(std::string("lmoe_mxfp4_to_kernel_order: MXFP4 codes are U8, not ") +
                              std::string(dtype_name(v.dtype())));
      }
      if (v.device() != Device::cuda) {
        throw InvalidArgument(
            "lmoe_mxfp4_to_kernel_order: the codes are on the host; host codes stay in the canonical order (a "
            "layer converts the codes it copies to the GPU)");
      }
      if (v.numel() % 4 != 0) {
        throw InvalidArgument("lmoe_mxfp4_to_kernel_order: " + std::to_string(v.numel()) +
                              " bytes of codes is not a whole number of 32-bit words (8 codes each)");
      }
      return v;
    });
    mxfp4_to_kernel_order(view, stream);
  });
}

int lmoe_layer_load(lmoe_context* context, const char* config_json, const char* path, const char* prefix, int32_t dtype,
                    const lmoe_tier_policy* policy, lmoe_layer** out) {
  return guarded([&] {
    require(out, "out");
    *out = nullptr;
    check_handle(context, "context");
    require(path, "path");
    const std::string name_prefix = prefix == nullptr ? "" : prefix;
    const LayerConfig config = parse_config(config_json);
    const ParallelConfig& parallel = context->state->parallel;
    as_invalid_argument([&] { validate_parallel(config, parallel); });
    // A file that is missing, malformed, or lacks a tensor, or holds one of the wrong shape, is the
    // caller's input: the loader's messages name the file and the tensor.
    const LayerWeights loaded = as_invalid_argument([&] {
      const Checkpoint checkpoint = Checkpoint::open(path);
      const DType compute =
          dtype == LMOE_DTYPE_AUTO ? checkpoint_dtype(checkpoint, name_prefix) : dtype_from_code(dtype, "dtype");
      return load_layer_weights(checkpoint, config, name_prefix, parallel, compute);
    });
    // The runner copies the host shard to its device; the loaded tensors go when this returns.
    *out = make_layer(context->state, config, views_of(loaded), policy);
  });
}

int lmoe_layer_destroy(lmoe_layer* layer) {
  return guarded([&] { delete layer; });
}

int lmoe_layer_get_info(const lmoe_layer* layer, lmoe_layer_info* info) {
  return guarded([&] {
    check_handle(layer, "layer");
    write_info(*layer, info);
  });
}

int lmoe_layer_select_tier(const lmoe_layer* layer, int64_t num_tokens, int32_t* tier) {
  return select_tier_of(layer == nullptr ? nullptr : layer->runner.get(), "layer", num_tokens, tier);
}

int lmoe_layer_describe_tiers(const lmoe_layer* layer, char* out, size_t out_size, size_t* needed) {
  return describe_tiers_of(layer == nullptr ? nullptr : layer->runner.get(), "layer", out, out_size, needed);
}

int lmoe_layer_forward(lmoe_layer* layer, const lmoe_tensor* hidden_states, const lmoe_tensor* router_logits,
                       const lmoe_tensor* latent_states, const lmoe_tensor* output, const lmoe_tensor* topk_ids,
                       const lmoe_tensor* topk_weights, int32_t tier, void* stream, int32_t* tier_run) {
  return guarded([&] {
    check_handle(layer, "layer");
    const ContextState& state = *layer->context;
    const Placement& at = state.placement;
    ForwardInputs inputs;
    inputs.hidden_states = view_of(hidden_states, "hidden_states", at, false);
    inputs.router_logits = view_of(router_logits, "router_logits", at, false);
    inputs.latent_states = view_of(latent_states, "latent_states", at, false);
    inputs.tier = tier_from_code(tier);
    ForwardOutputs outputs;
    outputs.output = view_of(output, "output", at, false);
    outputs.topk_ids = view_of(topk_ids, "topk_ids", at, false);
    outputs.topk_weights = view_of(topk_weights, "topk_weights", at, false);
    const StreamHandle bound = stream_for(state, stream);
    inputs.tier = as_invalid_argument([&] { return layer->runner->check_forward(inputs, outputs); });
    const TailTier ran = layer->runner->forward(inputs, outputs, bound);
    if (tier_run != nullptr) *tier_run = tier_code(ran);
  });
}

int lmoe_tail_create(lmoe_context* context, int64_t hidden_size, int64_t latent_size, const lmoe_tensor* latent_norm,
                     const lmoe_tensor* up_proj, double eps, int32_t dtype, const lmoe_tier_policy* policy,
                     lmoe_tail** out) {
  return guarded([&] {
    require(out, "out");
    *out = nullptr;
    check_handle(context, "context");
    const std::shared_ptr<ContextState>& state = context->state;
    TailWeights weights;
    weights.latent_norm = view_of(latent_norm, "latent_norm", state->placement, true);
    weights.up_proj = view_of(up_proj, "up_proj", state->placement, true);
    const DType compute = dtype_from_code(dtype, "dtype");
    const int tp = state->parallel.tp_size;
    as_invalid_argument(
        [&] { Tail::validate(tp, hidden_size, latent_size, weights, static_cast<float>(eps), compute); });
    const std::string device = state->policy_device();
    const TierPolicy tier_policy =
        as_invalid_argument([&] { return policy_for(policy, tp, compute, hidden_size, latent_size, device); });
    RankContext& rank_context = state->ensure(compute, hidden_size + latent_size);
    auto tail = std::make_unique<lmoe_tail>();
    tail->context = state;
    tail->tail = std::make_unique<Tail>(rank_context, hidden_size, latent_size, weights, static_cast<float>(eps),
                                        compute, tier_policy);
    tail->hidden_size = hidden_size;
    tail->latent_size = latent_size;
    *out = tail.release();
  });
}

int lmoe_tail_destroy(lmoe_tail* tail) {
  return guarded([&] { delete tail; });
}

int lmoe_tail_select_tier(const lmoe_tail* tail, int64_t num_tokens, int32_t* tier) {
  return select_tier_of(tail == nullptr ? nullptr : tail->tail.get(), "tail", num_tokens, tier);
}

int lmoe_tail_describe_tiers(const lmoe_tail* tail, char* out, size_t out_size, size_t* needed) {
  return describe_tiers_of(tail == nullptr ? nullptr : tail->tail.get(), "tail", out, out_size, needed);
}

int lmoe_tail_forward(lmoe_tail* tail, const lmoe_tensor* shared_partial, const lmoe_tensor* latent_partial,
                      const lmoe_tensor* out, int32_t tier, void* stream, int32_t* tier_run) {
  return guarded([&] {
    check_handle(tail, "tail");
    const ContextState& state = *tail->context;
    const Placement& at = state.placement;
    const TensorView shared = view_of(shared_partial, "shared_partial", at, false);
    const TensorView latent = view_of(latent_partial, "latent_partial", at, false);
    const TensorView output = view_of(out, "out", at, false);
    const StreamHandle bound = stream_for(state, stream);
    const std::optional<TailTier> forced = tier_from_code(tier);
    const TailTier chosen =
        as_invalid_argument([&] { return tail->tail->check_forward(shared, latent, output, forced); });
    const TailTier ran = tail->tail->forward(shared, latent, output, chosen, bound);
    if (tier_run != nullptr) *tier_run = tier_code(ran);
  });
}

}  // extern "C"

// The per-rank execution context: the backend and the scratch shared by the layers of one rank.
#include "latentmoe/rank_context.h"

#include <algorithm>

#include "core/rank_context_state.h"
#include "latentmoe/device.h"
#include "latentmoe/error.h"

namespace latentmoe {

std::string_view to_string(BackendKind kind) {
  switch (kind) {
    case BackendKind::automatic:
      return "auto";
    case BackendKind::cpu:
      return "cpu";
    case BackendKind::cuda:
      return "cuda";
  }
  return "?";
}

BackendKind parse_backend_kind(std::string_view name) {
  if (name == "auto") return BackendKind::automatic;
  if (name == "cpu") return BackendKind::cpu;
  if (name == "cuda") return BackendKind::cuda;
  detail::throw_error("unknown backend '", name, "' (expected auto, cpu or cuda)");
}

BackendKind resolve_backend_kind(BackendKind kind) {
  if (kind == BackendKind::automatic) return cuda_device_count() > 0 ? BackendKind::cuda : BackendKind::cpu;
#ifndef LATENTMOE_WITH_CUDA
  LATENTMOE_CHECK(kind != BackendKind::cuda, "the CUDA backend is not available: latentmoe was built without CUDA");
#else
  LATENTMOE_CHECK(kind != BackendKind::cuda || cuda_device_count() > 0,
                  "the CUDA backend is not available: no CUDA device was found");
#endif
  return kind;
}

namespace detail {

namespace {

std::unique_ptr<Backend> make_backend(BackendKind kind, const ParallelConfig& parallel, int device_ordinal) {
  switch (resolve_backend_kind(kind)) {
    case BackendKind::cpu:
      return make_cpu_backend();
    case BackendKind::cuda: {
      const int num_devices = cuda_device_count();
      const int device = device_ordinal >= 0 ? device_ordinal : parallel.rank % num_devices;
      LATENTMOE_CHECK(device < num_devices, "CUDA device ", device, " does not exist (", num_devices, " found)");
      return make_cuda_backend(device);
    }
    case BackendKind::automatic:
      break;
  }
  throw_error("internal: unresolved backend kind");
}

const char* scratch_name(Scratch which) {
  static constexpr const char* kNames[kNumScratch] = {"logits",
                                                      "topk_ids",
                                                      "topk_weights",
                                                      "zero_weight_sum",
                                                      "latent_in",
                                                      "latent_partial",
                                                      "latent_reduced",
                                                      "shared_partial",
                                                      "hidden_shard",
                                                      "staging hidden_states",
                                                      "staging router_logits",
                                                      "staging latent_states",
                                                      "staging output",
                                                      "staging topk_ids",
                                                      "staging topk_weights"};
  return kNames[static_cast<int>(which)];
}

}  // namespace

size_t ScratchShape::bytes() const {
  int64_t count = 1;
  for (int dim = 0; dim < rank; ++dim) count *= shape[dim];
  return static_cast<size_t>(count) * dtype_size(dtype);
}

std::array<ScratchShape, kNumScratch> scratch_shapes(const LayerConfig& config, DType dtype, int64_t max_tokens,
                                                     int tp_size) {
  const int64_t d = config.hidden_size, l = config.latent_size, k = config.top_k;
  const int64_t outputs = config.num_router_outputs();
  auto shape = [](DType type, int64_t rows, int64_t cols) { return ScratchShape{type, {rows, cols}, 2}; };
  std::array<ScratchShape, kNumScratch> shapes;
  auto at = [&shapes](Scratch which) -> ScratchShape& { return shapes[static_cast<int>(which)]; };
  at(Scratch::logits) = shape(DType::f32, max_tokens, outputs);
  at(Scratch::topk_ids) = shape(DType::i32, max_tokens, k);
  at(Scratch::topk_weights) = shape(DType::f32, max_tokens, k);
  at(Scratch::zero_weight_sum) = ScratchShape{DType::f32, {max_tokens, 0}, 1};
  at(Scratch::latent_in) = shape(dtype, max_tokens, l);
  at(Scratch::latent_partial) = shape(dtype, max_tokens, l);
  at(Scratch::latent_reduced) = shape(dtype, max_tokens, l);
  at(Scratch::shared_partial) = shape(dtype, max_tokens, d);
  at(Scratch::hidden_shard) = shape(dtype, max_tokens, d / tp_size);
  at(Scratch::staging_hidden_states) = shape(dtype, max_tokens, d);
  at(Scratch::staging_router_logits) = shape(DType::f32, max_tokens, outputs);
  at(Scratch::staging_latent_states) = shape(dtype, max_tokens, l);
  at(Scratch::staging_output) = shape(dtype, max_tokens, d);
  at(Scratch::staging_topk_ids) = shape(DType::i32, max_tokens, k);
  at(Scratch::staging_topk_weights) = shape(DType::f32, max_tokens, k);
  return shapes;
}

void RankContextState::reserve(const LayerConfig& config, DType dtype) {
  reserve(scratch_shapes(config, dtype, options.max_tokens, parallel.tp_size),
          WorkspaceSpec::for_layer(config, dtype, options.max_tokens, parallel.tp_size),
          "this layer (d " + std::to_string(config.hidden_size) + ", l " + std::to_string(config.latent_size) + ", E " +
              std::to_string(config.num_experts) + ", " + std::string(dtype_name(dtype)) + ")");
}

void RankContextState::reserve(const std::array<ScratchShape, kNumScratch>& shapes, const WorkspaceSpec& layer_spec,
                               const std::string& what_needs) {
  const int num_buffers = has_staging() ? kNumScratch : kNumScratch - kNumStaging;
  bool grow_spec = !prepared || !spec.covers(layer_spec);
  bool grow_scratch = false;
  for (int i = 0; i < num_buffers; ++i) grow_scratch = grow_scratch || shapes[i].bytes() > scratch[i].bytes();
  if (!grow_spec && !grow_scratch) return;
  if (frozen) {
    // Name the first thing that does not fit, so that the engine sees which layer shape is the larger.
    std::string what = "the backend's workspaces";
    for (int i = 0; i < num_buffers; ++i) {
      if (shapes[i].bytes() > scratch[i].bytes()) {
        what = std::string("the ") + scratch_name(static_cast<Scratch>(i)) + " scratch (" +
               std::to_string(shapes[i].bytes()) + " bytes, the context holds " + std::to_string(scratch[i].bytes()) +
               ")";
        break;
      }
    }
    throw_error("construct every layer before the first forward: ", what_needs, " needs more of ", what, " than rank ",
                parallel.rank,
                "'s context holds, and growing it now would move buffers that "
                "earlier forwards (and CUDA graphs captured from them) use");
  }
  if (grow_spec) {
    const WorkspaceSpec grown = prepared ? WorkspaceSpec::max(spec, layer_spec) : layer_spec;
    backend->prepare(grown);
    spec = grown;
    prepared = true;
  }
  for (int i = 0; i < num_buffers; ++i) {
    const size_t bytes = shapes[i].bytes();
    if (bytes <= scratch[i].bytes()) continue;
    scratch[i] = {};  // release first: the old and the new buffer need not coexist
    scratch[i] = backend->allocate(std::max<size_t>(bytes, 1));
  }
  ++generation;
}

TensorView RankContextState::view(Scratch which, const ScratchShape& shape) const {
  void* data = scratch[static_cast<int>(which)].get();
  if (shape.rank == 1) return TensorView(data, shape.dtype, {shape.shape[0]}, backend->device());
  return TensorView(data, shape.dtype, {shape.shape[0], shape.shape[1]}, backend->device());
}

}  // namespace detail

RankContext::RankContext(const ParallelConfig& parallel, Communicator& communicator, const RankContextOptions& options)
    : impl_(std::make_unique<detail::RankContextState>(parallel, communicator, options)) {
  LATENTMOE_CHECK(parallel.tp_size >= 1, "tp must be >= 1, got ", parallel.tp_size);
  LATENTMOE_CHECK(parallel.rank >= 0 && parallel.rank < parallel.tp_size, "rank ", parallel.rank,
                  " is outside [0, tp = ", parallel.tp_size, ")");
  LATENTMOE_CHECK(communicator.size() == parallel.tp_size && communicator.rank() == parallel.rank,
                  "the communicator is rank ", communicator.rank(), " of ", communicator.size(),
                  " but the parallel config is rank ", parallel.rank, " of ", parallel.tp_size);
  LATENTMOE_CHECK(options.max_tokens >= 1, "max_tokens must be at least 1, got ", options.max_tokens);
  impl_->backend = detail::make_backend(options.backend, parallel, options.device_ordinal);
}

RankContext::~RankContext() = default;

const ParallelConfig& RankContext::parallel() const { return impl_->parallel; }
Communicator& RankContext::communicator() const { return impl_->comm; }
const RankContextOptions& RankContext::options() const { return impl_->options; }
Device RankContext::device() const { return impl_->backend->device(); }
int RankContext::num_layers() const { return impl_->num_layers; }
bool RankContext::frozen() const { return impl_->frozen; }

size_t RankContext::scratch_bytes() const {
  size_t total = 0;
  for (const detail::DeviceBuffer& buffer : impl_->scratch) total += buffer.bytes();
  return total;
}

}  // namespace latentmoe

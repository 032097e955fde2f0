// The rank context's private state (include/latentmoe/rank_context.h): the backend and the scratch
// every layer of the rank shares, sized for the largest layer registered.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "core/backend.h"
#include "latentmoe/config.h"
#include "latentmoe/rank_context.h"

namespace latentmoe::detail {

// The shared per-forward buffers. A layer views each with its own dtype and shape (scratch_shapes).
enum class Scratch : int {
  logits,           // [max_T, E+Z] f32
  topk_ids,         // [max_T, k] i32
  topk_weights,     // [max_T, k] f32
  zero_weight_sum,  // [max_T] f32
  latent_in,        // [max_T, l]   z = x W_down^T
  latent_partial,   // [max_T, l]   L_r
  latent_reduced,   // [max_T, l]   Lhat = norm(AR(L_r))
  shared_partial,   // [max_T, d]   S_r
  hidden_shard,     // [max_T, d/tp] tier 0's reduce-scattered shared shard
  // forward_host's staging (GPU backends with host_staging only).
  staging_hidden_states,  // [max_T, d]
  staging_router_logits,  // [max_T, E+Z] f32
  staging_latent_states,  // [max_T, l]
  staging_output,         // [max_T, d]
  staging_topk_ids,       // [max_T, k] i32
  staging_topk_weights,   // [max_T, k] f32
  count
};
constexpr int kNumScratch = static_cast<int>(Scratch::count);
constexpr int kNumStaging = kNumScratch - static_cast<int>(Scratch::staging_hidden_states);

// One scratch buffer as one layer sees it.
struct ScratchShape {
  DType dtype = DType::f32;
  std::array<int64_t, 2> shape{};
  int rank = 2;
  size_t bytes() const;
};

// Every scratch buffer of a layer of `config` in `dtype` at tp_size ranks for max_tokens tokens.
std::array<ScratchShape, kNumScratch> scratch_shapes(const LayerConfig& config, DType dtype, int64_t max_tokens,
                                                     int tp_size);

struct RankContextState {
  RankContextState(const ParallelConfig& parallel, Communicator& comm, const RankContextOptions& options)
      : parallel(parallel), comm(comm), options(options) {}

  // Grows the scratch and the backend's workspaces to cover a layer of `config` in `dtype` (the
  // backend has already accepted the layer: Backend::check_layer). Throws Error when the layer needs
  // more than the context holds and a forward has already run through it.
  void reserve(const LayerConfig& config, DType dtype);
  // The same for any user of the scratch (a layer, a Tail): the buffers `shapes` (zero bytes where it
  // uses none) and the backend's workspaces `spec`; `what` names the user in the error ("this layer (d
  // 7168, ...)").
  void reserve(const std::array<ScratchShape, kNumScratch>& shapes, const WorkspaceSpec& layer_spec,
               const std::string& what);
  bool has_staging() const { return options.host_staging && backend->device() != Device::cpu; }
  // The scratch buffer `which` seen with `shape` (which reserve() covered).
  TensorView view(Scratch which, const ScratchShape& shape) const;

  ParallelConfig parallel;
  Communicator& comm;
  RankContextOptions options;
  std::unique_ptr<Backend> backend;
  // What the backend was last prepared for (the element-wise maximum over the layers).
  WorkspaceSpec spec;
  bool prepared = false;
  std::array<DeviceBuffer, kNumScratch> scratch;
  // Bumped whenever a buffer moves: a layer re-derives its views when it sees a new generation.
  uint64_t generation = 0;
  int num_layers = 0;
  // Set by the first forward through any layer: from then on no buffer may move.
  bool frozen = false;
};

// The one way into a RankContext's state (its friend): for the runner and the tail.
struct RankContextAccess {
  static RankContextState& state(RankContext& context) { return *context.impl_; }
};

}  // namespace latentmoe::detail

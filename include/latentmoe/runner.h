// The latent-MoE layer of one tensor-parallel rank: routing, the latent down-projection, the
// routed experts (this rank's shard), the shared expert (this rank's shard), and the tail that
// turns the rank's un-reduced partials into the layer output through one of the TailTier paths.
//
// Life cycle: construct once (weights are placed on the backend's device and every workspace is
// sized for `max_tokens`), then call forward() any number of times. forward() allocates nothing.
// The layers of one rank share a RankContext (latentmoe/rank_context.h: backend, scratch,
// communicator); a Runner built from a communicator makes a private context of its own.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>

#include "latentmoe/communicator.h"
#include "latentmoe/config.h"
#include "latentmoe/parallel.h"
#include "latentmoe/rank_context.h"
#include "latentmoe/tensor.h"
#include "latentmoe/tier.h"
#include "latentmoe/weights.h"

namespace latentmoe {

namespace detail {
struct RunnerState;
struct RunnerAccess;  // internal (src/core/runner_state.h)
}  // namespace detail

struct RunnerOptions {
  BackendKind backend = BackendKind::cpu;
  TierPolicy policy = {};
  // Largest token count forward() accepts; workspaces are sized for it.
  int64_t max_tokens = 4096;
  // CUDA: the device this rank runs on; -1 picks rank % number of devices (so several ranks share
  // one GPU when there are fewer GPUs than ranks).
  int device_ordinal = -1;
  // GPU backends: make forward_host's staging buffers (inputs and outputs for max_tokens) at
  // construction. Off by default: an engine calls forward() on its own device tensors.
  bool host_staging = false;
};

struct ForwardInputs {
  TensorView hidden_states;      // [T, d], the compute dtype
  TensorView router_logits;      // [T, E+Z] f32; undefined: computed from the gate weight in fp32
  TensorView latent_states;      // [T, l], optional: a down-projection the caller already ran
  std::optional<TailTier> tier;  // forced tier; nullopt selects by the policy
};

struct ForwardOutputs {
  TensorView output;        // [T, d], the compute dtype; identical on every rank
  TensorView topk_ids;      // [T, k] i32; optional
  TensorView topk_weights;  // [T, k] f32; optional
};

// Converts MXFP4 expert codes that an engine keeps on a GPU (device LayerWeightViews, which a Runner uses in place)
// from the canonical order to the kernel order its CUDA kernels read (latentmoe/mxfp4.h, Mxfp4CodeOrder), in place:
// `codes` is a contiguous U8 tensor in CUDA device memory (expert_gate, expert_up or expert_down). Runs on the
// device that holds the codes, enqueued on `stream` (a cudaStream_t of that device; nullptr: the legacy default
// stream); the codes are converted when the stream reaches it. Convert each tensor once (twice is a different
// permutation), then set LayerWeightViews::expert_code_order = Mxfp4CodeOrder::kernel. Host codes stay canonical
// (a Runner converts what it copies; mxfp4_codes_to_kernel_order in latentmoe/mxfp4.h converts a host buffer).
// Throws Error naming the problem: not U8, not contiguous, not device memory, a byte count that is not a multiple
// of 4 (whole rows of codes always are), or a build without CUDA.
void mxfp4_to_kernel_order(const TensorView& codes, StreamHandle stream = nullptr);

class Runner {
 public:
  // `weights` must be this rank's shard (see shard_layer_weights / load_layer_weights) in the
  // compute dtype; `communicator` must outlive the runner and match parallel.tp_size/rank.
  // Construction may allocate and synchronise; when it returns, the runner's device work is done.
  Runner(const LayerConfig& config, const ParallelConfig& parallel, const LayerWeights& weights,
         Communicator& communicator, const RunnerOptions& options = {});
  // The same from views: host views are copied to the runner's device, views already on that device
  // are used in place (LayerWeightViews says what the caller then keeps alive).
  Runner(const LayerConfig& config, const ParallelConfig& parallel, const LayerWeightViews& weights,
         Communicator& communicator, const RunnerOptions& options = {});
  // One layer of a rank on the rank's shared context: the layer places its weights (as above) and
  // registers its scratch needs with the context, which grows to the largest layer; construct every
  // layer of the rank before the first forward through the context (a layer that needs more after it
  // is refused). `parallel` is the rank the weights were sharded for and must be the context's.
  // forward() accepts up to the context's max_tokens; `policy` selects this layer's tiers.
  Runner(RankContext& context, const LayerConfig& config, const ParallelConfig& parallel, const LayerWeights& weights,
         const TierPolicy& policy = {});
  Runner(RankContext& context, const LayerConfig& config, const ParallelConfig& parallel,
         const LayerWeightViews& weights, const TierPolicy& policy = {});
  ~Runner();
  Runner(const Runner&) = delete;
  Runner& operator=(const Runner&) = delete;

  DType dtype() const;
  Device device() const;
  // What each tier can run for this runner (its layer, dtype, tp, backend and communicator): the
  // structural requirements and the backend's own limits (dtype, token capacity of its fused
  // collectives, whether the ranks reach each other). Fixed at construction.
  const TierSupport& tier_support() const;
  // The tier forward() would take for `num_tokens` tokens when none is forced (inside tier_support()).
  TailTier select_tier(int64_t num_tokens) const;
  // The checks forward() makes before it runs anything (shapes, dtypes, devices, contiguity, the token
  // count against max_tokens, a forced tier against tier_support()): throws Error naming the problem and
  // returns the tier forward() would run. Allocates nothing. (A binding tells bad arguments from failures
  // while running by calling it first: latentmoe/c_api.h.)
  TailTier check_forward(const ForwardInputs& inputs, const ForwardOutputs& outputs) const;
  // Runs the layer. Inputs and outputs live on device() (host tensors for the CPU backend). The output may not
  // share memory with any input (parts of it are written while the inputs are still read): an Error.
  // Returns the tier it ran. Throws Error on bad shapes or dtypes, a forced tier that tier_support()
  // does not allow for these tokens (naming why), or more than max_tokens tokens.
  // CUDA: every kernel is enqueued on `stream` (a cudaStream_t; nullptr: the runner's own stream),
  // with the overlapped work on an aux stream forked from and joined back into it by events. forward
  // allocates nothing and never synchronises the host, so a caller can capture it into a CUDA graph
  // (cudaStreamBeginCapture on `stream`, thread-local mode) and replay it with new inputs written to
  // the same buffers.
  TailTier forward(const ForwardInputs& inputs, const ForwardOutputs& outputs, StreamHandle stream = nullptr);

  // forward() on host tensors whatever the backend: for a GPU backend, inputs are staged to the
  // device and outputs back through buffers made at construction (RunnerOptions::host_staging),
  // then the communicator's check point runs (Communicator::check).
  // Convenient for tools and tests; engines call forward() on device tensors.
  TailTier forward_host(const ForwardInputs& inputs, const ForwardOutputs& outputs);

 private:
  friend struct detail::RunnerAccess;
  // `owned`: the private context of the constructors that take a communicator (null otherwise).
  void construct(RankContext& context, const LayerConfig& config, const ParallelConfig& parallel,
                 const LayerWeightViews& weights, const TierPolicy& policy, std::unique_ptr<RankContext> owned);
  std::unique_ptr<detail::RunnerState> impl_;
};

}  // namespace latentmoe

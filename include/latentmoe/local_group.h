// Runs a whole tensor-parallel group inside this process: one thread per rank, each with its own
// Runner over its shard and a communicator of the group. Used by the command-line tool, the demo
// and the tests; an engine builds Runners itself, one per rank process.
#pragma once

#include <functional>
#include <optional>
#include <vector>

#include "latentmoe/config.h"
#include "latentmoe/gpu_group.h"
#include "latentmoe/runner.h"
#include "latentmoe/tensor.h"
#include "latentmoe/weights.h"

namespace latentmoe {

struct LocalGroupInputs {
  HostTensor hidden_states;  // [T, d]
  HostTensor router_logits;  // [T, E+Z] f32, optional
  HostTensor latent_states;  // [T, l], optional
};

struct RankResult {
  HostTensor output;        // [T, d]
  HostTensor topk_ids;      // [T, k] i32
  HostTensor topk_weights;  // [T, k] f32
  TailTier tier = TailTier::native;
  // Median wall time of the timed forward calls of this rank, each until its device has finished; on
  // a GPU without the host copies (the inputs stay staged on the device, the outputs are copied back
  // once after the timed calls).
  double forward_ms = 0.0;
  TierSupport tier_support;  // what this rank's runner supports (Runner::tier_support())
  bool ran = true;           // false: skip_unsupported_tier skipped the forced tier (outputs unset)
};

struct LocalGroupOptions {
  int tp_size = 1;
  BackendKind backend = BackendKind::cpu;
  std::optional<TailTier> tier;  // nullopt: the policy picks
  TierPolicy policy = {};
  int num_timed_runs = 1;   // forward is run this many times; the last run's outputs are kept
  int num_warmup_runs = 0;  // untimed forward calls before the timed ones (a GPU makes at least one: it stages)
  // A forced tier that the runners do not support for these tokens is not run (RankResult::ran is
  // false, tier_support says why) instead of failing.
  bool skip_unsupported_tier = false;
  // The CUDA backend at tp > 1: ranks simulated on GPU 0, or on GPUs 0..tp-1 (one thread per GPU, NCCL);
  // automatic: devices when present (resolve_gpu_placement, latentmoe/gpu_group.h). Ranks on GPUs of
  // their own need NCCL_NVLS_ENABLE=0 in the process's environment (make_nccl_gpu_group refuses otherwise).
  GpuPlacement placement = GpuPlacement::automatic;
};

// One measurement of run_local_group_points: its inputs (the caller's, alive through the call) and its
// tier (nullopt: the policy picks).
struct LocalGroupPoint {
  const LocalGroupInputs* inputs = nullptr;
  std::optional<TailTier> tier;
};

// `rank_weights(parallel)` returns rank parallel.rank's shard (e.g. load_layer_weights from a file
// or shard_layer_weights of in-memory weights); it is called on the rank's own thread. Returns
// one result per rank. Throws the first rank's Error if any rank fails.
std::vector<RankResult> run_local_group(const LayerConfig& config,
                                        const std::function<LayerWeights(const ParallelConfig&)>& rank_weights,
                                        const LocalGroupInputs& inputs, const LocalGroupOptions& options);

// Every point in order on one group, with one Runner per rank built once (its weights loaded once, its
// buffers and the group's one-shot capacity sized for the largest point's tokens): results[point][rank].
// options.tier is not used (each point names its own). A full-size layer's ranks take tens of seconds to
// build, so a sweep over token counts and tiers (latentmoe tune) builds them once.
std::vector<std::vector<RankResult>> run_local_group_points(
    const LayerConfig& config, const std::function<LayerWeights(const ParallelConfig&)>& rank_weights,
    const std::vector<LocalGroupPoint>& points, const LocalGroupOptions& options);

}  // namespace latentmoe

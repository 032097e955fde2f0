#include "latentmoe/local_group.h"

#include <algorithm>
#include <barrier>
#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "core/runner_state.h"
#include "latentmoe/error.h"
#include "latentmoe/gpu_group.h"
#include "latentmoe/in_process_group.h"

namespace latentmoe {
namespace {

// One rank's arrival at a rendezvous of the group: wait() arrives and waits; a rank that never gets
// there (an exception) drops out of it instead, so that the others are not held.
class Arrival {
 public:
  explicit Arrival(std::barrier<>& barrier) : barrier_(barrier) {}
  ~Arrival() {
    if (!arrived_) barrier_.arrive_and_drop();
  }
  void wait() {
    arrived_ = true;
    barrier_.arrive_and_wait();
  }

 private:
  std::barrier<>& barrier_;
  bool arrived_ = false;
};

}  // namespace

namespace {

// Runs `point` on this rank's runner: the first call (forward_host) stages the inputs into the runner's
// device buffers on a GPU and counts as a warm-up; the timed calls then run forward() on them and wait
// for the device, and the outputs are copied back once at the end.
RankResult run_point(Runner& runner, const LayerConfig& config, const LocalGroupPoint& point,
                     const LocalGroupOptions& options) {
  const LocalGroupInputs& inputs = *point.inputs;
  const int64_t num_tokens = inputs.hidden_states.size(0);
  const DType dtype = inputs.hidden_states.dtype();
  RankResult result;
  result.tier_support = runner.tier_support();
  // Every rank has the same support (same layout), so every rank skips together.
  if (options.skip_unsupported_tier && point.tier.has_value() && !result.tier_support.allows(*point.tier, num_tokens)) {
    result.ran = false;
    return result;
  }
  result.output = HostTensor(dtype, {num_tokens, config.hidden_size});
  result.topk_ids = HostTensor(DType::i32, {num_tokens, config.top_k});
  result.topk_weights = HostTensor(DType::f32, {num_tokens, config.top_k});
  ForwardInputs forward_inputs;
  forward_inputs.hidden_states = inputs.hidden_states.view();
  if (inputs.router_logits.defined()) forward_inputs.router_logits = inputs.router_logits.view();
  if (inputs.latent_states.defined()) forward_inputs.latent_states = inputs.latent_states.view();
  forward_inputs.tier = point.tier;
  ForwardOutputs forward_outputs{result.output.view(), result.topk_ids.view(), result.topk_weights.view()};

  detail::RunnerState& state = detail::RunnerAccess::state(runner);
  const bool on_device = state.backend->device() != Device::cpu;
  ForwardInputs staged_inputs;
  ForwardOutputs staged_outputs;
  if (on_device) {
    result.tier = runner.forward_host(forward_inputs, forward_outputs);
    const detail::RunnerState::Staging& staging = *state.staging;
    auto rows = [num_tokens](const detail::DeviceTensor& tensor) { return tensor.view.slice_rows(0, num_tokens); };
    staged_inputs.hidden_states = rows(staging.hidden_states);
    if (forward_inputs.router_logits.defined()) staged_inputs.router_logits = rows(staging.router_logits);
    if (forward_inputs.latent_states.defined()) staged_inputs.latent_states = rows(staging.latent_states);
    staged_inputs.tier = point.tier;
    staged_outputs = ForwardOutputs{rows(staging.output), rows(staging.topk_ids), rows(staging.topk_weights)};
  }
  auto timed_forward = [&]() -> TailTier {
    if (!on_device) return runner.forward_host(forward_inputs, forward_outputs);
    const TailTier tier = runner.forward(staged_inputs, staged_outputs);
    detail::wait_for_device(state, "the forward");
    state.comm.check();
    return tier;
  };
  for (int run = on_device ? 1 : 0; run < options.num_warmup_runs; ++run) timed_forward();
  std::vector<double> times_ms;
  for (int run = 0; run < options.num_timed_runs; ++run) {
    const auto start = std::chrono::steady_clock::now();
    result.tier = timed_forward();
    const auto stop = std::chrono::steady_clock::now();
    times_ms.push_back(std::chrono::duration<double, std::milli>(stop - start).count());
  }
  if (on_device) {
    state.backend->copy(staged_outputs.output, forward_outputs.output);
    state.backend->copy(staged_outputs.topk_ids, forward_outputs.topk_ids);
    state.backend->copy(staged_outputs.topk_weights, forward_outputs.topk_weights);
  }
  std::nth_element(times_ms.begin(), times_ms.begin() + times_ms.size() / 2, times_ms.end());
  result.forward_ms = times_ms[times_ms.size() / 2];
  return result;
}

}  // namespace

std::vector<std::vector<RankResult>> run_local_group_points(
    const LayerConfig& config, const std::function<LayerWeights(const ParallelConfig&)>& rank_weights,
    const std::vector<LocalGroupPoint>& points, const LocalGroupOptions& options) {
  config.validate();
  LATENTMOE_CHECK(options.num_timed_runs >= 1, "num_timed_runs must be at least 1");
  LATENTMOE_CHECK(options.num_warmup_runs >= 0, "num_warmup_runs must be at least 0");
  LATENTMOE_CHECK(!points.empty(), "run_local_group_points: no point to run");
  int64_t max_tokens = 1;
  DType dtype = DType::f32;
  for (size_t p = 0; p < points.size(); ++p) {
    LATENTMOE_CHECK(points[p].inputs != nullptr, "run_local_group_points: point ", p, " has no inputs");
    const HostTensor& hidden = points[p].inputs->hidden_states;
    if (p == 0 && hidden.defined()) dtype = hidden.dtype();
    LATENTMOE_CHECK(hidden.defined() && hidden.shape().size() == 2,
                    "hidden_states must be a rank-2 tensor [tokens, hidden_size]",
                    points.size() > 1 ? " (point " + std::to_string(p) + ")" : std::string());
    LATENTMOE_CHECK(hidden.dtype() == dtype, "point ", p, ": hidden_states are ", dtype_name(hidden.dtype()),
                    " but point 0's are ", dtype_name(dtype), " (one group runs one dtype)");
    max_tokens = std::max(max_tokens, hidden.size(0));
  }
  validate_parallel(config, ParallelConfig{options.tp_size, 0, false});
  const BackendKind backend = resolve_backend_kind(options.backend);

  // The CPU backend's ranks exchange host tensors; the CUDA backend's ranks run on one GPU each (NCCL) or
  // simulated on one GPU, each with its own streams, their collectives on the device (latentmoe/gpu_group.h).
  std::vector<std::unique_ptr<Communicator>> group;
  int device_ordinal = -1;
  bool rank_per_device = false;
  if (backend == BackendKind::cuda && options.tp_size > 1) {
    GpuGroupOptions group_options;
    group_options.dtype = dtype;
    // The largest message: [T, d] (the final all-reduce) or tier 0's [T, l + d/tp]; T (d + l) holds both.
    // Simulated ranks carry all of it one-shot; ranks on GPUs of their own up to the default one-shot
    // token count, NCCL above (latentmoe/gpu_group.h).
    const int64_t per_token = config.hidden_size + config.latent_size;
    group_options.capacity_elements = max_tokens * per_token;
    group_options.max_elements = group_options.capacity_elements;
    group_options.timeout = default_collective_timeout();
    if (resolve_gpu_placement(options.placement, options.tp_size) == GpuPlacement::devices) {
      size_nccl_group(group_options, max_tokens, per_token, default_one_shot_tokens(options.tp_size));
      group = make_nccl_gpu_group(options.tp_size, group_options);
      rank_per_device = true;
    } else {
      group = make_simulated_gpu_group(options.tp_size, group_options);
      device_ordinal = group_options.device;
    }
  } else {
    group = make_in_process_group(options.tp_size);
  }
  // Every rank is built before any runs: a rank still constructing (allocating, loading kernels)
  // while a peer's collective waits for it would only cost that peer its timeout.
  std::barrier constructed(options.tp_size);
  std::barrier finished(options.tp_size);
  std::vector<std::vector<RankResult>> results(points.size());
  for (std::vector<RankResult>& point_results : results) point_results.resize(options.tp_size);
  run_ranks(group, [&](int rank) {
    const ParallelConfig parallel{options.tp_size, rank, false};
    RunnerOptions runner_options;
    runner_options.backend = backend;
    runner_options.policy = options.policy;
    runner_options.max_tokens = max_tokens;
    runner_options.device_ordinal = rank_per_device ? rank : device_ordinal;
    runner_options.host_staging = true;
    // A rank that fails leaves both rendezvous, so its peers never wait for it here (run_ranks aborts
    // the group and reports the failure).
    Arrival at_constructed(constructed), at_finished(finished);
    std::optional<Runner> runner;
    runner.emplace(config, parallel, rank_weights(parallel), *group[rank], runner_options);
    at_constructed.wait();
    for (size_t p = 0; p < points.size(); ++p) results[p][rank] = run_point(*runner, config, points[p], options);
    // No rank frees its device memory (cudaFree may wait for the whole device) while a peer may still
    // be launching work that another peer's collective waits for.
    at_finished.wait();
  });
  return results;
}

std::vector<RankResult> run_local_group(const LayerConfig& config,
                                        const std::function<LayerWeights(const ParallelConfig&)>& rank_weights,
                                        const LocalGroupInputs& inputs, const LocalGroupOptions& options) {
  std::vector<LocalGroupPoint> points(1);
  points[0].inputs = &inputs;
  points[0].tier = options.tier;
  return std::move(run_local_group_points(config, rank_weights, points, options).front());
}

}  // namespace latentmoe

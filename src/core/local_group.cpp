#include "latentmoe/local_group.h"

#include <algorithm>
#include <chrono>

#include "latentmoe/error.h"
#include "latentmoe/in_process_group.h"

namespace latentmoe {

std::vector<RankResult> run_local_group(const LayerConfig& config,
                                        const std::function<LayerWeights(const ParallelConfig&)>& rank_weights,
                                        const LocalGroupInputs& inputs, const LocalGroupOptions& options) {
  config.validate();
  LATENTMOE_CHECK(options.num_timed_runs >= 1, "num_timed_runs must be at least 1");
  LATENTMOE_CHECK(inputs.hidden_states.defined() && inputs.hidden_states.shape().size() == 2,
                  "hidden_states must be a rank-2 tensor [tokens, hidden_size]");
  validate_parallel(config, ParallelConfig{options.tp_size, 0, false});
  const BackendKind backend = resolve_backend_kind(options.backend);
  LATENTMOE_CHECK(backend == BackendKind::cpu || options.tp_size == 1, "tp ", options.tp_size, " on the ",
                  to_string(backend), " backend needs a device communicator, which is not built yet; ",
                  "use --backend cpu or --tp 1");
  const int64_t num_tokens = inputs.hidden_states.size(0);
  const DType dtype = inputs.hidden_states.dtype();

  auto group = make_in_process_group(options.tp_size);
  std::vector<RankResult> results(options.tp_size);
  run_ranks(group, [&](int rank) {
    const ParallelConfig parallel{options.tp_size, rank, false};
    RunnerOptions runner_options;
    runner_options.backend = backend;
    runner_options.policy = options.policy;
    runner_options.max_tokens = std::max<int64_t>(num_tokens, 1);
    Runner runner(config, parallel, rank_weights(parallel), *group[rank], runner_options);

    RankResult& result = results[rank];
    result.output = HostTensor(dtype, {num_tokens, config.hidden_size});
    result.topk_ids = HostTensor(DType::i32, {num_tokens, config.top_k});
    result.topk_weights = HostTensor(DType::f32, {num_tokens, config.top_k});
    ForwardInputs forward_inputs;
    forward_inputs.hidden_states = inputs.hidden_states.view();
    if (inputs.router_logits.defined()) forward_inputs.router_logits = inputs.router_logits.view();
    if (inputs.latent_states.defined()) forward_inputs.latent_states = inputs.latent_states.view();
    forward_inputs.tier = options.tier;
    ForwardOutputs forward_outputs{result.output.view(), result.topk_ids.view(), result.topk_weights.view()};

    std::vector<double> times_ms;
    for (int run = 0; run < options.num_timed_runs; ++run) {
      const auto start = std::chrono::steady_clock::now();
      result.tier = runner.forward_host(forward_inputs, forward_outputs);
      const auto stop = std::chrono::steady_clock::now();
      times_ms.push_back(std::chrono::duration<double, std::milli>(stop - start).count());
    }
    std::nth_element(times_ms.begin(), times_ms.begin() + times_ms.size() / 2, times_ms.end());
    result.forward_ms = times_ms[times_ms.size() / 2];
  });
  return results;
}

}  // namespace latentmoe

// latentmoe demo: the main job. Builds a scaled-down model of each reference family (Kimi-K3-like
// and Nemotron-3-like) with seeded random weights, runs every tier at tp 1, 2, 4 and 8 in f32 and
// bf16 on the chosen backend (the GPU when one is present: ranks simulated on it, or one GPU per
// rank with --placement), checks each run against the CPU reference at tp 1 and that all ranks hold
// identical bits, and prints a table. Exits non-zero if any check fails. --save DIR also writes each
// model's bf16 files (config.json, weights.safetensors, input.safetensors) for `latentmoe run`.
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "commands.h"
#include "latentmoe/atomic_file.h"
#include "latentmoe/compare.h"
#include "latentmoe/error.h"
#include "latentmoe/local_group.h"
#include "latentmoe/presets.h"
#include "latentmoe/random.h"
#include "latentmoe/safetensors.h"
#include "latentmoe/weights.h"

namespace latentmoe::tools {
namespace {

struct DemoModel {
  const char* name;
  LayerConfig config;
};

// The reference families' structure (activation, routing, norm, scaling) at small sizes that every
// tp in 1/2/4/8 divides.
std::vector<DemoModel> demo_models() {
  return {{"kimi-k3-mini", resized(kimi_k3_config(), {256, 128, 64, 8, 96, 192})},
          {"nemotron3-mini", resized(nemotron3_super_config(), {256, 64, 48, 6, 112, 224})}};
}

// Seeded inputs: hidden_states in `dtype`, router logits in f32.
LocalGroupInputs demo_inputs(const LayerConfig& config, int64_t num_tokens, DType dtype, uint64_t seed) {
  LocalGroupInputs inputs;
  inputs.hidden_states = random_uniform_tensor(dtype, {num_tokens, config.hidden_size}, seed);
  inputs.router_logits = random_uniform_tensor(DType::f32, {num_tokens, config.num_router_outputs()}, seed + 1, 2.0f);
  return inputs;
}

// DIR/<model>/config.json, weights.safetensors (bf16, no router gate: the logits are an input) and
// input.safetensors (hidden_states bf16, router_logits f32): what the demo's bf16 runs use.
void save_demo_files(const std::string& directory, int64_t num_tokens) {
  for (const DemoModel& model : demo_models()) {
    const std::filesystem::path folder = std::filesystem::path(directory) / model.name;
    std::error_code error;
    std::filesystem::create_directories(folder, error);
    LATENTMOE_CHECK(!error, "demo --save: cannot create ", folder.string(), ": ", error.message());
    const std::string config = model.config.to_json() + "\n";
    AtomicFile config_file((folder / "config.json").string(), config.size());
    config_file.write(config.data(), config.size());
    config_file.commit();
    save_layer_weights((folder / "weights.safetensors").string(),
                       make_random_layer_weights(model.config, DType::bf16, /*seed=*/1234, false), model.config);
    const LocalGroupInputs inputs = demo_inputs(model.config, num_tokens, DType::bf16, /*seed=*/99);
    write_safetensors((folder / "input.safetensors").string(),
                      {{"hidden_states", inputs.hidden_states.view()}, {"router_logits", inputs.router_logits.view()}});
    std::printf("# wrote %s/{config.json,weights.safetensors,input.safetensors}\n", folder.string().c_str());
  }
}

int run_demo(int64_t num_tokens, int num_timed_runs, BackendKind requested, GpuPlacement placement,
             const std::string& save_directory) {
  if (!save_directory.empty()) save_demo_files(save_directory, num_tokens);
  const BackendKind backend = resolve_backend_kind(requested);
  constexpr int kTpSizes[] = {1, 2, 4, 8};
  struct Tolerance {
    DType dtype;
    double max_relative_error;
  };
  // Tiers and tp sizes reduce partial sums in different orders, each rounded to the dtype.
  constexpr Tolerance kTolerances[] = {{DType::f32, 1e-5}, {DType::bf16, 3e-2}};

  const char* where = backend != BackendKind::cuda           ? ""
                      : placement == GpuPlacement::simulated ? " (tp > 1: ranks simulated on GPU 0)"
                      : placement == GpuPlacement::devices   ? " (tp > 1: one GPU per rank)"
                                                             : " (tp > 1: one GPU per rank where tp GPUs with peer "
                                                               "access are present, else ranks simulated on GPU 0)";
  std::printf("# latentmoe demo: every tier at tp 1/2/4/8 on the %s backend%s against the CPU reference at tp 1\n",
              std::string(to_string(backend)).c_str(), where);
  std::printf("# max_rel_err = max|out - ref| / max|ref|; ranks must hold bit-identical outputs\n");
  std::printf("%-15s %-5s %-18s %3s %6s %13s %10s  %s\n", "model", "dtype", "tier", "tp", "tokens", "max_rel_err",
              "time_ms", "check");
  int num_failed = 0;
  for (const DemoModel& model : demo_models()) {
    model.config.validate();
    for (const Tolerance& tolerance : kTolerances) {
      const LayerWeights full = make_random_layer_weights(model.config, tolerance.dtype, /*seed=*/1234, false);
      const LocalGroupInputs inputs = demo_inputs(model.config, num_tokens, tolerance.dtype, /*seed=*/99);
      auto shard_of = [&](const ParallelConfig& parallel) { return shard_layer_weights(full, model.config, parallel); };
      auto run = [&](int tp_size, TailTier tier, BackendKind kind) {
        LocalGroupOptions options;
        options.backend = kind;
        options.tp_size = tp_size;
        options.tier = tier;
        options.num_timed_runs = num_timed_runs;
        options.placement = placement;  // what the header says
        return run_local_group(model.config, shard_of, inputs, options);
      };
      auto print_row = [&](TailTier tier, int tp_size, double error, double time_ms, bool ok) {
        std::printf("%-15s %-5s %-18s %3d %6lld %13.3e %10.3f  %s\n", model.name,
                    std::string(dtype_name(tolerance.dtype)).c_str(), std::string(to_string(tier)).c_str(), tp_size,
                    static_cast<long long>(num_tokens), error, time_ms, ok ? "ok" : "FAILED");
        if (!ok) ++num_failed;
      };
      const auto reference = run(1, TailTier::native, BackendKind::cpu);
      if (backend == BackendKind::cpu) print_row(TailTier::native, 1, 0.0, reference[0].forward_ms, true);
      for (int tp_size : kTpSizes) {
        for (TailTier tier : kAllTailTiers) {
          if (tp_size == 1 && (backend == BackendKind::cpu || tier != TailTier::native)) continue;
          const auto results = run(tp_size, tier, backend);
          bool identical = true;
          for (const RankResult& result : results) {
            identical = identical && bitwise_equal(result.output.view(), results[0].output.view());
          }
          const double error = max_relative_error(results[0].output.view(), reference[0].output.view());
          const bool same_routing = bitwise_equal(results[0].topk_ids.view(), reference[0].topk_ids.view());
          double slowest_ms = 0.0;
          for (const RankResult& result : results) slowest_ms = std::max(slowest_ms, result.forward_ms);
          print_row(tier, tp_size, error, slowest_ms,
                    identical && same_routing && error <= tolerance.max_relative_error);
        }
      }
    }
  }

  std::printf(
      "\n# automatic tier by token count at tp 8 (policy: tail fusion up to %lld tokens, shared-stream "
      "threshold %lld)\n",
      static_cast<long long>(TierPolicy::from_environment().tail_fusion_max_tokens),
      static_cast<long long>(TierPolicy::from_environment().shared_stream_token_threshold));
  FusedPathConditions conditions;
  conditions.tp_size = 8;
  conditions.has_shared_expert = true;
  const TierPolicy policy = TierPolicy::from_environment();
  for (int64_t tokens : {1, 8, 64, 65, 256, 257, 4096}) {
    std::printf("  %5lld tokens -> %s\n", static_cast<long long>(tokens),
                std::string(to_string(select_tail_tier(policy, conditions, tokens))).c_str());
  }
  if (num_failed > 0) {
    detail::throw_error("demo: ", num_failed, " check(s) failed");
  }
  std::printf("\n# all checks passed\n");
  return 0;
}

}  // namespace

void register_demo_command(CLI::App& app) {
  auto num_tokens = std::make_shared<int64_t>(37);
  auto num_timed_runs = std::make_shared<int>(3);
  auto backend = std::make_shared<std::string>("auto");
  auto placement = std::make_shared<std::string>("simulated");
  auto save_directory = std::make_shared<std::string>();
  CLI::App* command = app.add_subcommand("demo", "Run every tier at tp 1/2/4/8 on two small models and check them");
  command->add_option("--tokens", *num_tokens, "Tokens per run")->check(CLI::Range(int64_t{1}, int64_t{4096}));
  command->add_option("--runs", *num_timed_runs, "Timed forward calls per run (median)")->check(CLI::Range(1, 100));
  command->add_option("--backend", *backend, "auto|cpu|cuda (auto: the GPU when one is present)");
  command->add_option("--placement", *placement,
                      "CUDA, tp > 1: simulated (default: every rank on GPU 0), devices (one GPU per rank) or auto "
                      "(devices when tp GPUs with peer access are present)");
  command->add_option("--save", *save_directory,
                      "also write each model's bf16 files (DIR/<model>/config.json, weights.safetensors, "
                      "input.safetensors with --tokens tokens) for `latentmoe run`");
  command->callback([num_tokens, num_timed_runs, backend, placement, save_directory] {
    run_demo(*num_tokens, *num_timed_runs, parse_backend_kind(*backend), parse_gpu_placement(*placement),
             *save_directory);
  });
}

}  // namespace latentmoe::tools

// latentmoe tune: measures the tail tiers' crossovers on this machine and writes a latentmoe-tune-1
// table (latentmoe/tune.h) that `latentmoe run --tune-file` and LATENTMOE_TUNE_FILE load.
//
// Method: for each tp and token count, every tier that the runners support is forced and timed
// through the public path `latentmoe run --tp N` takes (run_local_group: ranks as threads on the CPU;
// on CUDA one GPU per rank where tp GPUs can serve, else simulated on one GPU) on seeded random weights and inputs:
// warm-up calls, then the median of the repeats, the slowest rank's. derive_crossovers turns the times into the
// policy's two thresholds (a pure function, tested on its own); one entry per (tp, dtype, d, l). Every option is
// checked, and the output's directory probed, before anything is measured; the table is written atomically at the end,
// so a failure leaves no file.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "commands.h"
#include "latentmoe/config.h"
#include "latentmoe/device.h"
#include "latentmoe/error.h"
#include "latentmoe/gpu_group.h"
#include "latentmoe/local_group.h"
#include "latentmoe/presets.h"
#include "latentmoe/random.h"
#include "latentmoe/tune.h"
#include "latentmoe/weights.h"
#include "tool_common.h"

namespace latentmoe::tools {
namespace {

constexpr int64_t kMaxTokens = int64_t{1} << 20;
// On the CPU the presets are scaled down by this much unless --scale says otherwise: kimi-k3 at full
// size is ~60 GB of weights, and the reference backend is slow by design.
constexpr int kCpuDefaultScale = 32;

struct TuneArguments {
  std::string preset = "kimi-k3";
  std::string config_path;
  int scale = 0;  // 0: 1 on CUDA or with --config, kCpuDefaultScale for a preset on the CPU
  std::vector<int> tp_sizes{2, 4, 8};
  std::string dtype = "bf16";
  std::string backend = "auto";
  std::vector<int64_t> tokens;  // empty: the backend's default
  std::vector<std::string> tiers{"native", "tail_fusion", "allreduce_overlap", "column_parallel"};
  int repeats = 0;  // 0: the backend's default
  int warmup = -1;  // -1: the backend's default
  std::string output;
  std::string machine;  // empty: described from the CPU model or the GPU name
  uint64_t seed = 2026;
};

DType parse_tune_dtype(const std::string& name) {
  if (name == "bf16") return DType::bf16;
  if (name == "f16") return DType::f16;
  if (name == "f32") return DType::f32;
  detail::throw_error("--dtype '", name, "' is not bf16, f16 or f32");
}

// The layer to tune: a preset (scaled down by `scale`: d, l, E, I and Is divided by it, top_k capped
// at E) or a config file (as given, unless --scale).
LayerConfig tune_layer(const TuneArguments& args, int scale, std::string& label) {
  LayerConfig config = args.config_path.empty() ? preset_config(args.preset) : LayerConfig::from_file(args.config_path);
  label = args.config_path.empty() ? args.preset : args.config_path;
  if (scale != 1) label += " / " + std::to_string(scale);
  const LayerConfig scaled = scaled_down(config, scale, args.config_path.empty() ? args.preset : args.config_path);
  scaled.validate();
  return scaled;
}

// Refuses, before anything is measured, an output that could not be written at the end.
void check_output_path(const std::string& path) {
  namespace fs = std::filesystem;
  LATENTMOE_CHECK(!path.empty(), "--output is required");
  const fs::path target(path);
  LATENTMOE_CHECK(!target.filename().empty(), path, ": not a file path");
  std::error_code ec;
  if (fs::exists(target, ec)) {
    LATENTMOE_CHECK(fs::is_regular_file(target, ec), path,
                    ": exists and is not a regular file; refusing to replace it");
  }
  const fs::path directory = target.parent_path().empty() ? fs::path(".") : target.parent_path();
  LATENTMOE_CHECK(fs::is_directory(directory, ec), path, ": directory ", directory.string(), " does not exist");
  LATENTMOE_CHECK(::access(directory.c_str(), W_OK | X_OK) == 0, path, ": directory ", directory.string(),
                  " is not writable");
}

// The GPU's name and count; where the largest tp exceeds the GPUs, that its ranks were simulated on one GPU
// (run_tune places each tp on GPUs of its own when tp of them are present).
std::string describe_machine(BackendKind backend, int largest_tp) {
  if (backend == BackendKind::cuda) {
    const int count = cuda_device_count();
    const std::string name = count > 0 ? cuda_device_name(0) : "CUDA GPU";
    std::string text = name + " x" + std::to_string(count);
    if (count < largest_tp) text += ", tp ranks beyond the GPUs simulated on one GPU (no NVLink cost)";
    return text;
  }
  const std::string model = cpu_model();
  return model + ", " + std::to_string(std::thread::hardware_concurrency()) +
         " hardware threads, CPU reference backend (tp ranks as threads)";
}

std::string format_ms(const std::optional<double>& ms) {
  if (!ms) return "-";
  char text[32];
  std::snprintf(text, sizeof(text), "%.4f", *ms);
  return text;
}

void run_tune(const TuneArguments& args) {
  // 1. Every option, before any work.
  const DType dtype = parse_tune_dtype(args.dtype);
  const BackendKind backend = resolve_backend_kind(parse_backend_kind(args.backend));
  const bool cpu = backend == BackendKind::cpu;
  std::vector<TailTier> timed_tiers;
  for (const std::string& name : args.tiers) timed_tiers.push_back(parse_tail_tier(name));
  const int scale = args.scale > 0 ? args.scale : (cpu && args.config_path.empty() ? kCpuDefaultScale : 1);
  std::string label;
  const LayerConfig config = tune_layer(args, scale, label);

  std::vector<int> tp_sizes = args.tp_sizes;
  LATENTMOE_CHECK(!tp_sizes.empty(), "--tp needs at least one tp size");
  std::sort(tp_sizes.begin(), tp_sizes.end());
  tp_sizes.erase(std::unique(tp_sizes.begin(), tp_sizes.end()), tp_sizes.end());
  for (int tp : tp_sizes) {
    LATENTMOE_CHECK(tp >= 2, "--tp ", tp, ": one rank runs only the native tier, there is nothing to tune");
    validate_parallel(config, ParallelConfig{tp, 0, false});
  }

  std::vector<int64_t> tokens = args.tokens;
  if (tokens.empty()) {
    const int64_t largest = cpu ? 64 : 4096;  // the CPU reference: seconds, not minutes
    for (int64_t t = 1; t <= largest; t *= 2) tokens.push_back(t);
  }
  std::sort(tokens.begin(), tokens.end());
  tokens.erase(std::unique(tokens.begin(), tokens.end()), tokens.end());
  for (int64_t t : tokens) {
    LATENTMOE_CHECK(t >= 1 && t <= kMaxTokens, "--tokens: ", t, " is outside 1..", kMaxTokens);
  }
  // The command line checked the ranges of the values given; 0 and -1 stand for the defaults.
  const int repeats = args.repeats > 0 ? args.repeats : (cpu ? 5 : 20);
  const int warmup = args.warmup >= 0 ? args.warmup : (cpu ? 1 : 3);
  check_output_path(args.output);

  TuneTable table;
  table.machine = args.machine.empty() ? describe_machine(backend, tp_sizes.back()) : args.machine;

  // 2. The measurements.
  std::printf("# latentmoe tune: %s (d %lld, l %lld, E %lld, k %lld, I %lld, Is %lld), %s, %s backend\n", label.c_str(),
              static_cast<long long>(config.hidden_size), static_cast<long long>(config.latent_size),
              static_cast<long long>(config.num_experts), static_cast<long long>(config.top_k),
              static_cast<long long>(config.intermediate_size), static_cast<long long>(config.shared_intermediate_size),
              args.dtype.c_str(), std::string(to_string(backend)).c_str());
  std::printf("# machine: %s\n", table.machine.c_str());
  std::printf("# ms per forward: the median of %d calls after %d warm-up(s), the slowest rank's; '-': not run\n",
              repeats, warmup);
  if (cpu) {
    std::printf(
        "# note: CPU timings are noisy (threads share cores with everything else); the crossovers minimise the\n"
        "#       policy's loss on the measured medians, so rerun with more --repeats where they look off\n");
  } else {
    std::printf("# note: times are forward() on staged device inputs, until the device has finished\n");
  }
  std::fflush(stdout);

  // Whether every tp ran on GPUs of its own: only then does the table name its device (and may go under tune/).
  bool every_tp_on_devices = !cpu;
  const LayerWeights full = make_random_layer_weights(config, dtype, args.seed, /*with_gate=*/false);
  auto shard_of = [&](const ParallelConfig& parallel) { return shard_layer_weights(full, config, parallel); };
  for (int tp : tp_sizes) {
    // Real GPUs (one thread per GPU, NCCL) when tp of them are present, else ranks simulated on GPU 0.
    GpuPlacement placement = GpuPlacement::simulated;
    if (!cpu && tp > 1) {
      std::string why;
      placement = resolve_gpu_placement(GpuPlacement::automatic, tp, &why);
      std::fprintf(stderr, "latentmoe tune: tp %d on the CUDA backend: %s\n", tp, why.c_str());
    }
    if (placement != GpuPlacement::devices) every_tp_on_devices = false;
    std::printf("\n# tp %d%s\n%8s", tp,
                placement == GpuPlacement::simulated && !cpu
                    ? " (ranks simulated on one GPU: NVLink costs are missing, the crossovers are not this machine's)"
                    : "",
                "tokens");
    for (TailTier tier : kAllTailTiers) std::printf(" %18s", std::string(to_string(tier)).c_str());
    std::printf("  fastest\n");
    // One group per tp, its ranks built once (a full-size layer's weights take tens of seconds to place),
    // then every token count and tier on it.
    std::vector<LocalGroupInputs> inputs(tokens.size());
    std::vector<LocalGroupPoint> points;
    for (size_t t = 0; t < tokens.size(); ++t) {
      const int64_t num_tokens = tokens[t];
      const uint64_t input_seed = args.seed + 1000 * static_cast<uint64_t>(num_tokens);
      inputs[t].hidden_states = random_uniform_tensor(dtype, {num_tokens, config.hidden_size}, input_seed);
      inputs[t].router_logits =
          random_uniform_tensor(DType::f32, {num_tokens, config.num_router_outputs()}, input_seed + 1, 2.0f);
      for (TailTier tier : timed_tiers) points.push_back(LocalGroupPoint{&inputs[t], tier});
    }
    LocalGroupOptions options;
    options.tp_size = tp;
    options.backend = backend;
    options.num_timed_runs = repeats;
    options.num_warmup_runs = warmup;
    options.skip_unsupported_tier = true;
    options.placement = placement;
    const std::vector<std::vector<RankResult>> results = run_local_group_points(config, shard_of, points, options);
    std::vector<TierTimes> rows;
    for (size_t t = 0; t < tokens.size(); ++t) {
      TierTimes row;
      row.num_tokens = tokens[t];
      for (size_t i = 0; i < timed_tiers.size(); ++i) {
        const std::vector<RankResult>& ranks = results[t * timed_tiers.size() + i];
        if (!ranks[0].ran) continue;
        double slowest = 0.0;
        for (const RankResult& result : ranks) slowest = std::max(slowest, result.forward_ms);
        row.ms[static_cast<size_t>(timed_tiers[i])] = slowest;
      }
      std::optional<TailTier> fastest;
      for (TailTier tier : kAllTailTiers) {
        const auto& ms = row.ms[static_cast<size_t>(tier)];
        if (ms && (!fastest || *ms < *row.ms[static_cast<size_t>(*fastest)])) fastest = tier;
      }
      std::printf("%8lld", static_cast<long long>(row.num_tokens));
      for (TailTier tier : kAllTailTiers) std::printf(" %18s", format_ms(row.ms[static_cast<size_t>(tier)]).c_str());
      std::printf("  %s\n", fastest ? std::string(to_string(*fastest)).c_str() : "-");
      rows.push_back(row);
    }
    std::fflush(stdout);
    const Crossovers crossovers = derive_crossovers(rows);
    std::printf("# tp %d: tail_fusion_max_tokens %lld, shared_stream_token_threshold %lld\n", tp,
                static_cast<long long>(crossovers.tail_fusion_max_tokens),
                static_cast<long long>(crossovers.shared_stream_token_threshold));
    TuneEntry entry;
    entry.tp_size = tp;
    entry.dtype = dtype;
    entry.hidden_size = config.hidden_size;
    entry.latent_size = config.latent_size;
    entry.tail_fusion_max_tokens = crossovers.tail_fusion_max_tokens;
    entry.shared_stream_token_threshold = crossovers.shared_stream_token_threshold;
    table.entries.push_back(entry);
  }

  // 3. The table, atomically.
  if (every_tp_on_devices) {
    table.device = cuda_device_name(0);
    std::printf(
        "\n# device %s: every tp ran on GPUs of its own; committed under tune/, this table becomes the\n"
        "#   built-in default for ranks on GPUs of that name (docs/CONFIG.md)\n",
        table.device.c_str());
  }
  table.write_file(args.output);
  std::printf("\n# wrote %s (%zu entries): latentmoe run --tune-file %s, or LATENTMOE_TUNE_FILE\n", args.output.c_str(),
              table.entries.size(), args.output.c_str());
}

}  // namespace

void register_tune_command(CLI::App& app) {
  auto args = std::make_shared<TuneArguments>();
  CLI::App* command = app.add_subcommand(
      "tune", "Measure the tail tiers' crossovers on this machine and write a tune table (docs/CONFIG.md)");
  CLI::Option* preset = command->add_option("--preset", args->preset, "kimi-k3 (default) or nemotron3-super");
  command->add_option("--config", args->config_path, "a layer config (JSON) instead of a preset")->excludes(preset);
  command
      ->add_option("--scale", args->scale,
                   "divide d, l, E, I and Is by this (default: 32 for a preset on the CPU, else 1)")
      ->check(CLI::Range(1, 1 << 20));
  command->add_option("--tp", args->tp_sizes, "tp sizes, each >= 2 (default 2,4,8)")->delimiter(',');
  command->add_option("--dtype", args->dtype, "bf16 (default), f16 or f32");
  command->add_option("--backend", args->backend, "auto|cpu|cuda");
  command->add_option("--tokens", args->tokens, "token counts (default 1,2,4,...,4096; on the CPU up to 64)")
      ->delimiter(',');
  command->add_option("--tiers", args->tiers, "tiers to time (default all); one left out never wins")->delimiter(',');
  command->add_option("--repeats", args->repeats, "timed forward calls per point, median (default 20; CPU 5)")
      ->check(CLI::Range(1, 10000));
  command->add_option("--warmup", args->warmup, "untimed forward calls per point (default 3; CPU 1)")
      ->check(CLI::Range(0, 1000));
  command->add_option("--output", args->output, "the table to write (JSON, atomically)")->required();
  command->add_option("--machine", args->machine,
                      "the table's machine text (default: the CPU model, or the GPU name and count)");
  command->add_option("--seed", args->seed, "seed of the random weights and inputs");
  command->callback([args] { run_tune(*args); });
}

}  // namespace latentmoe::tools

// latentmoe bench tail (bench_tail.h). Method (docs/PERFORMANCE.md, "Tail benchmark"):
//   - one group per (preset, tp): tp ranks as threads of this process (run_ranks), each with its own
//     Runner over seeded random weights made on its device by the bench, router logits given (the
//     same on every rank, as tensor parallelism replicates them); on CUDA the ranks are simulated on
//     one GPU (the simulated GPU group), on the CPU they are threads over the in-process group;
//   - every measurement is a group measurement (bench/harness/group_timing.h): each rank flushes its
//     cache (CUDA: the L2, by reading, on the first rank of each device) and restores its inputs
//     outside the timed region, all ranks meet on the host, then each times its work on its own
//     stream (CUDA events; the host clock on the CPU); warm-ups first; the group's time is the median
//     over the runs of the slowest rank's time, and each rank's median is kept;
//   - "tail": the tier's tail alone (core/tails.h through src/bench_access.h: the same function
//     forward runs), on the rank's partials L_r and S_r restored from seeded snapshots before every
//     run (the tails reduce them in place); "layer": Runner::forward with the tier forced;
//   - beside them, on the same partials: the unfused tail composed here from the communicator's
//     collectives and the backend's operations (AR of L_r, the latent RMSNorm where the layer has
//     one, L W_up^T with the full W_up, AR of S_r, add), the fused tiers' AR+RMSNorm step alone
//     (Backend::all_reduce_rms_norm), the communicator's AR followed by the backend's RMSNorm, and
//     the all-reduce of a [T, d] message, the ceiling the floors use with the copy bandwidth measured
//     first in the same run.
#include "bench_tail.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "bench_access.h"  // internal: the runner's state and the tail alone, for benchmarks only
#include "bench_tail_platform.h"
#include "bench_tail_report.h"
#include "harness/group_timing.h"
#include "latentmoe/atomic_file.h"
#include "latentmoe/error.h"
#include "latentmoe/gpu_group.h"
#include "latentmoe/in_process_group.h"
#include "latentmoe/parallel.h"
#include "latentmoe/presets.h"
#include "latentmoe/runner.h"
#include "latentmoe/tune.h"

namespace latentmoe::tools {
namespace {

constexpr int kCpuDefaultScale = 32;
constexpr int64_t kMaxTokens = int64_t{1} << 20;

using Clock = std::chrono::steady_clock;

// The options, checked.
struct Plan {
  BackendKind backend = BackendKind::cpu;
  DType dtype = DType::bf16;
  std::string dtype_label;  // "bf16", "f16" or "f32"
  int scale = 1;
  std::vector<std::pair<std::string, LayerConfig>> layers;
  std::vector<int> tp_sizes;
  std::vector<int64_t> tokens;
  bench::Runs runs;
  GroupRequest group;
  std::string collectives;  // "one_shot" or "nccl"
  int fused_up_projection_max_tokens = bench_access::kDefaultFusedUpProjectionMaxTokens;
  int64_t fused_up_projection_max_latent = -1;
};

DType parse_bench_dtype(const std::string& name) {
  if (name == "bf16") return DType::bf16;
  if (name == "f16") return DType::f16;
  if (name == "f32") return DType::f32;
  detail::throw_error("--dtype '", name, "' is not bf16, f16 or f32");
}

Plan plan_of(const BenchTailOptions& options) {
  Plan plan;
  LATENTMOE_CHECK(!options.presets.empty(), "--preset needs at least one preset");
  // Everything that does not need the backend first, so that a bad option fails the same way everywhere.
  plan.dtype = parse_bench_dtype(options.dtype);
  plan.dtype_label = options.dtype;
  const BackendKind requested = parse_backend_kind(options.backend);
  for (const std::string& preset : options.presets) preset_config(preset);  // names the accepted presets
  LATENTMOE_CHECK(options.scale >= 0, "--scale ", options.scale, " is not a positive integer");
  LATENTMOE_CHECK(!options.tp_sizes.empty(), "--tp needs at least one tp size");
  for (int tp : options.tp_sizes) {
    LATENTMOE_CHECK(tp >= 2, "--tp ", tp, ": the tail tiers need at least 2 ranks");
  }
  for (int64_t t : options.tokens) {
    LATENTMOE_CHECK(t >= 1 && t <= kMaxTokens, "--tokens: ", t, " is outside 1..", kMaxTokens);
  }
  LATENTMOE_CHECK(options.max_seconds >= 0, "--max-seconds ", options.max_seconds, " is negative");
  LATENTMOE_CHECK(options.collectives == "one_shot" || options.collectives == "nccl", "--collectives '",
                  options.collectives, "' is not one_shot or nccl");
  plan.collectives = options.collectives;
  LATENTMOE_CHECK(options.fused_up_projection_max_tokens >= 0 &&
                      options.fused_up_projection_max_tokens <= bench_access::kDensePushMaxRows,
                  "--fused-up-projection-max-tokens ", options.fused_up_projection_max_tokens, " is outside 0..",
                  bench_access::kDensePushMaxRows);
  plan.fused_up_projection_max_tokens = options.fused_up_projection_max_tokens;
  LATENTMOE_CHECK(options.fused_up_projection_max_latent >= -1, "--fused-up-projection-max-latent ",
                  options.fused_up_projection_max_latent, " is below -1");
  plan.fused_up_projection_max_latent = options.fused_up_projection_max_latent;
  plan.group.placement = options.placement;
  plan.group.one_shot = options.collectives == "one_shot";
  plan.group.device = options.device;
  LATENTMOE_CHECK(options.one_shot_max_tokens >= 0, "--one-shot-max-tokens ", options.one_shot_max_tokens,
                  " is negative");
  plan.group.one_shot_tokens = options.one_shot_max_tokens;  // 0: default_one_shot_tokens(tp) per tp
  parse_gpu_placement(options.placement);                    // names the accepted placements

  plan.backend = resolve_backend_kind(requested);
  const bool cpu = plan.backend == BackendKind::cpu;
  check_group_request(plan.backend, plan.group);
  plan.scale = options.scale > 0 ? options.scale : (cpu ? kCpuDefaultScale : 1);
  for (const std::string& preset : options.presets) plan.layers.emplace_back(preset, scaled_preset(preset, plan.scale));

  plan.tp_sizes = options.tp_sizes;
  std::sort(plan.tp_sizes.begin(), plan.tp_sizes.end());
  plan.tp_sizes.erase(std::unique(plan.tp_sizes.begin(), plan.tp_sizes.end()), plan.tp_sizes.end());
  for (const auto& [preset, config] : plan.layers) {
    for (int tp : plan.tp_sizes) {
      try {
        validate_parallel(config, ParallelConfig{tp, 0, false});
      } catch (const Error& error) {
        detail::throw_error("--tp ", tp, " for ", preset, " (scale ", plan.scale, "): ", error);
      }
    }
  }

  plan.tokens = options.tokens;
  if (plan.tokens.empty()) {
    const int64_t largest = cpu ? 64 : 1024;  // the CPU reference: seconds, not minutes
    for (int64_t t = 1; t <= largest; t *= 2) plan.tokens.push_back(t);
    if (!cpu) plan.tokens.push_back(4096);
  }
  std::sort(plan.tokens.begin(), plan.tokens.end());
  plan.tokens.erase(std::unique(plan.tokens.begin(), plan.tokens.end()), plan.tokens.end());

  plan.runs.warmup = options.warmup >= 0 ? options.warmup : (cpu ? 1 : 3);
  plan.runs.iterations = options.iterations > 0 ? options.iterations : (cpu ? 3 : 20);
  plan.runs.flush_l2 = !cpu;
  return plan;
}

// A buffer of the bench's on a backend's device, and a view of it.
struct Owned {
  bench_access::DeviceBuffer buffer;
  TensorView view;
};

// One rank's weights (its shard, made on its device), inputs, output and partial snapshots.
struct RankBuffers {
  std::vector<Owned> owned;
  LayerWeightViews weights;
  TensorView x, logits, out;                    // [max_T, d], [max_T, E+Z] f32, [max_T, d]
  TensorView latent_snapshot, shared_snapshot;  // L_r [max_T, l], S_r [max_T, d]
  TensorView gamma;                             // [l] f32: the AR+RMSNorm rows' norm weight
};

RankBuffers make_rank_buffers(bench_access::Backend& backend, const LayerConfig& config, int tp, int rank, DType dtype,
                              uint64_t seed, int64_t max_tokens) {
  RankBuffers buffers;
  const int64_t d = config.hidden_size, l = config.latent_size, experts = config.num_experts;
  const int64_t inter = config.intermediate_size / tp, shared_inter = config.shared_intermediate_size / tp;
  // salt: which tensor; replicated tensors (the inputs) take the same seed on every rank.
  auto make = [&](DType type, std::vector<int64_t> shape, uint64_t salt, bool per_rank, float scale, float offset) {
    Owned owned;
    int64_t count = 1;
    for (int64_t extent : shape) count *= extent;
    owned.buffer = backend.allocate(static_cast<size_t>(count) * dtype_size(type));
    owned.view = TensorView(owned.buffer.get(), type, shape, backend.device());
    const uint64_t tensor_seed = seed * 1000003 + salt * 131 + (per_rank ? static_cast<uint64_t>(rank) + 1 : 0);
    if (scale != 0) fill_uniform(backend, owned.view, tensor_seed, scale, offset);
    buffers.owned.push_back(std::move(owned));
    return buffers.owned.back().view;
  };
  auto matrix = [&](std::vector<int64_t> shape, int64_t fan_in, uint64_t salt) {
    return make(dtype, std::move(shape), salt, /*per_rank=*/true, 1.0f / std::sqrt(static_cast<float>(fan_in)), 0.0f);
  };
  LayerWeightViews& w = buffers.weights;
  w.dtype = dtype;
  // No gate: the router logits are given. A small correction bias keeps each token's experts close to
  // uniformly random (as in bench layer).
  w.score_bias = make(DType::f32, {config.num_router_outputs()}, 1, false, 0.001f, 0.0f);
  w.down_proj = matrix({l, d}, d, 2);
  if (config.use_latent_norm) w.latent_norm = make(DType::f32, {l}, 3, false, 0.25f, 1.0f);
  w.up_proj = make(dtype, {d, l}, 4, /*per_rank=*/false, 1.0f / std::sqrt(static_cast<float>(l)), 0.0f);
  if (config.is_gated()) w.expert_gate = matrix({experts, inter, l}, l, 5);
  w.expert_up = matrix({experts, inter, l}, l, 6);
  w.expert_down = matrix({experts, l, inter}, inter, 7);
  if (config.has_shared_expert()) {
    if (config.is_gated()) w.shared_gate = matrix({shared_inter, d}, d, 8);
    w.shared_up = matrix({shared_inter, d}, d, 9);
    w.shared_down = matrix({d, shared_inter}, shared_inter, 10);
  }
  buffers.x = make(dtype, {max_tokens, d}, 11, false, 1.0f, 0.0f);
  buffers.logits = make(DType::f32, {max_tokens, config.num_router_outputs()}, 12, false, 2.0f, 0.0f);
  buffers.out = make(dtype, {max_tokens, d}, 13, false, 0.0f, 0.0f);
  buffers.latent_snapshot = make(dtype, {max_tokens, l}, 14, true, 1.0f, 0.0f);
  buffers.shared_snapshot = make(dtype, {max_tokens, d}, 15, true, 1.0f, 0.0f);
  buffers.gamma = make(DType::f32, {l}, 16, false, 0.25f, 1.0f);
  return buffers;
}

// The layer's runs per round of bench tail's interleaved layer measurement.
constexpr int kLayerRoundRuns = 5;

// One rank's timed runs of every path at one point (empty: not run).
struct RankTimes {
  std::vector<double> time, layer;
};
using PointTimes = std::array<RankTimes, kTailPaths.size()>;

size_t index_of(TailPath path) { return static_cast<size_t>(path); }

GroupTime group_time(const std::vector<PointTimes>& ranks, TailPath path, bool layer) {
  GroupTime time;
  std::vector<std::vector<double>> per_rank;
  for (const PointTimes& times : ranks) {
    const RankTimes& slot = times[index_of(path)];
    per_rank.push_back(layer ? slot.layer : slot.time);
    time.us_per_rank.push_back(bench::median(per_rank.back()));
  }
  time.us = bench::median_of_slowest(per_rank);
  return time;
}

// Why `support` does not let `tier` run `tokens` tokens ("" when it does).
std::string refusal(const TierSupport& support, TailTier tier, int64_t tokens) {
  try {
    support.check(tier, tokens);
  } catch (const Error& error) {
    return error.what();
  }
  return "";
}

// What one (preset, tp) block needs to know besides the plan.
struct Block {
  std::string preset;
  LayerConfig config;
  int tp = 2;
};

// The bytes one rank must move for the layer with `tier`: every weight it reads once (the routed
// experts: only those the routing touched; W_up: all of it, or its 1/tp for the tiers that shard it),
// the input, the router logits and the output.
double layer_bytes(const LayerConfig& config, int tp, DType dtype, TailTier tier, int64_t tokens, int64_t touched) {
  const double element = static_cast<double>(dtype_size(dtype));
  const double d = static_cast<double>(config.hidden_size), l = static_cast<double>(config.latent_size);
  const double t = static_cast<double>(tokens), matrices = config.is_gated() ? 3 : 2;
  const double inter = static_cast<double>(config.intermediate_size / tp);
  const double shared_inter = static_cast<double>(config.shared_intermediate_size / tp);
  const bool sharded_up = tier == TailTier::tail_fusion || tier == TailTier::column_parallel;
  double weights = l * d + static_cast<double>(touched) * matrices * inter * l + (sharded_up ? d / tp : d) * l;
  if (config.has_shared_expert()) weights += matrices * shared_inter * d;
  return element * (weights + 2 * t * d) + 4.0 * t * static_cast<double>(config.num_router_outputs());
}

TailPoint make_point(const Block& block, const Plan& plan, int64_t tokens, int64_t touched, const TierSupport& support,
                     const std::vector<PointTimes>& ranks, double copy_bytes_per_s) {
  TailPoint point;
  point.preset = block.preset;
  point.scale = plan.scale;
  point.tp = block.tp;
  point.tokens = tokens;
  point.dtype = plan.dtype_label;
  point.collectives = plan.collectives;
  point.one_shot_max_tokens = plan.group.one_shot_tokens_for(block.tp);
  point.fused_up_projection_max_tokens = plan.backend == BackendKind::cpu ? 0 : plan.fused_up_projection_max_tokens;
  point.fused_up_projection_max_latent = plan.backend == BackendKind::cpu ? -1 : plan.fused_up_projection_max_latent;
  point.hidden_size = block.config.hidden_size;
  point.latent_size = block.config.latent_size;
  point.touched_experts = touched;
  const double element = static_cast<double>(dtype_size(plan.dtype));
  const GroupTime all_reduce = group_time(ranks, TailPath::all_reduce, false);
  for (TailPath path : kTailPaths) {
    PathResult result;
    result.path = path;
    if (is_tier(path)) {
      const TailTier tier = kAllTailTiers[index_of(path)];
      result.reason = refusal(support, tier, tokens);
      result.ran = result.reason.empty();
      if (result.ran) {
        result.time = group_time(ranks, path, false);
        result.layer = group_time(ranks, path, true);
        result.layer_floor_us = layer_floor_us(layer_bytes(block.config, block.tp, plan.dtype, tier, tokens, touched),
                                               copy_bytes_per_s, all_reduce.us);
        if (tier == TailTier::tail_fusion) {
          const double shard_bytes =
              element * static_cast<double>(block.config.hidden_size / block.tp) * block.config.latent_size;
          result.floor_us = tail_floor_us(all_reduce.us, shard_bytes, copy_bytes_per_s);
        }
      }
    } else {
      result.ran = true;
      result.time = path == TailPath::all_reduce ? all_reduce : group_time(ranks, path, false);
      const double t = static_cast<double>(tokens);
      if (path == TailPath::ar_rmsnorm || path == TailPath::ar_then_rmsnorm) {
        result.message_bytes = element * t * static_cast<double>(block.config.latent_size);
      } else if (path == TailPath::all_reduce) {
        result.message_bytes = element * t * static_cast<double>(block.config.hidden_size);
      }
    }
    point.paths.push_back(std::move(result));
  }
  return point;
}

// Runs one (preset, tp) block; appends its points, and the token counts the time budget left out to
// `skipped`. Rank 0 prints each point's line as soon as every rank has measured it.
void run_block(const Block& block, const Plan& plan, const BenchTailOptions& options, double copy_bytes_per_s,
               Clock::time_point started, std::vector<TailPoint>& points, std::vector<std::string>& skipped) {
  const LayerConfig& config = block.config;
  const int tp = block.tp;
  const int64_t max_tokens = plan.tokens.back();
  // The widest message of a layer of T tokens: [T, d] or tier 0's [T, l + d/tp]; T (d + l) holds both.
  BenchGroup group =
      make_bench_group(plan.backend, tp, plan.dtype, max_tokens, config.hidden_size + config.latent_size, plan.group);
  // The automatic policy is the one `latentmoe run` takes for this group (latentmoe/tune.h): on GPUs of
  // their own, the built-in crossovers measured on that GPU model, then LATENTMOE_TUNE_FILE and the variables.
  const TierPolicy policy =
      tuned_policy("", tp, plan.dtype, config.hidden_size, config.latent_size,
                   group.placement == "devices" ? describe_device(plan.backend, group.rank_device[0]) : std::string());
  std::vector<PointTimes> times(static_cast<size_t>(tp));
  bench::Rendezvous rendezvous(tp);
  TierSupport support;
  int64_t touched = 0;
  TailTier policy_tier = TailTier::native;  // the automatic policy's tier at the point (rank 0's runner)
  bool stop = false;
  size_t measured = 0;

  run_ranks(group.comms, [&](int rank) {
    bench::Rendezvous::Seat seat(rendezvous);
    const int device = group.rank_device[static_cast<size_t>(rank)];
    bind_thread_to_device(plan.backend, device);
    // Everything is allocated before the first rendezvous: no rank allocates while a peer's collective
    // may wait for it (ranks sharing a GPU), and nothing is freed until every rank has finished.
    const std::unique_ptr<bench_access::Backend> scratch = make_scratch_backend(plan.backend, device);
    const RankBuffers buffers = make_rank_buffers(*scratch, config, tp, rank, plan.dtype, options.seed, max_tokens);
    scratch->synchronize();
    RunnerOptions runner_options;
    runner_options.policy = policy;
    runner_options.backend = plan.backend;
    runner_options.max_tokens = max_tokens;
    runner_options.device_ordinal = device;
    Communicator& comm = *group.comms[static_cast<size_t>(rank)];
    Runner runner(config, ParallelConfig{tp, rank, false}, buffers.weights, comm, runner_options);
    bench_access::RunnerState& state = bench_access::state_of(runner);
    bench_access::Backend& backend = *state.backend;
#ifdef LATENTMOE_WITH_CUDA
    if (plan.backend == BackendKind::cuda) {
      bench_access::set_fused_up_projection_max_tokens(runner, plan.fused_up_projection_max_tokens);
      bench_access::set_fused_up_projection_max_latent(runner, plan.fused_up_projection_max_latent);
    }
#endif
    const auto first_of_device = std::find(group.rank_device.begin(), group.rank_device.end(), device);
    const bool flushes = first_of_device - group.rank_device.begin() == rank;
    const std::unique_ptr<bench::RunClock> clock = make_clock(plan.backend, group, backend.stream(), flushes);
    if (rank == 0) support = runner.tier_support();
    const float eps = static_cast<float>(config.rms_norm_eps);
    seat.wait();  // every rank built

    for (const int64_t tokens : plan.tokens) {
      if (stop) break;
      auto rows = [tokens](const TensorView& view) { return view.slice_rows(0, tokens); };
      const TensorView x = rows(buffers.x), logits = rows(buffers.logits), out = rows(buffers.out);
      const TensorView latent_snapshot = rows(buffers.latent_snapshot), shared_snapshot = rows(buffers.shared_snapshot);
      const TensorView latent = rows(state.latent_partial.view), shared = rows(state.shared_partial.view),
                       normed = rows(state.latent_reduced.view);
      PointTimes& mine = times[static_cast<size_t>(rank)];
      mine = PointTimes{};
      // A collective that failed on the device ends the run at the measurement it failed in, naming the
      // rank, the step and the peer (a failed group fails every later call too, each after the timeout).
      auto measure_with = [&](const bench::Runs& how, TailPath path, const char* part,
                              const std::function<void()>& prepare, const std::function<void()>& body) {
        std::vector<double> runs = bench::time_group_runs(*clock, seat, how, prepare, body);
        try {
          comm.check();
        } catch (const Error& error) {
          detail::throw_error("bench tail: ", block.preset, " tp ", tp, " tokens ", tokens, ", ", path_name(path), part,
                              ": ", error);
        }
        return runs;
      };
      auto measure = [&](TailPath path, const char* part, const std::function<void()>& prepare,
                         const std::function<void()>& body) {
        return measure_with(plan.runs, path, part, prepare, body);
      };

      // The routing of these tokens (the same on every rank): which experts the byte floor counts.
      ForwardInputs inputs;
      inputs.hidden_states = x;
      inputs.router_logits = logits;
      inputs.tier = TailTier::native;
      runner.forward(inputs, ForwardOutputs{out, {}, {}});
      if (rank == 0) {
        HostTensor ids(DType::i32, {tokens, config.top_k});
        backend.copy(rows(state.topk_ids.view), ids.view());  // completes before copy() returns
        std::set<int32_t> distinct;
        for (int64_t i = 0; i < tokens * config.top_k; ++i) {
          if (ids.data_as<int32_t>()[i] < config.num_experts) distinct.insert(ids.data_as<int32_t>()[i]);
        }
        touched = static_cast<int64_t>(distinct.size());
        policy_tier = runner.select_tier(tokens);
      }

      std::vector<TailTier> tiers;  // every rank has the same support (same layout): every rank skips alike
      for (const TailTier tier : kAllTailTiers)
        if (runner.tier_support().allows(tier, tokens)) tiers.push_back(tier);
      for (const TailTier tier : tiers) {
        const bench_access::TailTensors t = bench_access::tail_tensors(runner, tier, out, tokens);
        auto restore = [&] {
          backend.copy(latent_snapshot, t.latent_partial);
          if (t.shared_partial.defined()) backend.copy(shared_snapshot, t.shared_partial);
        };
        mine[index_of(path_of(tier))].time =
            measure(path_of(tier), "", restore, [&] { bench_access::run_tail(runner, tier, t); });
      }
      // The whole layer per tier, the tiers taking turns in rounds of at most kLayerRoundRuns runs: a layer
      // of a thousand tokens runs for milliseconds and the GPU's clock drifts over a point's measurements,
      // which favoured the tier measured first (two H200s at 2f06526: the four tiers at 1024 tokens of
      // kimi-k3 came out in measurement order, 8.3 to 8.8 ms, in all three runs).
      for (int done = 0, round = 0; done < plan.runs.iterations; ++round) {
        bench::Runs how = plan.runs;
        how.iterations = std::min(kLayerRoundRuns, plan.runs.iterations - done);
        how.warmup = round == 0 ? plan.runs.warmup : std::min(plan.runs.warmup, 1);
        for (const TailTier tier : tiers) {
          inputs.tier = tier;
          std::vector<double> runs = measure_with(how, path_of(tier), " (layer)", nullptr, [&] {
            runner.forward(inputs, ForwardOutputs{out, {}, {}});
          });
          std::vector<double>& layer = mine[index_of(path_of(tier))].layer;
          layer.insert(layer.end(), runs.begin(), runs.end());
        }
        done += how.iterations;
      }

      auto restore_latent = [&] { backend.copy(latent_snapshot, latent); };
      auto restore_both = [&] {
        backend.copy(latent_snapshot, latent);
        if (config.has_shared_expert()) backend.copy(shared_snapshot, shared);
      };
      // The unfused tail, composed here: what a framework's default MoE path runs.
      mine[index_of(TailPath::unfused)].time = measure(TailPath::unfused, "", restore_both, [&] {
        comm.all_reduce_sum(latent, backend.stream());
        TensorView up_in = latent;
        if (config.use_latent_norm) {
          backend.rms_norm(latent, state.latent_norm.view, eps, normed);
          up_in = normed;
        }
        backend.linear(up_in, state.up_proj.view, out, /*accumulate=*/false);
        if (config.has_shared_expert()) {
          comm.all_reduce_sum(shared, backend.stream());
          backend.add(out, shared, out);
        }
      });
      mine[index_of(TailPath::ar_rmsnorm)].time = measure(TailPath::ar_rmsnorm, "", restore_latent, [&] {
        backend.all_reduce_rms_norm(comm, latent, buffers.gamma, eps, normed);
      });
      mine[index_of(TailPath::ar_then_rmsnorm)].time = measure(TailPath::ar_then_rmsnorm, "", restore_latent, [&] {
        comm.all_reduce_sum(latent, backend.stream());
        backend.rms_norm(latent, buffers.gamma, eps, normed);
      });
      mine[index_of(TailPath::all_reduce)].time = measure(
          TailPath::all_reduce, "", [&] { backend.copy(shared_snapshot, shared); },
          [&] { comm.all_reduce_sum(shared, backend.stream()); });

      seat.wait();  // every rank's times are in
      if (rank == 0) {
        points.push_back(make_point(block, plan, tokens, touched, support, times, copy_bytes_per_s));
        points.back().policy_tier = policy_tier;
        points.back().placement = group.placement;
        if (measured == 0) std::fputs(format_block_header(points.back()).c_str(), stdout);
        std::fputs(format_point_line(points.back()).c_str(), stdout);
        std::fflush(stdout);
        ++measured;
        const double elapsed = std::chrono::duration<double>(Clock::now() - started).count();
        stop = options.max_seconds > 0 && elapsed >= options.max_seconds;
      }
      seat.wait();  // rank 0's decision is seen by all
    }
    seat.finish();
  });
  for (size_t i = measured; i < plan.tokens.size(); ++i) {
    skipped.push_back(block.preset + " tp " + std::to_string(tp) + " tokens " + std::to_string(plan.tokens[i]));
  }
}

// Where the ranks of the largest tp will run: "simulated" or "devices" (each row says its own).
std::string describe_placement(const Plan& plan) {
  if (plan.backend == BackendKind::cpu) return "simulated";
  const GpuPlacement placement =
      resolve_gpu_placement(parse_gpu_placement(plan.group.placement), plan.tp_sizes.back(), nullptr);
  return placement == GpuPlacement::devices ? "devices" : "simulated";
}

std::string repro_line(const Plan& plan, const BenchTailOptions& options) {
  std::ostringstream line;
  auto join = [&line](const auto& values) {
    for (size_t i = 0; i < values.size(); ++i) line << (i ? "," : "") << values[i];
  };
  line << "latentmoe bench tail --backend " << to_string(plan.backend) << " --preset ";
  join(options.presets);
  line << " --tp ";
  join(plan.tp_sizes);
  line << " --tokens ";
  join(plan.tokens);
  line << " --scale " << plan.scale << " --dtype " << options.dtype << " --warmup " << plan.runs.warmup
       << " --iterations " << plan.runs.iterations << " --seed " << options.seed;
  if (options.max_seconds > 0) line << " --max-seconds " << options.max_seconds;
  if (plan.backend != BackendKind::cpu) {
    line << " --placement " << options.placement << " --collectives " << options.collectives;
    if (plan.group.one_shot_tokens > 0) line << " --one-shot-max-tokens " << plan.group.one_shot_tokens;
    line << " --fused-up-projection-max-tokens " << options.fused_up_projection_max_tokens;
    if (options.fused_up_projection_max_latent >= 0) {
      line << " --fused-up-projection-max-latent " << options.fused_up_projection_max_latent;
    }
  }
  return line.str();
}

}  // namespace

void run_bench_tail(const BenchTailOptions& options) {
  const Clock::time_point started = Clock::now();
  // 1. Every option, and the JSON file's directory (a temporary file made and removed), before any work.
  const Plan plan = plan_of(options);
  if (!options.json_path.empty()) AtomicFile probe(options.json_path, 0);

  // 2. The ceilings and the run's description.
  TailRunInfo info;
  info.backend = std::string(to_string(plan.backend));
  info.placement = describe_placement(plan);
  info.device = describe_device(plan.backend, options.device);
  info.commit = options.commit;
  info.warmup = plan.runs.warmup;
  info.iterations = plan.runs.iterations;
  info.flush = plan.runs.flush_l2;
  info.copy_bytes_per_s = measure_copy_bandwidth(plan.backend, options.device, plan.runs);
  info.repro = repro_line(plan, options);
  std::fputs(format_run_header(info).c_str(), stdout);
  std::fflush(stdout);

  // 3. One group per (preset, tp). The JSON is rewritten whole (atomically) after every block, marked
  // incomplete until the end, so a run killed by a time limit, or ended by a failure (recorded in the
  // JSON, then rethrown), keeps every point it measured: GPU machines with several GPUs are scarce.
  std::vector<TailPoint> points;
  auto write_json = [&] {
    if (options.json_path.empty()) return;
    const std::string text = to_json(info, points).dump(2) + "\n";
    AtomicFile file(options.json_path, text.size());
    file.write(text.data(), text.size());
    file.commit();
  };
  info.complete = false;
  try {
    for (const auto& [preset, config] : plan.layers) {
      for (int tp : plan.tp_sizes) {
        const double elapsed = std::chrono::duration<double>(Clock::now() - started).count();
        if (options.max_seconds > 0 && elapsed >= options.max_seconds) {
          info.skipped.push_back(preset + " tp " + std::to_string(tp) + ": every token count");
          continue;
        }
        run_block(Block{preset, config, tp}, plan, options, info.copy_bytes_per_s, started, points, info.skipped);
        write_json();
      }
    }
  } catch (const Error& error) {
    info.error = error.what();
    try {
      write_json();
    } catch (const Error&) {
      // The measurement's failure is the one to report.
    }
    throw;
  }
  if (!info.skipped.empty()) {
    std::printf("# --max-seconds %g ran out; not measured: %zu points (listed in the JSON's \"skipped\")\n",
                options.max_seconds, info.skipped.size());
  }
  std::printf("# repro: %s\n", info.repro.c_str());
  std::fflush(stdout);

  // 4. The JSON, complete.
  info.complete = true;
  write_json();
}

}  // namespace latentmoe::tools

// latentmoe bench layer (see bench_layer.h). Method (docs/PERFORMANCE.md):
//   - ceilings measured first, in the same process: device-to-device copy bandwidth (bytes read +
//     written over time) and the dense bf16 GEMM rate of the CUDA backend's own linear() (8192^3);
//   - one Runner per (preset, tp shard): the shard's config (I/tp, Is/tp) at tp 1, rank 0, over
//     weights made on the GPU by the bench (seeded uniform random data, never zeros, never staged
//     through the host) and given to the runner as device views, which it uses in place; router
//     logits are U(-2, 2) with a correction bias of U(-1e-3, 1e-3), so each token's experts are close
//     to uniformly random (the touched-expert counts are reported);
//   - "total" is Runner::forward (tier native, no collective at tp 1) on the bench's stream;
//     "graph" is that forward captured once into a CUDA graph and replayed;
//   - each phase is timed alone by calling the runner's backend operation on the runner's own weights
//     and workspaces (src/bench_access.h);
//   - timing (bench/harness/timing.h): before every timed run the L2 is flushed by reading a buffer
//     twice its size, so weights are read from HBM as they are in a real model whose other layers
//     evict them; CUDA events after warm-up; the median of the runs is reported;
//   - floors: the fewest bytes a phase must move over the copy bandwidth, and its FLOPs over the GEMM
//     rate; the larger is the floor; fraction_of_floor = floor / time (1.0 = at the ceiling). The
//     routed experts' bytes count only the distinct experts the routing touched.
#include "bench_layer.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "latentmoe/config.h"
#include "latentmoe/device.h"
#include "latentmoe/error.h"
#include "latentmoe/in_process_group.h"
#include "latentmoe/mxfp4.h"
#include "latentmoe/parallel.h"
#include "latentmoe/presets.h"
#include "latentmoe/runner.h"
#include "latentmoe/tensor.h"
#include "latentmoe/weights.h"

#ifdef LATENTMOE_WITH_CUDA
#include "bench_access.h"    // internal: the runner's state and the CUDA knobs, for benchmarks only
#include "harness/timing.h"  // the benchmark harness shared by every benchmark
#endif

namespace latentmoe::tools {

#ifndef LATENTMOE_WITH_CUDA

void run_bench_layer(const BenchLayerOptions& options) {
  for (const auto& preset : options.presets) preset_config(preset);
  detail::throw_error("bench layer needs the CUDA backend: latentmoe was built without CUDA");
}

#else

namespace {

struct Ceilings {
  double copy_bytes_per_s = 0;
  double gemm_flops_per_s = 0;
};

struct PhaseResult {
  std::string name;
  double time_us = 0;
  double bytes = 0;
  double flops = 0;
  double floor_us = 0;
  double fraction_of_floor() const { return time_us > 0 ? floor_us / time_us : 0; }
};

// A device tensor the bench owns.
struct DeviceTensor {
  bench::DeviceMemory memory;
  TensorView view;
};

// A tensor on the current device; filled with offset + scale * U[-1, 1) on `stream` unless scale is 0.
DeviceTensor make_tensor(DType dtype, std::vector<int64_t> shape, uint64_t seed, float scale, float offset,
                         cudaStream_t stream) {
  DeviceTensor tensor;
  int64_t count = 1;
  for (int64_t extent : shape) count *= extent;
  tensor.memory = bench::DeviceMemory(static_cast<size_t>(std::max<int64_t>(count, 1)) * dtype_size(dtype));
  tensor.view = TensorView(tensor.memory.get(), dtype, shape, Device::cuda);
  if (is_compute_dtype(dtype) && scale != 0)
    bench_access::fill_uniform(tensor.memory.get(), dtype, count, seed, scale, offset, stream);
  return tensor;
}

// A non-blocking stream of the current device, destroyed with the object.
struct Stream {
  cudaStream_t handle = nullptr;
  Stream() { LATENTMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&handle, cudaStreamNonBlocking)); }
  ~Stream() {
    if (handle != nullptr) cudaStreamDestroy(handle);
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
};

Ceilings measure_ceilings(bench::Timer& timer, int device) {
  Ceilings ceilings;
  std::unique_ptr<bench_access::Backend> backend = bench_access::make_cuda_backend(device);
  const auto stream = static_cast<cudaStream_t>(backend->stream());
  ceilings.copy_bytes_per_s = bench::copy_bandwidth(timer, stream, timer.runs());
  const int64_t n = 8192;
  auto x = make_tensor(DType::bf16, {n, n}, 2, 1.0f, 0.0f, stream);
  auto w = make_tensor(DType::bf16, {n, n}, 3, 1.0f, 0.0f, stream);
  auto y = make_tensor(DType::bf16, {n, n}, 0, 0.0f, 0.0f, stream);
  const double us = timer.median_us(stream, [&] { backend->linear(x.view, w.view, y.view, false); });
  ceilings.gemm_flops_per_s = 2.0 * n * n * n / (us * 1e-6);
  LATENTMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  return ceilings;
}

void set_floor(PhaseResult& phase, const Ceilings& ceilings) {
  phase.floor_us = 1e6 * std::max(phase.bytes / ceilings.copy_bytes_per_s, phase.flops / ceilings.gemm_flops_per_s);
}

nlohmann::json bench_one(const std::string& preset, int tp_shard, const BenchLayerOptions& options,
                         const Ceilings& ceilings, DType dtype, bench::Timer& timer) {
  const LayerConfig full = preset_config(preset);
  LATENTMOE_CHECK(tp_shard >= 1 && full.intermediate_size % tp_shard == 0 &&
                      full.shared_intermediate_size % tp_shard == 0 && full.hidden_size % tp_shard == 0 &&
                      full.latent_size % tp_shard == 0,
                  "--tp-shard ", tp_shard, " does not divide the shapes of ", preset);
  // One rank's share: the experts' and the shared expert's intermediate sizes divided by tp.
  LayerConfig config = full;
  config.intermediate_size /= tp_shard;
  config.shared_intermediate_size /= tp_shard;
  const bool mxfp4 = options.experts == "mxfp4";
  if (mxfp4) config.experts_format = ExpertWeightFormat::mxfp4;

  const int64_t d = config.hidden_size, l = config.latent_size, num_experts = config.num_experts, k = config.top_k,
                inter = config.intermediate_size, shared_inter = config.shared_intermediate_size;
  const int64_t width = config.num_router_outputs();
  const int64_t max_tokens = *std::max_element(options.tokens.begin(), options.tokens.end());
  const double element = static_cast<double>(dtype_size(dtype));
  // Bytes per expert weight: MXFP4 is half a byte of code and 1/32 of a scale byte.
  const double expert_element = mxfp4 ? 0.5 + 1.0 / kMxfp4GroupSize : element;
  const int num_matrices = config.is_gated() ? 3 : 2;
  const bool gated = config.is_gated(), shared = config.has_shared_expert();

  // The bench's stream: the weights and inputs are made on it, and forward runs on it.
  const Stream bench_stream;
  const cudaStream_t stream = bench_stream.handle;

  // The shard's weights, made on the GPU (kimi-k3 at tp 1 is ~60 GB: never through host memory).
  const uint64_t seed = options.seed;
  auto matrix = [&](std::vector<int64_t> shape, int64_t fan_in, uint64_t salt) {
    return make_tensor(dtype, std::move(shape), seed * 1000 + salt, 1.0f / std::sqrt(float(fan_in)), 0.0f, stream);
  };
  DeviceTensor down_proj = matrix({l, d}, d, 1);
  DeviceTensor up_proj = matrix({d, l}, l, 2);
  DeviceTensor gamma;
  if (config.use_latent_norm) gamma = make_tensor(DType::f32, {l}, seed * 1000 + 3, 0.25f, 1.0f, stream);
  // A small correction bias: a bias as wide as the top scores' spread would send every token to the same
  // experts; this keeps each token's experts close to uniformly random, like the peers' routing.
  DeviceTensor bias = make_tensor(DType::f32, {width}, seed * 1000 + 4, 0.001f, 0.0f, stream);
  DeviceTensor expert_gate, shared_gate, shared_up, shared_down, gate_scale, up_scale, down_scale;
  DeviceTensor expert_up, expert_down;
  if (mxfp4) {
    // Codes and scales as the checkpoint ships them; the kernels' time does not depend on the values, so
    // fixed bytes: codes 0x3A (+1.5, -1.0... per nibble), scales 2^-6 (0x79), finite and near the
    // dense weights' 1/sqrt(fan_in).
    auto bytes = [&](std::vector<int64_t> shape, uint8_t value) {
      DeviceTensor tensor = make_tensor(DType::u8, std::move(shape), 0, 0.0f, 0.0f, stream);
      LATENTMOE_CUDA_CHECK(
          cudaMemsetAsync(tensor.view.data(), value, static_cast<size_t>(tensor.view.numel()), stream));
      return tensor;
    };
    if (gated) {
      expert_gate = bytes({num_experts, inter, l / 2}, 0x3A);
      gate_scale = bytes({num_experts, inter, l / kMxfp4GroupSize}, 0x79);
    }
    expert_up = bytes({num_experts, inter, l / 2}, 0x3A);
    up_scale = bytes({num_experts, inter, l / kMxfp4GroupSize}, 0x79);
    expert_down = bytes({num_experts, l, inter / 2}, 0x3A);
    down_scale = bytes({num_experts, l, inter / kMxfp4GroupSize}, 0x79);
    // Device codes are used in place: into the kernel order the runner expects of them (latentmoe/weights.h).
    for (const DeviceTensor* codes : {&expert_gate, &expert_up, &expert_down}) {
      if (codes->view.defined()) mxfp4_to_kernel_order(codes->view, stream);
    }
  } else {
    if (gated) expert_gate = matrix({num_experts, inter, l}, l, 5);
    expert_up = matrix({num_experts, inter, l}, l, 6);
    expert_down = matrix({num_experts, l, inter}, inter, 7);
  }
  if (shared && gated) shared_gate = matrix({shared_inter, d}, d, 8);
  if (shared) {
    shared_up = matrix({shared_inter, d}, d, 9);
    shared_down = matrix({d, shared_inter}, shared_inter, 10);
  }
  // The inputs and the output, for up to max_tokens tokens.
  DeviceTensor x_all = matrix({max_tokens, d}, 1, 11);
  DeviceTensor logits_all = make_tensor(DType::f32, {max_tokens, width}, seed * 1000 + 12, 2.0f, 0.0f, stream);
  DeviceTensor out_all = make_tensor(dtype, {max_tokens, d}, 0, 0.0f, 0.0f, stream);
  LATENTMOE_CUDA_CHECK(cudaStreamSynchronize(stream));

  // One runner over them: device views, used in place (declared after the buffers, so destroyed first).
  LayerWeightViews views;
  views.dtype = dtype;
  views.experts_format = config.experts_format;
  if (mxfp4) views.expert_code_order = Mxfp4CodeOrder::kernel;
  views.score_bias = bias.view;  // no gate: the router logits are given
  views.down_proj = down_proj.view;
  views.latent_norm = gamma.view;
  views.up_proj = up_proj.view;
  views.expert_gate = expert_gate.view;
  views.expert_up = expert_up.view;
  views.expert_down = expert_down.view;
  views.expert_gate_scale = gate_scale.view;
  views.expert_up_scale = up_scale.view;
  views.expert_down_scale = down_scale.view;
  views.shared_gate = shared_gate.view;
  views.shared_up = shared_up.view;
  views.shared_down = shared_down.view;
  const ParallelConfig parallel{.tp_size = 1, .rank = 0};
  std::vector<std::unique_ptr<Communicator> > group = make_in_process_group(1);  // one rank: no collective runs
  RunnerOptions runner_options;
  runner_options.backend = BackendKind::cuda;
  runner_options.max_tokens = max_tokens;
  runner_options.device_ordinal = options.device;
  Runner runner(config, parallel, views, *group[0], runner_options);
  bench_access::set_skinny_max_tokens(runner, options.skinny_max_tokens);
  bench_access::set_gemv_max_tokens(runner, options.gemv_max_tokens);
  bench_access::set_shared_gemv_ctas_per_sm(runner, options.shared_gemv_ctas_per_sm);
  if (options.mxfp4_pairs_max_tokens >= 0)
    bench_access::set_mxfp4_pairs_max_tokens(runner, options.mxfp4_pairs_max_tokens);

  // The phases run the runner's backend operations on its own weights and workspaces, on its own stream.
  bench_access::RunnerState& state = bench_access::state_of(runner);
  bench_access::Backend& backend = *state.backend;
  const auto phase_stream = static_cast<cudaStream_t>(backend.stream());
  const bench_access::RoutingParams& routing = state.routing;
  const bench_access::ActivationParams& activation = state.activation;
  const bench_access::MlpWeights experts{state.expert_gate.view,       state.expert_up.view,
                                         state.expert_down.view,       state.config.experts_format,
                                         state.expert_gate_scale.view, state.expert_up_scale.view,
                                         state.expert_down_scale.view};
  const bench_access::MlpWeights shared_mlp{
      state.shared_gate.view, state.shared_up.view, state.shared_down.view, ExpertWeightFormat::dense, {}, {}, {}};
  const float eps = static_cast<float>(config.rms_norm_eps);

  nlohmann::json rows = nlohmann::json::array();
  std::printf("# preset %s  tp-shard %d  dtype %s  E %lld  k %lld  d %lld  l %lld  I/tp %lld  Is/tp %lld\n",
              preset.c_str(), tp_shard, std::string(dtype_name(dtype)).c_str(), (long long)num_experts, (long long)k,
              (long long)d, (long long)l, (long long)inter, (long long)shared_inter);
  std::printf("# %6s %9s %9s %10s %9s %8s %8s %10s %10s %10s %8s %8s %9s %8s\n", "tokens", "route_us", "down_us",
              "experts_us", "shared_us", "norm_us", "up_us", "total_us", "graph_us", "floor_us", "%floor", "%graph",
              "experts%", "touched");
  for (int64_t tokens : options.tokens) {
    LATENTMOE_CHECK(tokens >= 1, "--tokens must be positive");
    auto rows_of = [&](const TensorView& tensor) { return tensor.slice_rows(0, tokens); };
    const TensorView x = rows_of(x_all.view), logits = rows_of(logits_all.view), out = rows_of(out_all.view);
    const TensorView ids = rows_of(state.topk_ids.view), weights = rows_of(state.topk_weights.view),
                     zero = rows_of(state.zero_weight_sum.view), z = rows_of(state.latent_in.view),
                     latent = rows_of(state.latent_partial.view), normed = rows_of(state.latent_reduced.view),
                     shared_out = rows_of(state.shared_partial.view);
    const TensorView bias_view = state.score_bias.view;
    // Route once to learn which experts this token set touches (the experts' byte floor).
    backend.route(routing, logits, bias_view, ids, weights, zero);
    HostTensor host_ids(DType::i32, {tokens, k});
    backend.copy(ids, host_ids.view());  // a copy to the host has completed when copy() returns
    std::set<int32_t> touched;
    int64_t num_pairs = 0;
    for (int64_t i = 0; i < tokens * k; ++i) {
      const int32_t id = host_ids.data_as<int32_t>()[i];
      if (id < num_experts) {
        touched.insert(id);
        ++num_pairs;
      }
    }
    const double t = static_cast<double>(tokens);
    std::vector<PhaseResult> phases;
    auto phase = [&](const char* name, double bytes, double flops, const std::function<void()>& body) {
      PhaseResult result{name, timer.median_us(phase_stream, body), bytes, flops, 0};
      set_floor(result, ceilings);
      phases.push_back(result);
    };
    phase("route", t * width * 4 + width * 4 + t * k * 8 + t * 4, 0,
          [&] { backend.route(routing, logits, bias_view, ids, weights, zero); });
    phase("down_proj", (l * d + t * d + t * l) * element, 2 * t * d * l,
          [&] { backend.linear(x, state.down_proj.view, z, false); });
    phase("experts",
          static_cast<double>(touched.size()) * num_matrices * inter * l * expert_element + 2 * t * l * element +
              t * k * 8,
          2.0 * num_pairs * l * inter * num_matrices,
          [&] { backend.routed_experts(activation, z, ids, weights, experts, latent); });
    if (shared) {
      phase("shared", (num_matrices * shared_inter * d + 2 * t * d) * element, 2 * t * d * shared_inter * num_matrices,
            [&] { backend.dense_mlp(activation, x, shared_mlp, shared_out); });
    }
    if (config.use_latent_norm) {
      phase("norm", 2 * t * l * element + l * 4, 0,
            [&] { backend.rms_norm(latent, state.latent_norm.view, eps, normed); });
    }
    const TensorView up_in = config.use_latent_norm ? normed : latent;
    // One rank with a shared expert: the shared expert writes `out` and the up-projection adds into it
    // (core/tails.cpp, native on one rank), so there is no separate add.
    phase("up_proj", (d * l + t * l + (shared ? 2 : 1) * t * d) * element, 2 * t * d * l,
          [&] { backend.linear(up_in, state.up_proj.view, out, /*accumulate=*/shared); });
    // The norm and W_up as the runner's tail runs them on one rank, in one call (rms_norm_linear: at
    // decode the norm inside the GEMV). JSON only, beside `norm` and `up_proj`; not added to the total.
    if (config.use_latent_norm) {
      phase("norm_up", (d * l + t * l + (shared ? 2 : 1) * t * d) * element + l * 4, 2 * t * d * l, [&] {
        backend.rms_norm_linear(latent, state.latent_norm.view, eps, normed, state.up_proj.view, out, shared);
      });
    }

    PhaseResult total{"total", 0, 0, 0, 0};
    for (const auto& p : phases) {
      if (p.name == "norm_up") continue;  // the same work as norm + up_proj
      total.bytes += p.bytes;
      total.flops += p.flops;
    }
    // The whole layer through the public API: Runner::forward on the bench's stream (tier native:
    // at tp 1 no collective runs; the runner overlaps the routing with W_down and the shared expert
    // with the routed experts on its aux stream).
    ForwardInputs inputs;
    inputs.hidden_states = x;
    inputs.router_logits = logits;
    inputs.tier = TailTier::native;
    ForwardOutputs outputs;
    outputs.output = out;
    auto whole_layer = [&] { runner.forward(inputs, outputs, stream); };
    total.time_us = timer.median_us(stream, whole_layer);
    set_floor(total, ceilings);
    // The same forward captured once into a CUDA graph and replayed, as an engine runs decode: no
    // host launch gaps between the kernels.
    PhaseResult graph_total = total;
    {
      const bench::Graph graph(stream, whole_layer);
      graph_total.time_us = timer.median_us(stream, [&] { graph.launch(stream); });
    }

    std::map<std::string, const PhaseResult*> by_name;
    for (const auto& p : phases) by_name[p.name] = &p;
    auto time_of = [&](const char* name) { return by_name.count(name) ? by_name[name]->time_us : 0.0; };
    const PhaseResult& expert_phase = *by_name["experts"];
    std::printf("  %6lld %9.1f %9.1f %10.1f %9.1f %8.1f %8.1f %10.1f %10.1f %10.1f %7.1f%% %7.1f%% %8.1f%% %8zu\n",
                (long long)tokens, time_of("route"), time_of("down_proj"), time_of("experts"), time_of("shared"),
                time_of("norm"), time_of("up_proj"), total.time_us, graph_total.time_us, total.floor_us,
                100 * total.fraction_of_floor(), 100 * graph_total.fraction_of_floor(),
                100 * expert_phase.fraction_of_floor(), touched.size());
    std::fflush(stdout);

    nlohmann::json row;
    row["preset"] = preset;
    row["tp_shard"] = tp_shard;
    row["tokens"] = tokens;
    row["dtype"] = std::string(dtype_name(dtype));
    row["touched_experts"] = touched.size();
    row["routed_pairs"] = num_pairs;
    for (const auto& p : phases) {
      row["phases"][p.name] = {{"time_us", p.time_us},
                               {"floor_us", p.floor_us},
                               {"fraction_of_floor", p.fraction_of_floor()},
                               {"bytes", p.bytes},
                               {"flops", p.flops},
                               {"tb_per_s", p.bytes / (p.time_us * 1e-6) / 1e12},
                               {"tflop_per_s", p.flops / (p.time_us * 1e-6) / 1e12}};
    }
    row["experts_fraction_of_floor"] = expert_phase.fraction_of_floor();
    row["total_time_us"] = total.time_us;
    row["total_floor_us"] = total.floor_us;
    row["total_fraction_of_floor"] = total.fraction_of_floor();
    row["graph_total_time_us"] = graph_total.time_us;
    row["graph_total_fraction_of_floor"] = graph_total.fraction_of_floor();
    row["total_byte_floor_us"] = 1e6 * total.bytes / ceilings.copy_bytes_per_s;
    rows.push_back(row);
  }
  LATENTMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  backend.synchronize();
  return rows;
}

}  // namespace

void run_bench_layer(const BenchLayerOptions& options) {
  for (const auto& preset : options.presets) preset_config(preset);
  LATENTMOE_CHECK(!options.tokens.empty() && !options.tp_shards.empty() && !options.presets.empty(),
                  "bench layer needs at least one preset, tp shard and token count");
  DType dtype;
  if (options.dtype == "bf16") {
    dtype = DType::bf16;
  } else if (options.dtype == "f16") {
    dtype = DType::f16;
  } else {
    detail::throw_error("--dtype must be bf16 or f16, got '", options.dtype, "'");
  }
  const int num_devices = cuda_device_count();
  LATENTMOE_CHECK(num_devices > options.device && options.device >= 0, "bench layer: CUDA device ", options.device,
                  " is not present (", num_devices, " found)");
  // The bench's buffers, streams and timer live on this device, as does every runner (device_ordinal).
  LATENTMOE_CUDA_CHECK(cudaSetDevice(options.device));

  const CudaDeviceProperties properties = cuda_device_properties(options.device);
  bench::Timer timer({.warmup = options.warmup, .iterations = options.iterations, .flush_l2 = true});
  const Ceilings ceilings = measure_ceilings(timer, options.device);
  std::printf("# latentmoe bench layer  device %s (sm_%d%d, %d SMs)  copy %.2f TB/s  dense bf16 GEMM %.0f TFLOP/s\n",
              properties.name.c_str(), properties.major, properties.minor, properties.num_sms,
              ceilings.copy_bytes_per_s / 1e12, ceilings.gemm_flops_per_s / 1e12);
  std::printf("# times are medians of %d runs after %d warm-up runs, L2 flushed before each; %%floor = floor/time\n",
              options.iterations, options.warmup);

  nlohmann::json report;
  report["device"] = properties.name;
  report["compute_capability"] = std::to_string(properties.major) + std::to_string(properties.minor);
  report["commit"] = options.commit;
  report["skinny_max_tokens"] = options.skinny_max_tokens;
  report["gemv_max_tokens"] = options.gemv_max_tokens;
  report["shared_gemv_ctas_per_sm"] = options.shared_gemv_ctas_per_sm;
  report["mxfp4_pairs_max_tokens"] = options.mxfp4_pairs_max_tokens;  // -1: the backend's own
  report["experts"] = options.experts;
  report["ceilings"] = {{"copy_tb_per_s", ceilings.copy_bytes_per_s / 1e12},
                        {"gemm_bf16_tflop_per_s", ceilings.gemm_flops_per_s / 1e12}};
  report["method"] =
      "median of CUDA-event timings after warm-up, L2 flushed before each run; floor = max(bytes / copy "
      "bandwidth, flops / dense GEMM rate), both measured in this run";
  report["rows"] = nlohmann::json::array();
  report["skipped"] = nlohmann::json::array();
  for (const auto& preset : options.presets) {
    for (int tp_shard : options.tp_shards) {
      // MXFP4 experts are sharded along I in whole scale groups: a shard that splits one is not a layer
      // this format can have (nemotron3-super's I 2688 / 8 = 336). Said, recorded, and left out.
      const int64_t shard_i = preset_config(preset).intermediate_size / tp_shard;
      if (options.experts == "mxfp4" && shard_i % kMxfp4GroupSize != 0) {
        const std::string why = "MXFP4 experts need moe_intermediate_size / tp (" + std::to_string(shard_i) +
                                ") to be a multiple of " + std::to_string(kMxfp4GroupSize);
        std::printf("# preset %s  tp-shard %d: skipped, %s\n", preset.c_str(), tp_shard, why.c_str());
        report["skipped"].push_back({{"preset", preset}, {"tp_shard", tp_shard}, {"why", why}});
        continue;
      }
      for (auto& row : bench_one(preset, tp_shard, options, ceilings, dtype, timer)) report["rows"].push_back(row);
    }
  }
  bench::Repro repro("latentmoe bench layer");
  repro.flag("--preset", options.presets).flag("--tp-shard", options.tp_shards).flag("--tokens", options.tokens);
  if (options.skinny_max_tokens != 8) repro.flag("--skinny-max-tokens", options.skinny_max_tokens);
  if (options.gemv_max_tokens != 1) repro.flag("--gemv-max-tokens", options.gemv_max_tokens);
  if (options.shared_gemv_ctas_per_sm != 0) repro.flag("--shared-gemv-ctas-per-sm", options.shared_gemv_ctas_per_sm);
  if (options.mxfp4_pairs_max_tokens >= 0) repro.flag("--mxfp4-pairs-max-tokens", options.mxfp4_pairs_max_tokens);
  if (options.experts != "dense") repro.flag("--experts", options.experts);
  repro.print();
  report["repro"] = repro.line();
  if (!options.json_path.empty()) bench::write_json(options.json_path, report);
}

#endif

}  // namespace latentmoe::tools

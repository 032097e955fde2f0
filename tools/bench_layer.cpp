// latentmoe bench layer (see bench_layer.h). Method (docs/PERFORMANCE.md):
//   - ceilings measured first, in the same process: device-to-device copy bandwidth (bytes read +
//     written over time) and the dense bf16 GEMM rate of the backend's own linear() (8192^3);
//   - weights and inputs are seeded random data made on the GPU (never zeros); router logits are
//     U(-2, 2) with a correction bias of U(-1e-3, 1e-3), so each token's experts are close to
//     uniformly random (the touched-expert counts are reported);
//   - before every timed run the L2 is flushed by reading a buffer twice its size, so weights are
//     read from HBM as they are in a real model whose other layers evict them (reading, not
//     writing: a memset would leave dirty lines whose write-back the timed kernels would pay for);
//   - each phase is timed alone with CUDA events after warm-up; the median of the runs is reported;
//   - floors: the fewest bytes a phase must move over the copy bandwidth, and its FLOPs over the GEMM
//     rate; the larger is the floor; fraction_of_floor = floor / time (1.0 = at the ceiling). The
//     routed experts' bytes count only the distinct experts the routing touched.
#include "bench_layer.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "latentmoe/config.h"
#include "latentmoe/error.h"
#include "latentmoe/presets.h"

#ifdef LATENTMOE_WITH_CUDA
#include <cuda_runtime_api.h>

#include "core/backend.h"
#include "cuda/cuda_backend.h"
#include "cuda/cuda_check.h"
#include "cuda/fill.h"
#endif

namespace latentmoe::tools {

#ifndef LATENTMOE_WITH_CUDA

void run_bench_layer(const BenchLayerOptions& options) {
  for (const auto& preset : options.presets) preset_config(preset);
  detail::throw_error("bench layer needs the CUDA backend: latentmoe was built without CUDA");
}

#else

namespace {

using detail::DeviceBuffer;

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

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

// Times `body` enqueued on `stream`: warm-up, then per run an L2 flush outside the timed region
// and events around the body. Returns the median in microseconds.
class Timer {
 public:
  Timer(cudaStream_t stream, size_t l2_bytes, detail::Backend& backend, int warmup, int iterations)
      : stream_(stream), warmup_(warmup), iterations_(iterations) {
    flush_bytes_ = std::max<size_t>(2 * l2_bytes, 64u << 20) / 16 * 16;
    flush_ = backend.allocate(flush_bytes_);
    sink_ = backend.allocate(16);
    LATENTMOE_CUDA_CHECK(cudaMemsetAsync(flush_.get(), 0, flush_bytes_, stream));
    LATENTMOE_CUDA_CHECK(cudaEventCreate(&start_));
    LATENTMOE_CUDA_CHECK(cudaEventCreate(&stop_));
  }
  ~Timer() {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
  }

  template <class Body>
  double median_us(Body&& body, bool flush = true) {
    std::vector<double> times;
    for (int run = 0; run < warmup_ + iterations_; ++run) {
      // Evict L2 by reading (a memset would leave it full of dirty lines, whose write-back to DRAM
      // the timed kernels would pay for: up to 2x on a 50 MB phase).
      if (flush) cuda::read_through(flush_.get(), flush_bytes_, static_cast<uint32_t*>(sink_.get()), stream_);
      LATENTMOE_CUDA_CHECK(cudaEventRecord(start_, stream_));
      body();
      LATENTMOE_CUDA_CHECK(cudaEventRecord(stop_, stream_));
      LATENTMOE_CUDA_CHECK(cudaEventSynchronize(stop_));
      float ms = 0;
      LATENTMOE_CUDA_CHECK(cudaEventElapsedTime(&ms, start_, stop_));
      if (run >= warmup_) times.push_back(1000.0 * ms);
    }
    return median(times);
  }

 private:
  cudaStream_t stream_;
  int warmup_, iterations_;
  size_t flush_bytes_;
  DeviceBuffer flush_;
  DeviceBuffer sink_;
  cudaEvent_t start_{}, stop_{};
};

struct DeviceTensorOwner {
  DeviceBuffer buffer;
  TensorView view;
};

DeviceTensorOwner make_tensor(detail::Backend& backend, DType dtype, std::vector<int64_t> shape, uint64_t seed,
                              float scale, float offset, cudaStream_t stream) {
  DeviceTensorOwner tensor;
  int64_t count = 1;
  for (int64_t extent : shape) count *= extent;
  tensor.buffer = backend.allocate(static_cast<size_t>(std::max<int64_t>(count, 1)) * dtype_size(dtype));
  tensor.view = TensorView(tensor.buffer.get(), dtype, shape, Device::cuda);
  if (is_compute_dtype(dtype) && scale != 0)
    cuda::fill_uniform(tensor.buffer.get(), dtype, count, seed, scale, offset, stream);
  return tensor;
}

Ceilings measure_ceilings(cuda::CudaBackend& backend, Timer& timer, cudaStream_t stream) {
  Ceilings ceilings;
  {
    const size_t bytes = size_t{2} << 30;
    DeviceBuffer a = backend.allocate(bytes), b = backend.allocate(bytes);
    cuda::fill_uniform(a.get(), DType::f32, static_cast<int64_t>(bytes / 4), 1, 1.0f, 0.0f, stream);
    const double us = timer.median_us(
        [&] { LATENTMOE_CUDA_CHECK(cudaMemcpyAsync(b.get(), a.get(), bytes, cudaMemcpyDeviceToDevice, stream)); });
    ceilings.copy_bytes_per_s = 2.0 * static_cast<double>(bytes) / (us * 1e-6);
  }
  {
    const int64_t n = 8192;
    auto x = make_tensor(backend, DType::bf16, {n, n}, 2, 1.0f, 0.0f, stream);
    auto w = make_tensor(backend, DType::bf16, {n, n}, 3, 1.0f, 0.0f, stream);
    auto y = make_tensor(backend, DType::bf16, {n, n}, 0, 0.0f, 0.0f, stream);
    const double us = timer.median_us([&] { backend.linear(x.view, w.view, y.view, false); });
    ceilings.gemm_flops_per_s = 2.0 * n * n * n / (us * 1e-6);
  }
  return ceilings;
}

void set_floor(PhaseResult& phase, const Ceilings& ceilings) {
  phase.floor_us = 1e6 * std::max(phase.bytes / ceilings.copy_bytes_per_s, phase.flops / ceilings.gemm_flops_per_s);
}

nlohmann::json bench_one(const std::string& preset, int tp_shard, const BenchLayerOptions& options,
                         const Ceilings& ceilings, DType dtype) {
  const LayerConfig full = preset_config(preset);
  LATENTMOE_CHECK(tp_shard >= 1 && full.intermediate_size % tp_shard == 0 &&
                      full.shared_intermediate_size % tp_shard == 0 && full.hidden_size % tp_shard == 0 &&
                      full.latent_size % tp_shard == 0,
                  "--tp-shard ", tp_shard, " does not divide the shapes of ", preset);
  // One rank's share: the experts' and the shared expert's intermediate sizes divided by tp.
  LayerConfig config = full;
  config.intermediate_size /= tp_shard;
  config.shared_intermediate_size /= tp_shard;

  const int64_t d = config.hidden_size, l = config.latent_size, num_experts = config.num_experts, k = config.top_k,
                inter = config.intermediate_size, shared_inter = config.shared_intermediate_size;
  const int64_t width = config.num_router_outputs();
  const int64_t max_tokens = *std::max_element(options.tokens.begin(), options.tokens.end());
  const double element = static_cast<double>(dtype_size(dtype));
  const int num_matrices = config.is_gated() ? 3 : 2;

  cuda::CudaBackend backend(options.device);
  backend.set_skinny_max_tokens(options.skinny_max_tokens);
  backend.set_gemv_max_tokens(options.gemv_max_tokens);
  const auto stream = static_cast<cudaStream_t>(backend.stream());
  int l2_bytes = 0;
  LATENTMOE_CUDA_CHECK(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, options.device));
  Timer timer(stream, static_cast<size_t>(l2_bytes), backend, options.warmup, options.iterations);

  const uint64_t seed = options.seed;
  auto matrix = [&](std::vector<int64_t> shape, int64_t fan_in, uint64_t salt) {
    return make_tensor(backend, dtype, std::move(shape), seed * 1000 + salt, 1.0f / std::sqrt(float(fan_in)), 0.0f,
                       stream);
  };
  auto down_proj = matrix({l, d}, d, 1);
  auto up_proj = matrix({d, l}, l, 2);
  auto gamma = make_tensor(backend, DType::f32, {l}, seed * 1000 + 3, 0.25f, 1.0f, stream);
  // A small correction bias: a bias as wide as the top scores' spread would send every token to the same
  // experts; this keeps each token's experts close to uniformly random, like the peers' routing.
  auto bias = make_tensor(backend, DType::f32, {width}, seed * 1000 + 4, 0.001f, 0.0f, stream);
  DeviceTensorOwner expert_gate;
  if (config.is_gated()) expert_gate = matrix({num_experts, inter, l}, l, 5);
  auto expert_up = matrix({num_experts, inter, l}, l, 6);
  auto expert_down = matrix({num_experts, l, inter}, inter, 7);
  DeviceTensorOwner shared_gate;
  if (config.is_gated()) shared_gate = matrix({shared_inter, d}, d, 8);
  auto shared_up = matrix({shared_inter, d}, d, 9);
  auto shared_down = matrix({d, shared_inter}, shared_inter, 10);
  backend.prepare(config, dtype, max_tokens, 1);

  auto x_all = matrix({max_tokens, d}, 1, 11);
  auto logits_all = make_tensor(backend, DType::f32, {max_tokens, width}, seed * 1000 + 12, 2.0f, 0.0f, stream);
  auto ids_all = make_tensor(backend, DType::i32, {max_tokens, k}, 0, 0, 0, stream);
  auto weights_all = make_tensor(backend, DType::f32, {max_tokens, k}, 0, 0, 0, stream);
  auto zero_all = make_tensor(backend, DType::f32, {max_tokens}, 0, 0, 0, stream);
  auto z_all = make_tensor(backend, dtype, {max_tokens, l}, 0, 0, 0, stream);
  auto latent_all = make_tensor(backend, dtype, {max_tokens, l}, 0, 0, 0, stream);
  auto normed_all = make_tensor(backend, dtype, {max_tokens, l}, 0, 0, 0, stream);
  auto shared_all = make_tensor(backend, dtype, {max_tokens, d}, 0, 0, 0, stream);
  auto out_all = make_tensor(backend, dtype, {max_tokens, d}, 0, 0, 0, stream);
  LATENTMOE_CUDA_CHECK(cudaStreamSynchronize(stream));

  const detail::RoutingParams routing = detail::RoutingParams::from_config(config);
  const detail::ActivationParams activation = detail::ActivationParams::from_config(config);
  const detail::MlpWeights experts{expert_gate.view, expert_up.view, expert_down.view};
  const detail::MlpWeights shared{shared_gate.view, shared_up.view, shared_down.view};

  nlohmann::json rows = nlohmann::json::array();
  std::printf("# preset %s  tp-shard %d  dtype %s  E %lld  k %lld  d %lld  l %lld  I/tp %lld  Is/tp %lld\n",
              preset.c_str(), tp_shard, std::string(dtype_name(dtype)).c_str(), (long long)num_experts, (long long)k,
              (long long)d, (long long)l, (long long)inter, (long long)shared_inter);
  std::printf("# %6s %9s %9s %10s %9s %8s %8s %10s %10s %10s %8s %8s %9s %8s\n", "tokens", "route_us", "down_us",
              "experts_us", "shared_us", "norm_us", "up_us", "total_us", "graph_us", "floor_us", "%floor", "%graph",
              "experts%", "touched");
  for (int64_t tokens : options.tokens) {
    LATENTMOE_CHECK(tokens >= 1, "--tokens must be positive");
    auto rows_of = [&](const DeviceTensorOwner& tensor) { return tensor.view.slice_rows(0, tokens); };
    const TensorView x = rows_of(x_all), logits = rows_of(logits_all), ids = rows_of(ids_all),
                     weights = rows_of(weights_all), zero = zero_all.view.slice_rows(0, tokens), z = rows_of(z_all),
                     latent = rows_of(latent_all), normed = rows_of(normed_all), shared_out = rows_of(shared_all),
                     out = rows_of(out_all);
    // Route once to learn which experts this token set touches (the experts' byte floor).
    backend.route(routing, logits, bias.view, ids, weights, zero);
    std::vector<int32_t> host_ids(static_cast<size_t>(tokens * k));
    LATENTMOE_CUDA_CHECK(
        cudaMemcpyAsync(host_ids.data(), ids.data(), host_ids.size() * 4, cudaMemcpyDeviceToHost, stream));
    LATENTMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    std::set<int32_t> touched;
    int64_t num_pairs = 0;
    for (int32_t id : host_ids) {
      if (id < num_experts) {
        touched.insert(id);
        ++num_pairs;
      }
    }
    const double t = static_cast<double>(tokens);
    std::vector<PhaseResult> phases;
    auto phase = [&](const char* name, double bytes, double flops, auto&& body) {
      PhaseResult result{name, timer.median_us(body), bytes, flops, 0};
      set_floor(result, ceilings);
      phases.push_back(result);
    };
    phase("route", t * width * 4 + width * 4 + t * k * 8 + t * 4, 0,
          [&] { backend.route(routing, logits, bias.view, ids, weights, zero); });
    phase("down_proj", (l * d + t * d + t * l) * element, 2 * t * d * l,
          [&] { backend.linear(x, down_proj.view, z, false); });
    phase("experts",
          static_cast<double>(touched.size()) * num_matrices * inter * l * element + 2 * t * l * element + t * k * 8,
          2.0 * num_pairs * l * inter * num_matrices,
          [&] { backend.routed_experts(activation, z, ids, weights, experts, latent); });
    phase("shared", (num_matrices * shared_inter * d + 2 * t * d) * element, 2 * t * d * shared_inter * num_matrices,
          [&] { backend.dense_mlp(activation, x, shared, shared_out); });
    if (config.use_latent_norm) {
      phase("norm", 2 * t * l * element + l * 4, 0, [&] { backend.rms_norm(latent, gamma.view, 1e-5f, normed); });
    }
    const TensorView up_in = config.use_latent_norm ? normed : latent;
    phase("up_proj", (d * l + t * l + t * d) * element, 2 * t * d * l,
          [&] { backend.linear(up_in, up_proj.view, out, false); });
    phase("add", 3 * t * d * element, 0, [&] { backend.add(out, shared_out, out); });

    PhaseResult total{"total", 0, 0, 0, 0};
    for (const auto& p : phases) {
      total.bytes += p.bytes;
      total.flops += p.flops;
    }
    // As the runner orders it (src/core/tails.cpp): routing beside W_down, the shared expert beside
    // the routed experts (two streams), then the tail.
    auto whole_layer = [&] {
      backend.run_overlapped([&] { backend.linear(x, down_proj.view, z, false); },
                             [&] { backend.route(routing, logits, bias.view, ids, weights, zero); });
      backend.run_overlapped([&] { backend.routed_experts(activation, z, ids, weights, experts, latent); },
                             [&] { backend.dense_mlp(activation, x, shared, shared_out); });
      if (config.use_latent_norm) backend.rms_norm(latent, gamma.view, 1e-5f, normed);
      backend.linear(up_in, up_proj.view, out, false);
      backend.add(out, shared_out, out);
    };
    total.time_us = timer.median_us(whole_layer);
    set_floor(total, ceilings);
    // The same sequence captured once into a CUDA graph and replayed, as an engine runs decode: no
    // host launch gaps between the kernels.
    PhaseResult graph_total = total;
    {
      cudaGraph_t graph = nullptr;
      LATENTMOE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      whole_layer();
      LATENTMOE_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
      cudaGraphExec_t exec = nullptr;
      const cudaError_t err = cudaGraphInstantiate(&exec, graph, 0);
      cudaGraphDestroy(graph);
      LATENTMOE_CUDA_CHECK(err);
      graph_total.time_us = timer.median_us([&] { LATENTMOE_CUDA_CHECK(cudaGraphLaunch(exec, stream)); });
      cudaGraphExecDestroy(exec);
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
  LATENTMOE_CHECK(cuda::cuda_device_count() > options.device && options.device >= 0, "bench layer: CUDA device ",
                  options.device, " is not present (", cuda::cuda_device_count(), " found)");

  cudaDeviceProp properties{};
  LATENTMOE_CUDA_CHECK(cudaGetDeviceProperties(&properties, options.device));
  Ceilings ceilings;
  {
    cuda::CudaBackend backend(options.device);
    const auto stream = static_cast<cudaStream_t>(backend.stream());
    Timer timer(stream, static_cast<size_t>(properties.l2CacheSize), backend, options.warmup, options.iterations);
    ceilings = measure_ceilings(backend, timer, stream);
  }
  std::printf("# latentmoe bench layer  device %s (sm_%d%d, %d SMs)  copy %.2f TB/s  dense bf16 GEMM %.0f TFLOP/s\n",
              properties.name, properties.major, properties.minor, properties.multiProcessorCount,
              ceilings.copy_bytes_per_s / 1e12, ceilings.gemm_flops_per_s / 1e12);
  std::printf("# times are medians of %d runs after %d warm-up runs, L2 flushed before each; %%floor = floor/time\n",
              options.iterations, options.warmup);

  nlohmann::json report;
  report["device"] = properties.name;
  report["compute_capability"] = std::to_string(properties.major) + std::to_string(properties.minor);
  report["commit"] = options.commit;
  report["skinny_max_tokens"] = options.skinny_max_tokens;
  report["gemv_max_tokens"] = options.gemv_max_tokens;
  report["ceilings"] = {{"copy_tb_per_s", ceilings.copy_bytes_per_s / 1e12},
                        {"gemm_bf16_tflop_per_s", ceilings.gemm_flops_per_s / 1e12}};
  report["method"] =
      "median of CUDA-event timings after warm-up, L2 flushed before each run; floor = max(bytes / copy "
      "bandwidth, flops / dense GEMM rate), both measured in this run";
  report["rows"] = nlohmann::json::array();
  for (const auto& preset : options.presets) {
    for (int tp_shard : options.tp_shards) {
      for (auto& row : bench_one(preset, tp_shard, options, ceilings, dtype)) report["rows"].push_back(row);
    }
  }
  std::ostringstream repro_stream;
  auto join = [&repro_stream](const auto& values) {
    for (size_t i = 0; i < values.size(); ++i) repro_stream << (i ? "," : "") << values[i];
  };
  repro_stream << "latentmoe bench layer --preset ";
  join(options.presets);
  repro_stream << " --tp-shard ";
  join(options.tp_shards);
  repro_stream << " --tokens ";
  join(options.tokens);
  if (options.skinny_max_tokens != 8) repro_stream << " --skinny-max-tokens " << options.skinny_max_tokens;
  if (options.gemv_max_tokens != 0) repro_stream << " --gemv-max-tokens " << options.gemv_max_tokens;
  const std::string repro = repro_stream.str();
  std::printf("# repro: %s\n", repro.c_str());
  report["repro"] = repro;
  if (!options.json_path.empty()) {
    std::ofstream file(options.json_path);
    LATENTMOE_CHECK(file.good(), "cannot write ", options.json_path);
    file << report.dump(2) << "\n";
  }
}

#endif

}  // namespace latentmoe::tools

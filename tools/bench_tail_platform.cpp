// latentmoe bench tail: the backend-specific pieces (bench_tail_platform.h).
#include "bench_tail_platform.h"

#include <cstdio>
#include <cstring>
#include <fstream>
#include <thread>

#include "latentmoe/device.h"
#include "latentmoe/dtype.h"
#include "latentmoe/error.h"
#include "latentmoe/gpu_group.h"
#include "latentmoe/in_process_group.h"
#include "latentmoe/random.h"
#include "tool_common.h"

#ifdef LATENTMOE_WITH_CUDA
#include "harness/timing.h"  // EventClock, copy_bandwidth: the CUDA half of the harness
#endif

namespace latentmoe::tools {
namespace {

[[noreturn]] void no_cuda() { detail::throw_error("bench tail --backend cuda: latentmoe was built without CUDA"); }

}  // namespace

void check_group_request(BackendKind backend, const GroupRequest& request) {
  const GpuPlacement placement = parse_gpu_placement(request.placement);
  if (backend == BackendKind::cpu) {
    LATENTMOE_CHECK(placement != GpuPlacement::devices,
                    "--placement devices needs the CUDA backend (the CPU's ranks are threads)");
    LATENTMOE_CHECK(request.one_shot, "--collectives nccl needs the CUDA backend");
  }
}

BenchGroup make_bench_group(BackendKind backend, int tp, DType dtype, int64_t max_tokens, int64_t per_token_elements,
                            const GroupRequest& request) {
  check_group_request(backend, request);
  BenchGroup group;
  group.placement = "simulated";
  if (backend == BackendKind::cpu) {
    group.comms = make_in_process_group(tp);
    group.rank_device.assign(static_cast<size_t>(tp), -1);
    return group;
  }
  std::string why;
  const GpuPlacement placement = resolve_gpu_placement(parse_gpu_placement(request.placement), tp, &why);
  LATENTMOE_CHECK(request.one_shot || placement == GpuPlacement::devices,
                  "--collectives nccl needs one GPU per rank (--placement devices): ", why);
  std::fprintf(stderr, "latentmoe bench tail: tp %d: %s\n", tp, why.c_str());
#ifdef LATENTMOE_WITH_CUDA
  group.gate = std::make_shared<bench::StartGate>();
#endif
  GpuGroupOptions options;
  options.device = request.device;
  options.dtype = dtype;
  options.capacity_elements = max_tokens * per_token_elements;
  options.timeout = default_collective_timeout();
  if (placement == GpuPlacement::devices) {
    const int64_t one_shot_tokens = request.one_shot_tokens_for(tp);
    size_nccl_group(options, max_tokens, per_token_elements, one_shot_tokens);
    options.one_shot = request.one_shot;
    if (request.one_shot) {
      std::fprintf(stderr, "latentmoe bench tail: tp %d: one-shot collectives up to %lld tokens, NCCL above\n", tp,
                   static_cast<long long>(one_shot_tokens));
    }
    group.comms = make_nccl_gpu_group(tp, options);
    group.placement = "devices";
    for (int rank = 0; rank < tp; ++rank) group.rank_device.push_back(rank);
    return group;
  }
  group.comms = make_simulated_gpu_group(tp, options);
  group.rank_device.assign(static_cast<size_t>(tp), request.device);
  return group;
}

std::string describe_device(BackendKind backend, int device) {
  if (backend == BackendKind::cpu) {
    return cpu_model() + ", " + std::to_string(std::thread::hardware_concurrency()) + " hardware threads";
  }
  return cuda_device_name(device);
}

void bind_thread_to_device(BackendKind backend, int device) {
  if (backend == BackendKind::cpu) return;
#ifdef LATENTMOE_WITH_CUDA
  LATENTMOE_CUDA_CHECK(cudaSetDevice(device));
#else
  no_cuda();
#endif
}

std::unique_ptr<bench_access::Backend> make_scratch_backend(BackendKind backend, int device) {
  if (backend == BackendKind::cpu) return bench_access::make_cpu_backend();
#ifdef LATENTMOE_WITH_CUDA
  return bench_access::make_cuda_backend(device);
#else
  no_cuda();
#endif
}

void fill_uniform(bench_access::Backend& backend, const TensorView& view, uint64_t seed, float scale, float offset) {
  LATENTMOE_CHECK(view.is_contiguous() && is_compute_dtype(view.dtype()), "bench tail: cannot fill a ",
                  dtype_name(view.dtype()), " tensor of shape ", view.shape_string());
  const int64_t count = view.numel();
  if (view.device() == Device::cpu) {
    for (int64_t i = 0; i < count; ++i) {
      store_from_float(view.data(), view.dtype(), i,
                       offset + scale * indexed_uniform_pm1(seed, static_cast<uint64_t>(i)));
    }
    return;
  }
#ifdef LATENTMOE_WITH_CUDA
  bench_access::fill_uniform(view.data(), view.dtype(), count, seed, scale, offset,
                             static_cast<cudaStream_t>(backend.stream()));
#else
  no_cuda();
#endif
}

std::unique_ptr<bench::RunClock> make_clock(BackendKind backend, const BenchGroup& group, StreamHandle stream,
                                            bool flush) {
  if (backend == BackendKind::cpu) return std::make_unique<bench::HostClock>();
#ifdef LATENTMOE_WITH_CUDA
  return std::make_unique<bench::EventClock>(static_cast<cudaStream_t>(stream), flush, group.gate.get());
#else
  no_cuda();
#endif
}

double measure_copy_bandwidth(BackendKind backend, int device, const bench::Runs& runs) {
  if (backend == BackendKind::cpu) {
    const size_t bytes = size_t{64} << 20;
    std::vector<char> a(bytes, 1), b(bytes, 0);
    std::vector<double> times;
    bench::HostClock clock;
    for (int run = 0; run < runs.warmup + runs.iterations; ++run) {
      clock.start();
      std::memcpy(b.data(), a.data(), bytes);
      clock.stop();
      if (run >= runs.warmup) times.push_back(clock.elapsed_us());
    }
    LATENTMOE_CHECK(b[bytes - 1] == 1, "bench tail: the host copy did not copy");  // and is not optimised away
    return 2.0 * static_cast<double>(bytes) / (bench::median(times) * 1e-6);
  }
#ifdef LATENTMOE_WITH_CUDA
  LATENTMOE_CUDA_CHECK(cudaSetDevice(device));
  cudaStream_t stream = nullptr;
  LATENTMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  double bytes_per_s = 0;
  try {
    bench::Timer timer(runs);
    bytes_per_s = bench::copy_bandwidth(timer, stream, runs);
  } catch (...) {
    cudaStreamDestroy(stream);
    throw;
  }
  cudaStreamDestroy(stream);
  return bytes_per_s;
#else
  no_cuda();
#endif
}

}  // namespace latentmoe::tools

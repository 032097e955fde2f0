// Where does a one-shot collective's time go at one token? A measurement for docs/PERFORMANCE.md: on two
// H200s and on simulated ranks alike the fused AR+RMSNorm of one kimi-k3 latent row (3584 bf16) read
// 10-13 µs in bench tail, several times a published one-shot all-reduce. This bench times the same
// kernel (src/cuda/comm/lamport.cu) on ranks simulated on one GPU, driven from one thread, in ways that
// separate the parts:
//   empty        an empty kernel between the events: the floor of any timed launch
//   cold         one call after an L2 flush (bench tail's method)
//   warm         one call, no flush
//   chain        `chain` calls back to back, the time per call: what a run of layers pays per call
// each behind a start gate (every rank's stream is held until all are enqueued), CUDA events on every
// rank, the slowest rank's time, the median of `iterations` after 3 warm-ups. tp 1 is the kernel alone
// (no peer), tp 2 and more add the peers' stores and the polls.
// Build: the lamport_bench target (bench/CMakeLists.txt).
// Usage: lamport_bench [--tp 1,2,4] [--rows 1,8,64] [--cols 3584] [--chain 32] [--json FILE]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "cuda/comm/lamport.h"
#include "cuda/comm/lamport_communicator.h"
#include "cuda/kernels/fill.h"
#include "harness/start_gate.h"
#include "harness/timing.h"
#include "latentmoe/error.h"
#include "latentmoe/gpu_group.h"

namespace {

using latentmoe::bench::DeviceMemory;

__global__ void empty_kernel() {}

std::vector<int64_t> parse_list(const std::string& text) {
  std::vector<int64_t> values;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = text.find(',', start);
    const std::string item = text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    LATENTMOE_CHECK(!item.empty() && item.size() <= 9 && item.find_first_not_of("0123456789") == std::string::npos &&
                        std::stoll(item) >= 1,
                    "'", text, "' is not a comma list of integers in 1..999999999");
    values.push_back(std::stoll(item));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return values;
}

int run(int argc, char** argv) {
  std::vector<int64_t> tps = {1, 2, 4}, row_counts = {1, 8, 64};
  int64_t cols = 3584, chain = 32;
  std::string json_path;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    LATENTMOE_CHECK(i + 1 < argc && (a == "--tp" || a == "--rows" || a == "--cols" || a == "--chain" || a == "--json"),
                    "usage: lamport_bench [--tp 1,2,4] [--rows 1,8,64] [--cols 3584] [--chain 32] [--json FILE]");
    const std::string value = argv[++i];
    if (a == "--tp") tps = parse_list(value);
    if (a == "--rows") row_counts = parse_list(value);
    if (a == "--cols") cols = parse_list(value).at(0);
    if (a == "--chain") chain = parse_list(value).at(0);
    if (a == "--json") json_path = value;
  }
  LATENTMOE_CHECK(chain >= 1 && cols >= 1, "--chain and --cols must be at least 1");
  const int64_t max_rows = *std::max_element(row_counts.begin(), row_counts.end());
  constexpr int kWarmup = 3, kIterations = 30;

  nlohmann::json report;
  report["bench"] = "lamport_bench";
  report["rows"] = nlohmann::json::array();
  std::printf("# lamport_bench  fused AR+RMSNorm, bf16, %lld columns, ranks simulated on one GPU, median of %d (us)\n",
              static_cast<long long>(cols), kIterations);
  std::printf("# %4s %6s %9s %9s %9s %9s\n", "tp", "rows", "empty", "cold", "warm", "chain");
  for (const int64_t tp64 : tps) {
    const int tp = static_cast<int>(tp64);
    latentmoe::GpuGroupOptions options;
    options.dtype = latentmoe::DType::bf16;
    options.capacity_elements = max_rows * cols;
    options.timeout = std::chrono::milliseconds(5000);
    options.host_rendezvous = false;  // one thread drives every rank; the gate starts them together
    auto group = latentmoe::make_simulated_gpu_group(tp, options);
    std::vector<cudaStream_t> streams(static_cast<size_t>(tp));
    std::vector<DeviceMemory> in, out;
    for (int r = 0; r < tp; ++r) {
      LATENTMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&streams[r], cudaStreamNonBlocking));
      in.emplace_back(static_cast<size_t>(max_rows * cols * 2));
      out.emplace_back(static_cast<size_t>(max_rows * cols * 2));
      latentmoe::cuda::fill_uniform(in.back().get(), latentmoe::DType::bf16, max_rows * cols, 10 + r, 1.0f, 0.0f,
                                    streams[r]);
    }
    const DeviceMemory gamma(static_cast<size_t>(cols * 4));
    latentmoe::cuda::fill_uniform(gamma.get(), latentmoe::DType::f32, cols, 7, 0.25f, 1.0f, streams[0]);
    // Every rank's clock (the harness's events and start gate); rank 0's flushes the shared GPU's L2.
    latentmoe::bench::StartGate gate;
    std::vector<std::unique_ptr<latentmoe::bench::EventClock>> clocks;
    for (int r = 0; r < tp; ++r)
      clocks.push_back(std::make_unique<latentmoe::bench::EventClock>(streams[r], /*flush_l2=*/r == 0, &gate));
    LATENTMOE_CUDA_CHECK(cudaDeviceSynchronize());

    // The median over runs of the slowest rank's time of `body(rank)`, every rank held at the gate
    // until all are enqueued (one thread drives them all, so every run is held, the first included).
    auto median_of = [&](bool flush_first, const std::function<void(int)>& body) {
      std::vector<std::vector<double>> per_rank(static_cast<size_t>(tp));
      for (int run = 0; run < kWarmup + kIterations; ++run) {
        if (flush_first) clocks[0]->flush();
        for (auto& clock : clocks) clock->wait();
        for (int r = 0; r < tp; ++r) {
          clocks[r]->hold();
          clocks[r]->start();
          body(r);
          clocks[r]->stop();
        }
        for (auto& clock : clocks) clock->open();
        for (int r = 0; r < tp; ++r) {
          const double us = clocks[r]->elapsed_us();
          if (run >= kWarmup) per_rank[r].push_back(us);
        }
        for (int r = 0; r < tp; ++r) group[static_cast<size_t>(r)]->check();
      }
      return latentmoe::bench::median_of_slowest(per_rank);
    };

    for (const int64_t rows : row_counts) {
      auto call_on = [&](int r) {
        latentmoe::cuda::LamportCall call;
        call.op = latentmoe::cuda::LamportOp::all_reduce;
        call.dtype = latentmoe::DType::bf16;
        call.in = in[r].get();
        call.ld_in = cols;
        call.out = out[r].get();
        call.ld_out = cols;
        call.rows = rows;
        call.cols = cols;
        call.gamma = gamma.get();
        call.gamma_dtype = latentmoe::DType::f32;
        call.eps = 1e-6f;
        auto& comm = dynamic_cast<latentmoe::cuda::LamportCommunicator&>(*group[static_cast<size_t>(r)]);
        comm.launch(call, streams[r]);
      };
      const double empty = median_of(false, [&](int r) {
        empty_kernel<<<1, 32, 0, streams[r]>>>();
        LATENTMOE_CUDA_CHECK_LAUNCH("empty_kernel");
      });
      const double cold = median_of(true, call_on);
      const double warm = median_of(false, call_on);
      const double per_call = median_of(false,
                                        [&](int r) {
                                          for (int64_t i = 0; i < chain; ++i) call_on(r);
                                        }) /
                              static_cast<double>(chain);
      std::printf("  %4d %6lld %9.2f %9.2f %9.2f %9.2f\n", tp, static_cast<long long>(rows), empty, cold, warm,
                  per_call);
      report["rows"].push_back({{"tp", tp},
                                {"rows", rows},
                                {"cols", cols},
                                {"empty_us", empty},
                                {"cold_us", cold},
                                {"warm_us", warm},
                                {"chain_per_call_us", per_call},
                                {"chain", chain}});
    }
    for (int r = 0; r < tp; ++r) {
      LATENTMOE_CUDA_CHECK(cudaStreamDestroy(streams[r]));
    }
  }
  latentmoe::bench::Repro repro("lamport_bench");
  repro.flag("--tp", tps).flag("--rows", row_counts).flag("--cols", cols).flag("--chain", chain);
  repro.print();
  report["repro"] = repro.line();
  if (!json_path.empty()) latentmoe::bench::write_json(json_path, report);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return latentmoe::bench::run_main("lamport_bench", [&] { return run(argc, argv); });
}

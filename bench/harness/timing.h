// The benchmark harness: every benchmark of latentmoe times its work with it (`latentmoe bench layer`
// in tools/bench_layer.cpp, bench/grouped_gemm_bench.cu, bench/micro/gemv_bench.cu), so that they share
// one method (docs/PERFORMANCE.md):
//   - the work is enqueued on one stream, between two CUDA events;
//   - before each run, outside the timed region, the L2 is flushed by reading a buffer (read_through:
//     a memset would leave dirty lines whose write-back to DRAM the timed kernels would pay for);
//   - warm-up runs come first, untimed; the median of the timed runs is reported;
//   - each benchmark prints a "# repro: ..." line and writes it, with its results, to its JSON file.
// Every CUDA call is checked with LATENTMOE_CUDA_CHECK (cuda/common/cuda_check.h, re-exported here:
// the one checked-call macro), which throws latentmoe::Error; run_main prints that as one line.
// Built as the static library latentmoe_bench_harness (bench/CMakeLists.txt).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "bench_access.h"  // internal: LATENTMOE_CUDA_CHECK, LATENTMOE_CUBLAS_CHECK, the L2 flush
#include "harness/group_timing.h"
#include "harness/runs.h"
#include "harness/start_gate.h"

namespace latentmoe::bench {

// Runs and median (runs.h); RunClock and the group timing loop (group_timing.h).

// Device memory of the current device (cudaMalloc, at least 256 bytes), freed on destruction.
class DeviceMemory {
 public:
  DeviceMemory() = default;
  explicit DeviceMemory(size_t bytes);
  DeviceMemory(DeviceMemory&& other) noexcept;
  DeviceMemory& operator=(DeviceMemory&& other) noexcept;
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  ~DeviceMemory();
  void* get() const { return pointer_; }
  template <class T>
  T* as() const {
    return static_cast<T*>(pointer_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* pointer_ = nullptr;
  size_t bytes_ = 0;
};

// The bytes read to flush the L2 of the current device: max(2 x its L2, 64 MiB), a multiple of 16.
size_t default_flush_bytes();

// Times work enqueued on a stream with CUDA events, on the current device at construction.
class Timer {
 public:
  // flush_bytes 0: default_flush_bytes().
  explicit Timer(Runs runs = {}, size_t flush_bytes = 0);
  ~Timer();
  Timer(const Timer&) = delete;
  Timer& operator=(const Timer&) = delete;

  const Runs& runs() const { return runs_; }
  // runs.warmup + runs.iterations times: the L2 flush (if runs.flush_l2), an event, body() (which
  // enqueues its work on `stream`), an event, a wait for it. Returns the timed runs' times in µs.
  std::vector<double> times_us(cudaStream_t stream, const std::function<void()>& body, const Runs& runs);
  // The median of times_us, with the timer's runs or the given ones.
  double median_us(cudaStream_t stream, const std::function<void()>& body) { return median_us(stream, body, runs_); }
  double median_us(cudaStream_t stream, const std::function<void()>& body, const Runs& runs) {
    return median(times_us(stream, body, runs));
  }
  // Enqueues one L2 flush on `stream`.
  void flush_l2(cudaStream_t stream);

 private:
  Runs runs_;
  DeviceMemory flush_;
  DeviceMemory sink_;
  cudaEvent_t start_ = nullptr;
  cudaEvent_t stop_ = nullptr;
};

// A RunClock on one CUDA stream (group_timing.h): CUDA events around the work, and the L2 flush by
// reading (as Timer) when `flush_l2`; a group of ranks sharing one GPU flushes on one rank only.
// `gate`: the group's start gate, shared by every rank's clock (null: hold and open do nothing).
// Allocates at construction (before any rank of a group runs), never afterwards.
class EventClock final : public RunClock {
 public:
  // flush_bytes 0: default_flush_bytes().
  EventClock(cudaStream_t stream, bool flush_l2, StartGate* gate = nullptr, size_t flush_bytes = 0);
  ~EventClock() override;
  EventClock(const EventClock&) = delete;
  EventClock& operator=(const EventClock&) = delete;

  void flush() override;
  void wait() override;
  void start() override;
  void stop() override;
  double elapsed_us() override;
  void hold() override;
  void open() override;

 private:
  cudaStream_t stream_;
  StartGate* gate_;
  uint32_t ticket_ = 0;
  DeviceMemory flush_;
  DeviceMemory sink_;
  cudaEvent_t start_ = nullptr;
  cudaEvent_t stop_ = nullptr;
};

// A CUDA graph of the work body() enqueues on `stream` (captured once, thread-local capture mode, and
// instantiated), replayed by launch(): how an engine runs decode, with no host launch gaps.
class Graph {
 public:
  Graph(cudaStream_t stream, const std::function<void()>& body);
  ~Graph();
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  void launch(cudaStream_t stream) const;

 private:
  cudaGraphExec_t exec_ = nullptr;
};

// The device-to-device copy bandwidth of the current device, bytes read plus bytes written per
// second: a 2 GiB cudaMemcpyAsync on `stream`, the median of `runs`.
double copy_bandwidth(Timer& timer, cudaStream_t stream, const Runs& runs);

// "a,b,c"
template <class T>
std::string join(const std::vector<T>& values, std::string_view separator = ",") {
  std::ostringstream text;
  for (size_t i = 0; i < values.size(); ++i) text << (i ? separator : "") << values[i];
  return text.str();
}

// The command line that reproduces a run: Repro("latentmoe bench layer").flag("--tokens", tokens).line().
class Repro {
 public:
  explicit Repro(std::string command) : line_(std::move(command)) {}
  Repro& flag(std::string_view name, std::string_view value);
  template <class T>
  Repro& flag(std::string_view name, const std::vector<T>& values) {
    return flag(name, join(values));
  }
  template <class T>
  requires std::is_arithmetic_v<T> Repro& flag(std::string_view name, T value) {
    std::ostringstream text;
    text << value;
    return flag(name, text.str());
  }
  const std::string& line() const { return line_; }
  // "# repro: LINE" on stdout.
  void print() const;

 private:
  std::string line_;
};

// Writes `document` (indented, a final newline) to `path`; NaN and infinities are written as null.
// Throws Error when the file cannot be written.
void write_json(const std::string& path, const nlohmann::json& document);

// A benchmark's main: runs body() and returns its exit code; an exception becomes one line
// "NAME: error: MESSAGE" on stderr and exit code 1.
int run_main(const char* name, const std::function<int()>& body);

}  // namespace latentmoe::bench

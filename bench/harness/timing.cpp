// The benchmark harness (timing.h).
#include "harness/timing.h"

#include <algorithm>
#include <cstdio>
#include <exception>
#include <fstream>
#include <utility>

#include "latentmoe/error.h"

namespace latentmoe::bench {

DeviceMemory::DeviceMemory(size_t bytes) : bytes_(bytes) {
  LATENTMOE_CUDA_CHECK(cudaMalloc(&pointer_, std::max<size_t>(bytes, 256)));
}

DeviceMemory::DeviceMemory(DeviceMemory&& other) noexcept
    : pointer_(std::exchange(other.pointer_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

DeviceMemory& DeviceMemory::operator=(DeviceMemory&& other) noexcept {
  if (this != &other) {
    if (pointer_ != nullptr) cudaFree(pointer_);
    pointer_ = std::exchange(other.pointer_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

DeviceMemory::~DeviceMemory() {
  if (pointer_ != nullptr) cudaFree(pointer_);
}

size_t default_flush_bytes() {
  int device = 0, l2_bytes = 0;
  LATENTMOE_CUDA_CHECK(cudaGetDevice(&device));
  LATENTMOE_CUDA_CHECK(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device));
  return std::max<size_t>(2 * static_cast<size_t>(l2_bytes), size_t{64} << 20) / 16 * 16;
}

Timer::Timer(Runs runs, size_t flush_bytes) : runs_(runs) {
  LATENTMOE_CHECK(runs.warmup >= 0 && runs.iterations >= 1, "bench: ", runs.warmup, " warm-up and ", runs.iterations,
                  " timed runs (need at least one timed run)");
  flush_ = DeviceMemory((flush_bytes == 0 ? default_flush_bytes() : flush_bytes) / 16 * 16);
  sink_ = DeviceMemory(16);
  LATENTMOE_CUDA_CHECK(cudaMemset(flush_.get(), 0, flush_.bytes()));
  LATENTMOE_CUDA_CHECK(cudaEventCreate(&start_));
  LATENTMOE_CUDA_CHECK(cudaEventCreate(&stop_));
}

Timer::~Timer() {
  if (start_ != nullptr) cudaEventDestroy(start_);
  if (stop_ != nullptr) cudaEventDestroy(stop_);
}

void Timer::flush_l2(cudaStream_t stream) {
  bench_access::read_through(flush_.get(), flush_.bytes(), sink_.as<uint32_t>(), stream);
}

std::vector<double> Timer::times_us(cudaStream_t stream, const std::function<void()>& body, const Runs& runs) {
  LATENTMOE_CHECK(runs.warmup >= 0 && runs.iterations >= 1, "bench: ", runs.warmup, " warm-up and ", runs.iterations,
                  " timed runs (need at least one timed run)");
  std::vector<double> times;
  times.reserve(static_cast<size_t>(runs.iterations));
  for (int run = 0; run < runs.warmup + runs.iterations; ++run) {
    if (runs.flush_l2) flush_l2(stream);
    LATENTMOE_CUDA_CHECK(cudaEventRecord(start_, stream));
    body();
    LATENTMOE_CUDA_CHECK(cudaEventRecord(stop_, stream));
    LATENTMOE_CUDA_CHECK(cudaEventSynchronize(stop_));
    float ms = 0;
    LATENTMOE_CUDA_CHECK(cudaEventElapsedTime(&ms, start_, stop_));
    if (run >= runs.warmup) times.push_back(1000.0 * ms);
  }
  // A failed launch inside body() that nothing checked surfaces here, not in the next measurement.
  LATENTMOE_CUDA_CHECK(cudaGetLastError());
  return times;
}

EventClock::EventClock(cudaStream_t stream, bool flush_l2, StartGate* gate, size_t flush_bytes)
    : stream_(stream), gate_(gate) {
  if (flush_l2) {
    flush_ = DeviceMemory((flush_bytes == 0 ? default_flush_bytes() : flush_bytes) / 16 * 16);
    sink_ = DeviceMemory(16);
    LATENTMOE_CUDA_CHECK(cudaMemset(flush_.get(), 0, flush_.bytes()));
  }
  LATENTMOE_CUDA_CHECK(cudaEventCreate(&start_));
  LATENTMOE_CUDA_CHECK(cudaEventCreate(&stop_));
}

EventClock::~EventClock() {
  if (start_ != nullptr) cudaEventDestroy(start_);
  if (stop_ != nullptr) cudaEventDestroy(stop_);
}

void EventClock::flush() {
  if (flush_.get() != nullptr) bench_access::read_through(flush_.get(), flush_.bytes(), sink_.as<uint32_t>(), stream_);
}

void EventClock::wait() { LATENTMOE_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

void EventClock::start() { LATENTMOE_CUDA_CHECK(cudaEventRecord(start_, stream_)); }

void EventClock::stop() { LATENTMOE_CUDA_CHECK(cudaEventRecord(stop_, stream_)); }

double EventClock::elapsed_us() {
  LATENTMOE_CUDA_CHECK(cudaEventSynchronize(stop_));
  float ms = 0;
  LATENTMOE_CUDA_CHECK(cudaEventElapsedTime(&ms, start_, stop_));
  // A failed launch of the timed work that nothing checked surfaces here.
  LATENTMOE_CUDA_CHECK(cudaGetLastError());
  LATENTMOE_CHECK(gate_ == nullptr || !gate_->timed_out(),
                  "bench: a GPU waited at the group's start gate past its timeout (a rank never released it)");
  return 1000.0 * ms;
}

void EventClock::hold() {
  if (gate_ != nullptr) gate_->hold(stream_, ++ticket_);
}

void EventClock::open() {
  if (gate_ != nullptr) gate_->open(ticket_);
}

Graph::Graph(cudaStream_t stream, const std::function<void()>& body) {
  LATENTMOE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  try {
    body();
  } catch (...) {
    // End the capture so that the stream is usable again, then report the body's error.
    cudaGraph_t broken = nullptr;
    (void)cudaStreamEndCapture(stream, &broken);
    if (broken != nullptr) cudaGraphDestroy(broken);
    (void)cudaGetLastError();
    throw;
  }
  cudaGraph_t graph = nullptr;
  LATENTMOE_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  const cudaError_t status = cudaGraphInstantiate(&exec_, graph, 0);
  cudaGraphDestroy(graph);
  LATENTMOE_CUDA_CHECK(status);
}

Graph::~Graph() {
  if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
}

void Graph::launch(cudaStream_t stream) const { LATENTMOE_CUDA_CHECK(cudaGraphLaunch(exec_, stream)); }

double copy_bandwidth(Timer& timer, cudaStream_t stream, const Runs& runs) {
  const size_t bytes = size_t{2} << 30;
  DeviceMemory a(bytes), b(bytes);
  LATENTMOE_CUDA_CHECK(cudaMemsetAsync(a.get(), 1, bytes, stream));
  const double us = timer.median_us(
      stream, [&] { LATENTMOE_CUDA_CHECK(cudaMemcpyAsync(b.get(), a.get(), bytes, cudaMemcpyDeviceToDevice, stream)); },
      runs);
  return 2.0 * static_cast<double>(bytes) / (us * 1e-6);
}

Repro& Repro::flag(std::string_view name, std::string_view value) {
  line_.append(" ").append(name).append(" ").append(value);
  return *this;
}

void Repro::print() const { std::printf("# repro: %s\n", line_.c_str()); }

void write_json(const std::string& path, const nlohmann::json& document) {
  std::ofstream file(path);
  LATENTMOE_CHECK(file.good(), "cannot write ", path);
  file << document.dump(2) << "\n";
  file.close();
  LATENTMOE_CHECK(!file.fail(), "cannot write ", path);
}

int run_main(const char* name, const std::function<int()>& body) {
  try {
    return body();
  } catch (const std::exception& error) {
    std::fflush(stdout);
    std::fprintf(stderr, "%s: error: %s\n", name, error.what());
    return 1;
  }
}

}  // namespace latentmoe::bench

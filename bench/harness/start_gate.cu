// The start gate (start_gate.h): the hold kernel and the pinned words it polls.
#include <atomic>

#include "bench_access.h"  // internal: LATENTMOE_CUDA_CHECK
#include "harness/start_gate.h"

namespace latentmoe::bench {
namespace {

// One thread polls the gate word in host memory (a volatile load crosses PCIe each time) until it
// reaches `ticket`; past the deadline on the global timer it records the timeout and returns.
__global__ void hold_kernel(const volatile uint32_t* gate, volatile uint32_t* timed_out, uint32_t ticket,
                            uint64_t timeout_ns) {
  uint64_t start, now;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(start));
  while (static_cast<int32_t>(*gate - ticket) < 0) {
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(now));
    if (now - start > timeout_ns) {
      *timed_out = 1;
      return;
    }
  }
}

}  // namespace

StartGate::StartGate(std::chrono::milliseconds timeout)
    : timeout_ns_(static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(timeout).count())) {
  LATENTMOE_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&words_), 2 * sizeof(uint32_t),
                                     cudaHostAllocMapped | cudaHostAllocPortable));
  words_[0] = 0;
  words_[1] = 0;
}

StartGate::~StartGate() {
  if (words_ != nullptr) cudaFreeHost(words_);
}

void StartGate::hold(cudaStream_t stream, uint32_t ticket) const {
  // With unified addressing the host pointer of mapped memory is its device pointer on every GPU.
  hold_kernel<<<1, 1, 0, stream>>>(words_, words_ + 1, ticket, timeout_ns_);
  LATENTMOE_CUDA_CHECK(cudaGetLastError());
}

void StartGate::open(uint32_t ticket) {
  std::atomic_ref<uint32_t> gate(words_[0]);
  uint32_t current = gate.load();
  while (static_cast<int32_t>(current - ticket) < 0 && !gate.compare_exchange_weak(current, ticket)) {
  }
}

bool StartGate::timed_out() const { return std::atomic_ref<uint32_t>(words_[1]).load() != 0; }

}  // namespace latentmoe::bench

// The start gate of a group's timed runs: a word in pinned, mapped host memory that every GPU of the
// process reads. Each rank enqueues hold(ticket) on its stream before its timed run, then the run;
// once every rank has enqueued its run (a host rendezvous), open(ticket) releases all GPUs together.
//
// Why: without it each rank's run starts when its host thread leaves the rendezvous, and the threads
// wake up microseconds apart (seen on two H200s: ~15 µs), so a collective's time included its wait for
// a peer that had not started. Behind the gate every run is already enqueued, and the GPUs leave the
// gate within one poll of host memory of each other (about a microsecond over PCIe).
//
// Invariants: tickets only grow, and every rank holds and opens the same tickets in the same order
// (open is idempotent: every rank may open). The hold is bounded: past `timeout` it gives up, records
// that in a mapped word, and its stream goes on; timed_out() reports it, and the caller fails the
// measurement.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>

namespace latentmoe::bench {

class StartGate {
 public:
  explicit StartGate(std::chrono::milliseconds timeout = std::chrono::milliseconds(10000));
  ~StartGate();
  StartGate(const StartGate&) = delete;
  StartGate& operator=(const StartGate&) = delete;

  // Enqueues on `stream` (any device of the process) a one-thread kernel that returns once the gate
  // has reached `ticket`, or after the timeout.
  void hold(cudaStream_t stream, uint32_t ticket) const;
  // Releases every hold of tickets up to `ticket` (a host store; never lowers the gate).
  void open(uint32_t ticket);
  // Whether a hold gave up waiting.
  bool timed_out() const;

 private:
  uint32_t* words_ = nullptr;  // [0] the gate, [1] non-zero once a hold timed out (host-mapped)
  uint64_t timeout_ns_ = 0;
};

}  // namespace latentmoe::bench

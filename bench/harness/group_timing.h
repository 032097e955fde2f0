// Timing the ranks of a group together: one thread per rank, every timed run starting on all ranks
// at once, so that a collective's time is not its wait for a peer that has not started: a host
// rendezvous after each rank has flushed its cache and prepared its inputs (outside the timed region),
// then, on CUDA, a start gate (start_gate.h) that holds every GPU until every rank has enqueued its
// run (host threads leave a rendezvous microseconds apart; the GPUs leave the gate together).
// No CUDA here: the clock is an interface (HostClock below for the CPU backend, EventClock in
// timing.h for a CUDA stream), so one loop serves both backends.
#pragma once

#include <barrier>
#include <chrono>
#include <functional>
#include <vector>

#include "harness/runs.h"

namespace latentmoe::bench {

// Times work issued on one rank's stream (CUDA: enqueued; CPU: done when the call returns).
class RunClock {
 public:
  virtual ~RunClock() = default;
  // Flushes the cache that the timed work should not find warm (enqueued; may do nothing).
  virtual void flush() = 0;
  // Returns once everything issued so far has completed.
  virtual void wait() = 0;
  virtual void start() = 0;
  virtual void stop() = 0;
  // Microseconds from start() to stop(); waits for stop() to complete.
  virtual double elapsed_us() = 0;
  // The group's start gate: hold() enqueues a wait at the gate for this clock's next ticket, open()
  // opens the gate to it (every rank's clock counts the same tickets). Nothing on the host clock.
  virtual void hold() {}
  virtual void open() {}
};

// The CPU backend's clock: the host's steady clock around work that is done when its call returns.
// It flushes nothing: the CPU mode exercises the benchmark's logic, its times are not a result.
class HostClock final : public RunClock {
 public:
  void flush() override {}
  void wait() override {}
  void start() override { start_ = std::chrono::steady_clock::now(); }
  void stop() override { stop_ = std::chrono::steady_clock::now(); }
  double elapsed_us() override { return std::chrono::duration<double, std::micro>(stop_ - start_).count(); }

 private:
  std::chrono::steady_clock::time_point start_, stop_;
};

// The group's rendezvous: every rank's thread holds one Seat at it.
class Rendezvous {
 public:
  explicit Rendezvous(int ranks) : barrier_(ranks) {}

  // One rank's place at the rendezvous. wait() arrives and waits for every rank still seated; a
  // seat destroyed before finish() (its rank failed) leaves the rendezvous, so its peers are not held
  // (they then fail in their next collective, which the failing rank's group abort releases).
  class Seat {
   public:
    explicit Seat(Rendezvous& rendezvous) : barrier_(rendezvous.barrier_) {}
    ~Seat() {
      if (!finished_) barrier_.arrive_and_drop();
    }
    Seat(const Seat&) = delete;
    Seat& operator=(const Seat&) = delete;
    void wait() { barrier_.arrive_and_wait(); }
    // The last wait of a rank that succeeded: it stays counted until then.
    void finish() {
      finished_ = true;
      barrier_.arrive_and_wait();
    }

   private:
    std::barrier<>& barrier_;
    bool finished_ = false;
  };

 private:
  std::barrier<> barrier_;
};

// One rank's share of a group measurement: runs.warmup + runs.iterations times
//   clock.flush() (if runs.flush_l2), prepare(), clock.wait(), seat.wait(),
//   [clock.hold()], clock.start(), body(), clock.stop(), [seat.wait(), clock.open()], clock.elapsed_us();
// the bracketed steps in every run but the first: the first run of a measurement is not held, so that
// a library's first use of a kernel (a driver call that may wait for the GPU to idle) never waits
// behind a held GPU;
// every rank of the group calls it with the same runs. Returns this rank's timed runs in µs (the
// warm-ups dropped); median_of_slowest over the ranks' vectors is the group's time.
std::vector<double> time_group_runs(RunClock& clock, Rendezvous::Seat& seat, const Runs& runs,
                                    const std::function<void()>& prepare, const std::function<void()>& body);

}  // namespace latentmoe::bench

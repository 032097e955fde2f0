// The group timing loop (group_timing.h).
#include "harness/group_timing.h"

#include "latentmoe/error.h"

namespace latentmoe::bench {

std::vector<double> time_group_runs(RunClock& clock, Rendezvous::Seat& seat, const Runs& runs,
                                    const std::function<void()>& prepare, const std::function<void()>& body) {
  LATENTMOE_CHECK(runs.warmup >= 0 && runs.iterations >= 1, "bench: ", runs.warmup, " warm-up and ", runs.iterations,
                  " timed runs (need at least one timed run)");
  std::vector<double> times;
  times.reserve(static_cast<size_t>(runs.iterations));
  for (int run = 0; run < runs.warmup + runs.iterations; ++run) {
    if (runs.flush_l2) clock.flush();
    if (prepare) prepare();
    clock.wait();
    seat.wait();  // every rank has prepared
    const bool held = run > 0;
    if (held) clock.hold();
    clock.start();
    body();
    clock.stop();
    if (held) {
      seat.wait();  // every rank has enqueued its run: release the GPUs together
      clock.open();
    }
    const double us = clock.elapsed_us();
    if (run >= runs.warmup) times.push_back(us);
  }
  return times;
}

}  // namespace latentmoe::bench

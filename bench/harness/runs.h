// How a benchmark repeats its work and the statistics it reports. No CUDA here: the CPU mode of
// `latentmoe bench tail` and the tests build it too (timing.h re-exports it for the CUDA benchmarks).
#pragma once

#include <vector>

namespace latentmoe::bench {

struct Runs {
  int warmup = 3;        // untimed runs first
  int iterations = 20;   // timed runs (the median is reported)
  bool flush_l2 = true;  // flush the cache before each run, outside the timed region
};

// The median (upper median for an even count) of `values`; throws Error when empty.
double median(std::vector<double> values);

// A group's time for a run is its slowest rank's: per_rank[r][i] is rank r's time of run i. Returns
// the median over the runs of the slowest rank's time; throws Error when there is no rank, no run,
// or the ranks have different numbers of runs.
double median_of_slowest(const std::vector<std::vector<double>>& per_rank);

}  // namespace latentmoe::bench

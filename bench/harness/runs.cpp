// The benchmark statistics (runs.h).
#include "harness/runs.h"

#include <algorithm>

#include "latentmoe/error.h"

namespace latentmoe::bench {

double median(std::vector<double> values) {
  LATENTMOE_CHECK(!values.empty(), "bench: the median of no runs");
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

double median_of_slowest(const std::vector<std::vector<double>>& per_rank) {
  LATENTMOE_CHECK(!per_rank.empty(), "bench: the slowest rank of no ranks");
  const size_t runs = per_rank.front().size();
  std::vector<double> slowest(runs, 0.0);
  for (size_t rank = 0; rank < per_rank.size(); ++rank) {
    LATENTMOE_CHECK(per_rank[rank].size() == runs, "bench: rank ", rank, " has ", per_rank[rank].size(),
                    " timed runs, rank 0 has ", runs);
    for (size_t run = 0; run < runs; ++run) slowest[run] = std::max(slowest[run], per_rank[rank][run]);
  }
  return median(std::move(slowest));
}

}  // namespace latentmoe::bench

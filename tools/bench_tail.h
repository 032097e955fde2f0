// latentmoe bench tail: every tail tier forced, per tp and token count, timed on all ranks of a group
// at once: the tail alone and the whole layer with it, beside the unfused tail, the AR+RMSNorm step
// alone and the all-reduce ceiling (docs/PERFORMANCE.md, "Tail benchmark").
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bench_access.h"  // internal: tier 0's push bounds, for benchmarks only

namespace latentmoe::tools {

struct BenchTailOptions {
  std::vector<std::string> presets{"kimi-k3", "nemotron3-super"};
  std::vector<int> tp_sizes{2, 4, 8};
  std::vector<int64_t> tokens;  // empty: 1, 2, 4, ..., 1024, 4096 (the CPU: 1, 2, 4, ..., 64)
  std::string backend = "auto";
  int scale = 0;  // 0: 1 on CUDA, 32 on the CPU (d, l, E, I and Is divided by it)
  std::string dtype = "bf16";
  int warmup = -1;                 // -1: 3 on CUDA, 1 on the CPU
  int iterations = 0;              // 0: 20 on CUDA, 3 on the CPU
  double max_seconds = 0;          // > 0: no new point starts after this many seconds (the rest is listed as skipped)
  int device = 0;                  // CUDA: the GPU the simulated ranks share
  std::string placement = "auto";  // CUDA: auto|simulated|devices (latentmoe/gpu_group.h)
  std::string collectives = "one_shot";  // one_shot|nccl (devices only: every collective through NCCL)
  // CUDA: up to how many tokens tier 0's up-projection pushes into the peers from its GEMM's epilogue
  // (CudaBackend::set_fused_up_projection_max_tokens, 0..kDensePushMaxRows; 0: the composed GEMM +
  // all-gather).
  int fused_up_projection_max_tokens = bench_access::kDefaultFusedUpProjectionMaxTokens;
  // CUDA: the longest latent with which it pushes, in place of the decode dispatch's measured rule
  // (CudaBackend::set_fused_up_projection_max_latent); -1: the rule.
  int64_t fused_up_projection_max_latent = -1;
  // CUDA, ranks on GPUs of their own: up to how many tokens the group's collectives are one-shot, NCCL
  // above (latentmoe/gpu_group.h); 0: default_one_shot_tokens(tp). Simulated ranks: every message one-shot.
  int64_t one_shot_max_tokens = 0;
  uint64_t seed = 2026;
  std::string json_path;  // empty: no JSON
  std::string commit;     // recorded in every row
};

// Checks every option (and that the JSON file can be written) before anything is measured; throws
// Error naming the problem. The JSON file is written at the end, atomically: a failure leaves none.
void run_bench_tail(const BenchTailOptions& options);

}  // namespace latentmoe::tools

// latentmoe bench layer: one rank's share of the layer on the CUDA backend, per phase, against the
// byte and FLOP floors computed from ceilings measured in the same run.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace latentmoe::tools {

struct BenchLayerOptions {
  std::vector<std::string> presets{"kimi-k3", "nemotron3-super"};
  std::vector<int> tp_shards{8, 1};
  std::vector<int64_t> tokens{1, 8, 64, 256, 1024, 4096};
  std::string dtype = "bf16";
  int warmup = 3;
  int iterations = 20;
  int device = 0;
  uint64_t seed = 2026;
  int skinny_max_tokens = 8;        // CudaBackend::set_skinny_max_tokens; 0 turns the decode path off
  int shared_gemv_ctas_per_sm = 0;  // CudaBackend::set_shared_gemv_ctas_per_sm (its default, 0: the kernel's own)
  // CudaBackend::set_mxfp4_pairs_max_tokens; -1 (the default): the backend's own (its setting or kMxfp4PairsTokens)
  int mxfp4_pairs_max_tokens = -1;
  int gemv_max_tokens = 1;        // CudaBackend::set_gemv_max_tokens (its default, 1); 0 keeps every linear on cuBLASLt
  std::string experts = "dense";  // dense (the dtype) or mxfp4 (codes and scales, decoded in the kernels)
  std::string json_path;          // empty: no JSON
  std::string commit;             // recorded in the JSON (e.g. `git rev-parse HEAD`)
};

// Throws Error when built without CUDA, when no GPU is present, or on bad options.
void run_bench_layer(const BenchLayerOptions& options);

}  // namespace latentmoe::tools

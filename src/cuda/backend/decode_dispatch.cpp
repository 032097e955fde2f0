// The decode dispatch table (decode_dispatch.h). A new architecture gets a row of its own once
// `latentmoe bench layer` has been run there with the skinny kernels on and off (docs/PERFORMANCE.md,
// "Decode: the skinny kernels"); until then it takes the sm_90 row.
#include "cuda/backend/decode_dispatch.h"

#include <array>

namespace latentmoe::cuda {
namespace {

constexpr std::array<DecodeDispatch, 1> kTable = {{
    {
        .compute_capability = 90,
        .gpu = "H200",
        // Commit 96a190e, bench/results/layer_h200_96a190e_skinny_everywhere.{json,txt} against
        // bench/results/layer_h200_acb6466.json (docs/PERFORMANCE.md, "Decode: the skinny kernels"):
        // the routed experts win at one token only (Kimi-K3 tp 8, T = 1: 57.6 -> 46.6 µs; T = 8:
        // 269.3 -> 271.2, a loss) and only with a long latent: Kimi-K3, l = 3584, wins; Nemotron-3,
        // l = 1024, loses (tp 8: 31.3 -> 38.4 µs), so the threshold lies between: 2048.
        .routed_max_tokens = 1,
        .routed_min_latent = 2048,
        // Same measurement: the shared expert wins at one token with a tp-8 shard of its intermediate
        // (Kimi-K3, Is/8 = 768: 28.0 -> 22.3 µs; Nemotron-3 tp 8: 17.8 -> 14.3) and loses with the whole
        // Is = 6144 (Kimi-K3 tp 1: 87.2 -> 97.3); the threshold 1024 lies between.
        .dense_max_tokens = 1,
        .dense_max_intermediate = 1024,
        // Same measurement: a one-row dense linear (W_down, W_up, 51 MB) is slower on the skinny
        // kernels at every shape measured (W_down 18.8 -> 24.7 µs, W_up 19.1 -> 24.2): never.
        .linear_max_tokens = 0,
        // Commit 9268908, ranks simulated on one H200 (bench tail with --fused-up-projection-max-tokens 8
        // against 0 in one call, T 1-8; docs/PERFORMANCE.md, "Tier 0's fused up-projection"): the push
        // wins with Nemotron-3's latent of 1024 (tp 4: 83.7 -> 65.8 µs at T = 1; tp 8: 112.2 -> 102.6)
        // and loses with Kimi-K3's 3584 (tp 4: 112.2 -> 119.7; tp 8: 159.6 -> 185.6, T = 8: 165.1 ->
        // 222.1); the threshold lies between: 2048. Simulated ranks share the GPU's SMs; real GPUs
        // (issue 14) may move it.
        .tier0_push_max_latent = 2048,
        // Commits bb1f348 and 5424dd7, ranks simulated on one H200 (bench tail with
        // --fused-up-projection-max-tokens 64 against 0 in one call, T 1-64, both presets, tp 2/4/8;
        // docs/PERFORMANCE.md, "Tier 0's push from the tensor-core GEMM"): tier 0's tail with the push
        // from the tensor-core kernel was slower than cuBLASLt + the one-shot all-gather at every Kimi-K3
        // point (3-36%) and at Nemotron-3's tp 2 and 4 above 8 tokens (3-28%), even at its tp 8
        // (0.96-1.00x): never, until real GPUs (issue 14) measure the latency the push saves.
        .tier0_tensor_core_push_max_latent = 0,
    },
}};

}  // namespace

const DecodeDispatch& decode_dispatch(int compute_capability) {
  for (const DecodeDispatch& row : kTable) {
    if (row.compute_capability == compute_capability) return row;
  }
  return kTable[0];  // unmeasured architectures: the sm_90 row
}

bool skinny_pays(const DecodeDispatch& table, SkinnyOp op, int64_t rows, int64_t reduction, int64_t intermediate) {
  if (rows < 1) return false;
  switch (op) {
    case SkinnyOp::routed_experts:
      return rows <= table.routed_max_tokens && reduction >= table.routed_min_latent;
    case SkinnyOp::dense_mlp:
      return rows <= table.dense_max_tokens && intermediate <= table.dense_max_intermediate;
    case SkinnyOp::linear:
      return rows <= table.linear_max_tokens;
    case SkinnyOp::tier0_push:
      return reduction <= table.tier0_push_max_latent;
  }
  return false;
}

}  // namespace latentmoe::cuda

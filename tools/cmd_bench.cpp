// latentmoe bench layer and bench tail: options and registration; the work is in bench_layer.cpp and
// bench_tail.cpp.
#include <memory>
#include <string>

#include "bench_layer.h"
#include "bench_tail.h"
#include "commands.h"

namespace latentmoe::tools {

void register_bench_command(CLI::App& app) {
  CLI::App* bench = app.add_subcommand("bench", "Benchmarks");
  bench->require_subcommand(1);
  auto options = std::make_shared<BenchLayerOptions>();
  CLI::App* layer = bench->add_subcommand(
      "layer",
      "One rank's layer through Runner::forward (--tp-shard N: its share of a tp=N deployment, no "
      "collectives), whole and per phase, against byte and FLOP floors from ceilings measured in the same run");
  layer->add_option("--preset", options->presets, "kimi-k3, nemotron3-super")->delimiter(',');
  layer->add_option("--tp-shard", options->tp_shards, "tp sizes whose one-rank share to run")->delimiter(',');
  layer->add_option("--tokens", options->tokens, "token counts")->delimiter(',');
  layer->add_option("--dtype", options->dtype, "bf16 or f16");
  layer->add_option("--warmup", options->warmup, "untimed runs per measurement")->check(CLI::Range(0, 1000));
  layer->add_option("--iterations", options->iterations, "timed runs per measurement (median)")
      ->check(CLI::Range(1, 10000));
  layer->add_option("--device", options->device, "CUDA device ordinal");
  layer->add_option("--seed", options->seed, "seed of the random weights and inputs");
  layer
      ->add_option("--skinny-max-tokens", options->skinny_max_tokens,
                   "largest token count that takes the skinny decode GEMMs (0: never)")
      ->check(CLI::Range(0, 8));
  layer
      ->add_option("--gemv-max-tokens", options->gemv_max_tokens,
                   "largest token count whose dense linears take the decode GEMV (default 1; 0: never)")
      ->check(CLI::Range(0, 4));
  layer
      ->add_option("--shared-gemv-ctas-per-sm", options->shared_gemv_ctas_per_sm,
                   "CTAs per SM of the shared expert's decode GEMVs (default 0: the kernel's own, two)")
      ->check(CLI::Range(0, 2));
  layer
      ->add_option("--mxfp4-pairs-max-tokens", options->mxfp4_pairs_max_tokens,
                   "largest token count whose MXFP4 experts (bf16) take the pair decode kernels (0: never; default: "
                   "the backend's own)")
      ->check(CLI::Range(0, 8));
  layer->add_option("--experts", options->experts, "dense (default) or mxfp4: the routed experts' weights")
      ->check(CLI::IsMember({"dense", "mxfp4"}));
  layer->add_option("--json", options->json_path, "write the results as JSON to this file");
  layer->add_option("--commit", options->commit, "commit id recorded in the JSON");
  layer->callback([options] { run_bench_layer(*options); });

  auto tail_options = std::make_shared<BenchTailOptions>();
  CLI::App* tail = bench->add_subcommand(
      "tail",
      "Every tail tier forced, per tp and token count, all ranks timed together: the tail alone and the whole layer "
      "with it, beside the unfused tail, the AR+RMSNorm step alone and the all-reduce ceiling (CUDA: ranks simulated "
      "on one GPU or one GPU per rank; --backend cpu: ranks as threads)");
  tail->add_option("--preset", tail_options->presets, "kimi-k3, nemotron3-super (default both)")->delimiter(',');
  tail->add_option("--tp", tail_options->tp_sizes, "tp sizes, each >= 2 (default 2,4,8)")->delimiter(',');
  tail->add_option("--tokens", tail_options->tokens,
                   "token counts (default 1,2,4,...,1024,4096; on the CPU 1,2,4,...,64)")
      ->delimiter(',');
  tail->add_option("--backend", tail_options->backend, "auto|cpu|cuda");
  tail->add_option("--scale", tail_options->scale, "divide d, l, E, I and Is by this (default 1; on the CPU 32)")
      ->check(CLI::Range(1, 1 << 20));
  tail->add_option("--dtype", tail_options->dtype, "bf16 (default), f16 or f32");
  tail->add_option("--warmup", tail_options->warmup, "untimed runs per measurement (default 3; CPU 1)")
      ->check(CLI::Range(0, 1000));
  tail->add_option("--iterations", tail_options->iterations, "timed runs per measurement, median (default 20; CPU 3)")
      ->check(CLI::Range(1, 10000));
  tail->add_option("--max-seconds", tail_options->max_seconds,
                   "start no new point after this many seconds; what is left is listed as skipped (default: no limit)")
      ->check(CLI::Range(0.0, 1e6));
  tail->add_option("--device", tail_options->device, "CUDA device the simulated ranks share");
  tail->add_option("--placement", tail_options->placement,
                   "CUDA: auto (default: one GPU per rank when tp GPUs with peer access and NCCL are there), "
                   "simulated (every rank on --device) or devices");
  tail->add_option("--collectives", tail_options->collectives,
                   "one_shot (default) or nccl (devices only: every collective through NCCL, the fused tiers off)");
  tail->add_option("--one-shot-max-tokens", tail_options->one_shot_max_tokens,
                   "CUDA, one GPU per rank: up to this many tokens the collectives are one-shot, NCCL above "
                   "(default: LATENTMOE_ONE_SHOT_MAX_TOKENS, else 512 at tp 2 and 64 above); simulated ranks: every "
                   "message one-shot")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  tail->add_option("--fused-up-projection-max-tokens", tail_options->fused_up_projection_max_tokens,
                   "CUDA: up to this many tokens (0.." + std::to_string(bench_access::kDensePushMaxRows) +
                       ", default " + std::to_string(bench_access::kDefaultFusedUpProjectionMaxTokens) +
                       ") tier 0's up-projection pushes into the peers from its GEMM's epilogue (the skinny kernel "
                       "where it pays, else the tensor-core one); 0: the GEMM, then the all-gather");
  tail->add_option(
      "--fused-up-projection-max-latent", tail_options->fused_up_projection_max_latent,
      "CUDA: the longest latent with which tier 0 pushes, and with which the skinny kernel pushes in place "
      "of the decode dispatch's measured rule (on sm_90: 2048); -1 (default): no bound, the rule");
  tail->add_option("--seed", tail_options->seed, "seed of the random weights, inputs and partials");
  tail->add_option("--json", tail_options->json_path, "write the results as JSON to this file (atomically)");
  tail->add_option("--commit", tail_options->commit, "commit id recorded in every row");
  tail->callback([tail_options] { run_bench_tail(*tail_options); });
}

}  // namespace latentmoe::tools

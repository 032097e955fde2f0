// latentmoe bench layer: options and registration; the work is in bench_layer.cpp.
#include <memory>

#include "bench_layer.h"
#include "commands.h"

namespace latentmoe::tools {

void register_bench_command(CLI::App& app) {
  CLI::App* bench = app.add_subcommand("bench", "Benchmarks (CUDA backend)");
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
                   "largest token count whose dense linears take the decode GEMV (0: never)")
      ->check(CLI::Range(0, 4));
  layer->add_option("--json", options->json_path, "write the results as JSON to this file");
  layer->add_option("--commit", options->commit, "commit id recorded in the JSON");
  layer->callback([options] { run_bench_layer(*options); });
}

}  // namespace latentmoe::tools

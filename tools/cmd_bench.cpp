// latentmoe bench: registered here; the layer benchmark needs the CUDA backend.
#include "commands.h"
#include "latentmoe/error.h"

namespace latentmoe::tools {

void register_bench_command(CLI::App& app) {
  CLI::App* bench = app.add_subcommand("bench", "Benchmarks (CUDA backend)");
  bench->require_subcommand(1);
  CLI::App* layer = bench->add_subcommand("layer", "One rank's layer, per phase, against its byte and FLOP floors");
  layer->allow_extras();
  layer->callback([] {
    detail::throw_error("bench layer is not implemented yet: it needs the CUDA backend (issue 3)");
  });
}

}  // namespace latentmoe::tools

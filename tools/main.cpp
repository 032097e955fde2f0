// latentmoe: the command-line tool. Every failure ends with one line on stderr and exit code 1
// (2 for a malformed command line).
#include <cstdlib>
#include <iostream>
#include <new>

#include "commands.h"
#include "latentmoe/error.h"
#include "latentmoe/runner.h"
#include "version.h"

int main(int argc, char** argv) {
  // Ranks simulated on one GPU spin in their collectives while a peer's kernels start; with CUDA's
  // lazy module loading, loading a kernel can wait for the spinning one (a deadlock until the
  // timeout). Load every kernel at start-up unless the user chose otherwise.
  setenv("CUDA_MODULE_LOADING", "EAGER", /*overwrite=*/0);
  // And each simulated rank's streams need hardware queues of their own (latentmoe/gpu_group.h).
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", /*overwrite=*/0);
  // The library keeps NVLink multicast off in its NCCL groups but sets no NCCL variable: it refuses to
  // build one unless NCCL_NVLS_ENABLE=0. The tool is a process of its own and may set it, before NCCL
  // starts; a value the user set (another one is then refused) is kept.
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
  CLI::App app{"latentmoe: the Mixture-of-Experts block of latent-MoE models under tensor parallelism"};
  app.set_version_flag("--version", latentmoe::tools::version_string());
  app.require_subcommand(1);
  app.fallthrough(false);
  latentmoe::tools::register_run_command(app);
  latentmoe::tools::register_demo_command(app);
  latentmoe::tools::register_inspect_command(app);
  latentmoe::tools::register_bench_command(app);
  latentmoe::tools::register_tune_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    // --help and --version are "errors" with exit code 0; real parse errors get one line.
    if (error.get_exit_code() == 0) return app.exit(error);
    // CLI11's message may echo an argument of any length: one echoed part, capped as such.
    std::cerr << "latentmoe: error: " << latentmoe::sanitize_error_text(error.what(), latentmoe::kMaxPartBytes)
              << " (see --help)\n";
    return 2;
  } catch (const latentmoe::Error& error) {
    std::cerr << "latentmoe: error: " << error.what() << "\n";
    return 1;
  } catch (const std::bad_alloc&) {
    std::cerr << "latentmoe: error: out of memory\n";
    return 1;
  } catch (const std::exception& error) {  // from the standard library: may echo a path, so one capped part
    std::cerr << "latentmoe: error: " << latentmoe::sanitize_error_text(error.what(), latentmoe::kMaxPartBytes) << "\n";
    return 1;
  }
  return 0;
}

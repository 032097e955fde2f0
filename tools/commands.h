// Each subcommand of the latentmoe tool lives in its own file and registers itself on the app.
// A subcommand's callback throws latentmoe::Error on failure; main() prints one line and exits 1.
#pragma once

#include <CLI/CLI.hpp>

namespace latentmoe::tools {

void register_run_command(CLI::App& app);      // cmd_run.cpp
void register_demo_command(CLI::App& app);     // cmd_demo.cpp
void register_inspect_command(CLI::App& app);  // cmd_inspect.cpp
void register_bench_command(CLI::App& app);    // cmd_bench.cpp
void register_tune_command(CLI::App& app);     // cmd_tune.cpp

}  // namespace latentmoe::tools

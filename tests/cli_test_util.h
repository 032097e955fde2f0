// Runs the latentmoe command-line tool for tests: the build tree's (LATENTMOE_CLI_PATH, set by
// tests/CMakeLists.txt) unless the caller names another.
#pragma once

#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace latentmoe::testing {

struct CommandResult {
  int exit_code = -1;  // -1 when the tool did not exit normally (a signal)
  std::string out, err;
};

inline std::string read_text_file(const std::filesystem::path& path) {
  std::ifstream stream(path, std::ios::binary);
  std::stringstream buffer;
  buffer << stream.rdbuf();
  return buffer.str();
}

// `latentmoe <arguments>` through the shell, its stdout and stderr captured in files in `scratch`.
inline CommandResult run_cli(const std::string& arguments, const std::filesystem::path& scratch,
                             const std::string& tool = LATENTMOE_CLI_PATH) {
  const std::filesystem::path out_path = scratch / "stdout.txt", err_path = scratch / "stderr.txt";
  const std::string command = tool + " " + arguments + " >" + out_path.string() + " 2>" + err_path.string();
  const int status = std::system(command.c_str());
  CommandResult result;
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  result.out = read_text_file(out_path);
  result.err = read_text_file(err_path);
  return result;
}

}  // namespace latentmoe::testing

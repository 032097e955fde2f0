// The seams docs/ARCHITECTURE.md draws, checked on the tree itself: the tools (tools/) and the
// benchmark harness (bench/harness/) include only the public API, their own headers and the one internal
// door src/bench_access.h; public headers (include/latentmoe/) include only public headers; kernels and
// GEMMs (src/cuda/gemm, kernels, comm, common) never include the backend that orchestrates them.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;
const fs::path kSourceDir = LATENTMOE_SOURCE_DIR;

// Every `#include "..."` of a file (angle-bracket includes are outside the project).
std::vector<std::string> quoted_includes(const fs::path& file) {
  std::ifstream in(file);
  std::stringstream text;
  text << in.rdbuf();
  static const std::regex include(R"re(^\s*#\s*include\s*"([^"]+)")re", std::regex::multiline);
  std::vector<std::string> found;
  const std::string content = text.str();
  for (std::sregex_iterator it(content.begin(), content.end(), include), end; it != end; ++it) {
    found.push_back((*it)[1].str());
  }
  return found;
}

bool is_source(const fs::path& path) {
  const std::string ext = path.extension().string();
  return ext == ".h" || ext == ".cpp" || ext == ".cu" || ext == ".cuh";
}

// The includes under `folder` that `allowed` refuses, as "file: include".
template <class Allowed>
std::vector<std::string> offending_includes(const fs::path& folder, Allowed allowed, int& scanned) {
  std::vector<std::string> offenders;
  for (const auto& entry : fs::recursive_directory_iterator(kSourceDir / folder)) {
    if (!entry.is_regular_file() || !is_source(entry.path())) continue;
    ++scanned;
    for (const std::string& include : quoted_includes(entry.path())) {
      if (!allowed(include))
        offenders.push_back(fs::relative(entry.path(), kSourceDir).generic_string() + ": " + include);
    }
  }
  return offenders;
}

bool starts_with(const std::string& text, const char* prefix) { return text.rfind(prefix, 0) == 0; }

TEST(Boundaries, the_include_scanner_sees_quoted_includes_only) {
  const fs::path file = fs::temp_directory_path() / "latentmoe_boundaries_probe.h";
  std::ofstream(file) << "#include <vector>\n  #  include \"core/backend.h\"\n// #include \"x.h\" (a comment line "
                         "starting with //)\n#include \"latentmoe/tensor.h\"\n";
  EXPECT_EQ(quoted_includes(file), (std::vector<std::string>{"core/backend.h", "latentmoe/tensor.h"}));
  fs::remove(file);
}

TEST(Boundaries, tools_and_the_harness_use_the_public_api_and_the_one_door) {
  int scanned = 0;
  auto allowed = [](const std::string& include) {
    return starts_with(include, "latentmoe/") || starts_with(include, "harness/") || include == "bench_access.h" ||
           include.find('/') == std::string::npos;  // the tool's own headers (commands.h, bench_layer.h, ...)
  };
  std::vector<std::string> offenders = offending_includes("tools", allowed, scanned);
  const std::vector<std::string> harness = offending_includes("bench/harness", allowed, scanned);
  offenders.insert(offenders.end(), harness.begin(), harness.end());
  EXPECT_GT(scanned, 15);
  EXPECT_TRUE(offenders.empty()) << "includes below the public API outside src/bench_access.h: "
                                 << ::testing::PrintToString(offenders);
}

TEST(Boundaries, public_headers_include_only_public_headers) {
  int scanned = 0;
  const std::vector<std::string> offenders = offending_includes(
      "include/latentmoe", [](const std::string& include) { return starts_with(include, "latentmoe/"); }, scanned);
  EXPECT_GT(scanned, 15);
  EXPECT_TRUE(offenders.empty()) << ::testing::PrintToString(offenders);
}

TEST(Boundaries, kernels_never_reach_up_into_the_backend) {
  int scanned = 0;
  std::vector<std::string> offenders;
  for (const char* folder : {"src/cuda/gemm", "src/cuda/kernels", "src/cuda/comm", "src/cuda/common"}) {
    const std::vector<std::string> found = offending_includes(
        folder, [](const std::string& include) { return !starts_with(include, "cuda/backend/"); }, scanned);
    offenders.insert(offenders.end(), found.begin(), found.end());
  }
  EXPECT_GT(scanned, 30);
  EXPECT_TRUE(offenders.empty()) << ::testing::PrintToString(offenders);
}

}  // namespace

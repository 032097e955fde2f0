// A fresh directory for one test, under LATENTMOE_TEST_TMPDIR (the build tree) or the system temp
// directory, named after the running test and the process (so parallel ctest runs never share one),
// removed when the object goes away.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>

namespace latentmoe::testing {

class ScratchDir {
 public:
  explicit ScratchDir(const std::string& prefix) {
#ifdef LATENTMOE_TEST_TMPDIR
    const std::filesystem::path root(LATENTMOE_TEST_TMPDIR);
#else
    const std::filesystem::path root = std::filesystem::temp_directory_path();
#endif
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string name = prefix + "_" + std::to_string(::getpid());
    if (info != nullptr) name += std::string("_") + info->test_suite_name() + "." + info->name();
    for (char& c : name) {
      if (c == '/') c = '_';  // parameterised test names contain slashes
    }
    path_ = root / name;
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ignored;  // a test may have left a read-only subdirectory
    std::filesystem::permissions(path_, std::filesystem::perms::owner_all, std::filesystem::perm_options::add, ignored);
    std::filesystem::remove_all(path_, ignored);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  const std::filesystem::path& path() const { return path_; }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

}  // namespace latentmoe::testing

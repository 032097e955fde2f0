#!/usr/bin/env bash
# The CPU test suite under AddressSanitizer + UndefinedBehaviorSanitizer, and the tests of the
# in-process group, the local group, the runner and the tails under ThreadSanitizer (CPU backend;
# the CUDA backend is not built here). Both builds are Debug (assertions on) at -O1 with line tables only:
# half the compile time of -O2 -g on CI's two cores, the suites a few seconds slower. Each prints its
# time; any report fails the run.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)
run_build() {  # build dir, flags
  cmake -S . -B "$1" -DCMAKE_BUILD_TYPE=Debug "-DCMAKE_CXX_FLAGS_DEBUG=-O1 -g1" -DLATENTMOE_CUDA=OFF "-DCMAKE_CXX_FLAGS=$2" \
    "-DCMAKE_EXE_LINKER_FLAGS=$2" > /dev/null
  cmake --build "$1" -j"$jobs" --target latentmoe_tests latentmoe_cli > /dev/null
}
start=$(date +%s)
run_build build-asan "-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  build-asan/tests/latentmoe_tests --gtest_brief=1
echo "sanitize: ASan+UBSan CPU suite passed ($(($(date +%s) - start)) s)"
start=$(date +%s)
run_build build-tsan "-fsanitize=thread"
TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 build-tsan/tests/latentmoe_tests --gtest_brief=1 \
  --gtest_filter='InProcessGroup*:LocalGroup*:*Runner*:*TailTier*:CliTest.run_*'
echo "sanitize: TSan group/runner/tail tests passed ($(($(date +%s) - start)) s)"

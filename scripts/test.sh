#!/usr/bin/env bash
# Fresh machine -> the whole test suite: set up, build, run every test with CTest. GPU tests skip
# themselves where no GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cd "${BUILD_DIR:-build}"
ctest --output-on-failure -j"$(nproc)" --timeout 600 "$@"

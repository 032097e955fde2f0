#!/usr/bin/env bash
# Fresh machine -> the whole test suite: set up, build, run every test with CTest, then the Python
# package's pytest suite (python/tests; LATENTMOE_PYTHON=0 skips it). GPU tests skip themselves where no GPU
# is present.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
if [ "${LATENTMOE_PYTHON:-1}" != 0 ]; then
  source scripts/python_env.sh
  # From the repository root: python/tests has no __init__.py, so the tests import the installed package.
  start=$(date +%s)
  "$PYTHON" -m pytest -q python/tests
  echo "test: Python suite passed ($(($(date +%s) - start)) s)"
fi
cd "${BUILD_DIR:-build}"
ctest --output-on-failure -j"$(nproc)" --timeout 600 "$@"

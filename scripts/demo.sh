#!/usr/bin/env bash
# Fresh machine -> the main job: set up, build, run `latentmoe demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
LATENTMOE_PYTHON=0 scripts/setup.sh  # the demo needs no Python package (no PyTorch download)
exec "${BUILD_DIR:-build}/latentmoe" demo "$@"

#!/usr/bin/env bash
# Fresh machine -> the main job: set up, build, run `latentmoe demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec "${BUILD_DIR:-build}/latentmoe" demo "$@"

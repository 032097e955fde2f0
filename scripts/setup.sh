#!/usr/bin/env bash
# Installs what a fresh Debian machine lacks to build latentmoe (idempotent: installs only missing
# packages), then configures and builds into ${BUILD_DIR:-build}.
#   LATENTMOE_CUDA=AUTO|ON|OFF  build the CUDA backend (AUTO: when nvcc is found)
#   BUILD_TYPE=Release          CMake build type
# Then the Python package (pyproject.toml, docs/PYTHON.md): PyTorch, pytest and numpy from PyPI (pip, only when
# missing), and `pip install .` of the package with the CPU backend (LATENTMOE_PYTHON_CUDA=AUTO|ON builds
# it with CUDA; the C++ build above already compiles every CUDA source). LATENTMOE_PYTHON=0 skips it.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(cmake make g++ nlohmann-json3-dev libcli11-dev libgtest-dev python3 python3-pip python3-venv clang-format)
# CI adds the fuzzing and sanitizer toolchain (clang with libFuzzer): LATENTMOE_EXTRA_PACKAGES.
read -r -a extra <<< "${LATENTMOE_EXTRA_PACKAGES:-}"
packages+=("${extra[@]}")
missing=()
for package in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# nvcc usually lives outside PATH on a fresh machine.
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi

build_dir=${BUILD_DIR:-build}
cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-Release}" -DLATENTMOE_CUDA="${LATENTMOE_CUDA:-AUTO}" >/dev/null
cmake --build "$build_dir" -j"$(nproc)"

# --- the Python package ---------------------------------------------------------------------------------
if [ "${LATENTMOE_PYTHON:-1}" != 0 ]; then
  start=$(date +%s)
  source scripts/python_env.sh
  # numpy: the tests' safetensors writer (python/tests/conftest.py; pyproject's `test` extra), which PyTorch's
  # wheels no longer pull in.
  if ! "$PYTHON" -c 'import torch, pytest, numpy, scikit_build_core' 2>/dev/null; then
    echo "setup: installing torch, pytest, numpy and scikit-build-core from PyPI for $PYTHON"
    "$PYTHON" -m pip install -q "torch>=2.6" pytest numpy scikit-build-core
  fi
  # The package's build keeps its folder (build-python/, pyproject.toml), so a second run rebuilds nothing.
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "$PYTHON" -m pip install -q --no-build-isolation --no-deps . \
    -C cmake.define.LATENTMOE_CUDA="${LATENTMOE_PYTHON_CUDA:-OFF}"
  echo "setup: Python package latentmoe installed for $PYTHON ($(($(date +%s) - start)) s)"
fi

#!/usr/bin/env bash
# Installs what a fresh Debian machine lacks to build latentmoe (idempotent: installs only missing
# packages), then configures and builds into ${BUILD_DIR:-build}.
#   LATENTMOE_CUDA=AUTO|ON|OFF  build the CUDA backend (AUTO: when nvcc is found)
#   BUILD_TYPE=Release          CMake build type
# Then the Python package (pyproject.toml, docs/PYTHON.md): `pip install ".[test]"`, the package with the CPU
# backend and what pyproject.toml declares for it and its tests (PyTorch, pytest, numpy: from PyPI only when
# missing). LATENTMOE_PYTHON_CUDA=AUTO|ON builds it with CUDA (the C++ build above already compiles every CUDA
# source); LATENTMOE_PYTHON=0 skips it.
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
  # What the package and its tests need comes from pyproject.toml alone, each fetched from PyPI only when missing:
  # build-system.requires (scikit-build-core), read here, then PyTorch (dependencies) and pytest and numpy (the `test`
  # extra) with the package. Built without pip's isolated environment, so that the build keeps its folder
  # (build-python/, pyproject.toml) and a second run rebuilds nothing (an isolated build reconfigured and rebuilt
  # the library every time: 72 s on two cores).
  if ! build_requires=$("$PYTHON" -c 'import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"]))' 2>/dev/null); then
    echo "setup: $PYTHON cannot read pyproject.toml (tomllib needs Python 3.11 or newer)" >&2
    exit 1
  fi
  mapfile -t build_requires <<< "$build_requires"
  "$PYTHON" -m pip install -q "${build_requires[@]}"
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "$PYTHON" -m pip install -q --no-build-isolation ".[test]" \
    -C cmake.define.LATENTMOE_CUDA="${LATENTMOE_PYTHON_CUDA:-OFF}"
  echo "setup: Python package latentmoe installed for $PYTHON ($(($(date +%s) - start)) s)"
fi

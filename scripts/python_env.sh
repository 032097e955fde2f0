# Sourced by scripts/setup.sh and scripts/test.sh: PYTHON, the interpreter the Python package is built,
# installed and tested with. python3 itself where pip may install into it; where the distribution marks it
# externally managed (PEP 668: Debian's own python3), a virtual environment in build-python/venv that sees
# the system's packages.
python_env() {
  local base=${LATENTMOE_PYTHON:-python3}
  local stdlib
  stdlib=$("$base" -c 'import sysconfig; print(sysconfig.get_path("stdlib"))')
  if [ -f "$stdlib/EXTERNALLY-MANAGED" ]; then
    if [ ! -x build-python/venv/bin/python ]; then
      mkdir -p build-python
      "$base" -m venv --system-site-packages build-python/venv
    fi
    PYTHON=$PWD/build-python/venv/bin/python
  else
    PYTHON=$(command -v "$base")
  fi
  export PYTHON
}
python_env

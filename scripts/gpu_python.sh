#!/usr/bin/env bash
# On the GPU machine (a device call that carries .device/wheel, made by scripts/build_gpu_wheel.sh here):
# installs the wheel into a folder of its own (--no-deps: the machine's PyTorch and its NVIDIA libraries are
# used), then runs the steps asked for, each writing its log into $OUT:
#   tests    the whole pytest suite, the CUDA tests included (python/tests/test_gpu.py: CUDA graphs, every
#            tier on simulated ranks, torchrun with one process per GPU when there are two or more)
#   example  examples/engine_layer.py on 4 simulated ranks of GPU 0, and under torchrun on every GPU (>= 2)
#   bench    bench/python/bench_layer_op.py (the op in a CUDA graph against `latentmoe bench layer`, the
#            eager host time, the op against PyTorch eager); with .device/bin/latentmoe (scripts/gpu_build.sh)
#            the C++ bench runs in the same call
#   scripts/gpu_python.sh [tests,example,bench] [label]      (default: tests,example; label names the files)
set -uo pipefail
cd "$(dirname "$0")/.."
steps=${1:-tests,example}
label=${2:-$(git rev-parse --short HEAD 2>/dev/null || echo run)}
out=${OUT:-/tmp/latentmoe-out}
mkdir -p "$out"
wheel=$(ls .device/wheel/latentmoe-*.whl 2>/dev/null | head -1)
if [ -z "$wheel" ]; then
  echo "gpu_python: no wheel in .device/wheel (run scripts/build_gpu_wheel.sh here and carry .device/wheel)" >&2
  exit 2
fi
target=/tmp/latentmoe-site
rm -rf "$target"
python3 -m pip install -q --no-deps --no-index --target "$target" "$wheel" || exit 2
export PYTHONPATH=$target${PYTHONPATH:+:$PYTHONPATH}
# latentmoe keeps NVLink multicast off and sets no NCCL variable itself; the machine sets it too.
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
log="$out/python_${label}.log"
{
  echo "# gpu_python $steps at $label on $(hostname)"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, latentmoe, json; print('torch', torch.__version__, torch.version.cuda, 'nccl', torch.cuda.nccl.version()); print(json.dumps(latentmoe.build_info()))"
} 2>&1 | tee "$log"
status=0
if [[ ",$steps," == *",tests,"* ]]; then
  python3 -m pytest -v -rs --durations=25 python/tests 2>&1 | tee -a "$log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if [[ ",$steps," == *",example,"* ]]; then
  python3 examples/engine_layer.py --simulated 4 --device cuda 2>&1 | tee -a "$log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
  if [ "$gpus" -ge 2 ]; then
    CUDA_MODULE_LOADING=LAZY python3 -m torch.distributed.run --standalone --nproc-per-node "$gpus" \
      examples/engine_layer.py 2>&1 | tee -a "$log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  fi
fi
if [[ ",$steps," == *",bench,"* ]]; then
  cli=()
  [ -x .device/bin/latentmoe ] && cli=(--cli .device/bin/latentmoe)
  python3 bench/python/bench_layer_op.py "${cli[@]}" --json "$out/python_op_${label}.json" 2>&1 | tee -a "$log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
echo "gpu_python: $steps finished with status $status" | tee -a "$log"
exit $status

# Sourced by the scripts that run on the GPU machine (gpu_run.sh, gpu_run_multi.sh) with their
# arguments BIN_DIR COMMIT STEPS: sets bin, commit, steps, out ($OUT, made), the environment every step
# needs, and has STEP (whether STEPS names it).
set -u
bin=$1
commit=$2
steps=$3
out=${OUT:-/tmp/latentmoe_out}
mkdir -p "$out"
# EAGER: simulated ranks spin in their collectives while peers load kernels (latentmoe/gpu_group.h).
# NVLink multicast stays off (latentmoe refuses any other value).
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 CUDA_MODULE_LOADING=EAGER
has() { [[ ,$steps, == *,$1,* ]]; }

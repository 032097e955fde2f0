#!/usr/bin/env bash
# Per-kernel device times of one `latentmoe bench layer` configuration under Nsight Compute (caches
# flushed before every kernel, as the benchmark does), one line per kernel launch:
#   scripts/gpu_kernel_times.sh BIN_DIR OUT_CSV [bench layer options...]
# e.g. scripts/gpu_kernel_times.sh .device/bin /tmp/k.csv --preset kimi-k3 --tp-shard 8 --tokens 1
# The benchmark runs with --warmup 0 --iterations 1, so each phase's kernels appear a few times.
set -u
bin=$1
csv=$2
shift 2
ncu --csv --print-units base --kernel-name-base function \
  --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size,launch__block_size \
  "$bin/latentmoe" bench layer --warmup 0 --iterations 1 "$@" > "$csv" 2> "$csv.log"
echo "ncu rc=$?"
python3 - "$csv" <<'PY'
import csv, sys
rows = list(csv.reader(l for l in open(sys.argv[1]) if l.startswith('"')))
head, body = rows[0], rows[1:]
ix = {h: i for i, h in enumerate(head)}
kernels = {}
for r in body:
    key = (r[ix["ID"]], r[ix["Kernel Name"]][:70])
    kernels.setdefault(key, {})[r[ix["Metric Name"]]] = r[ix["Metric Value"]]
groups = {}
for (i, name), m in kernels.items():
    if "fill_uniform" in name or "read_through" in name: continue
    key = (name, m.get("launch__grid_size", "?"), m.get("launch__block_size", "?"))
    groups.setdefault(key, []).append((float(m.get("gpu__time_duration.sum", "nan").replace(",", "")),
                                       float(m.get("dram__bytes_read.sum", "nan").replace(",", ""))))
for (name, grid, block), runs in groups.items():
    runs.sort()
    t, b = runs[len(runs) // 2]
    print(f"{name:70s} x{len(runs):<3} {t / 1e3:8.1f} us {b / 1e6:8.1f} MB grid {grid:>6} block {block}")
PY

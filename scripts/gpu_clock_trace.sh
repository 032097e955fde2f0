#!/usr/bin/env bash
# Samples the GPU's SM clock, memory clock, power and clock-event reasons every 20 ms while the layer
# benchmark runs one long row per case (each phase repeated --iterations times back to back), so the
# clock the expert GEMMs actually ran at can be read off the trace. Writes $OUT/clock_trace.csv and
# one log per case with its start and end timestamps; scripts/clock_trace_summary.py OUT_DIR summarises them.
#   scripts/gpu_clock_trace.sh BIN_DIR ITERATIONS "preset:tp:tokens ..."
# The GPU scripts' preamble (bin, out, environment), with this script's own second and third arguments.
source "$(dirname "$0")/gpu_script_env.sh" "$1" "" ""
iterations=$2
cases=$3
nvidia-smi -q -d POWER,CLOCK,PERFORMANCE > "$out/smi_before.txt" 2>&1
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active \
  --format=csv,noheader -lms 20 > "$out/clock_trace.csv" 2>&1 &
sampler=$!
for case in $cases; do
  IFS=: read -r preset tp tokens <<< "$case"
  log="$out/trace_${preset}_tp${tp}_t${tokens}.log"
  echo "start $(date +%Y/%m/%d\ %H:%M:%S.%N)" > "$log"
  timeout 150 "$bin/latentmoe" bench layer --preset "$preset" --tp-shard "$tp" --tokens "$tokens" \
    --iterations "$iterations" --warmup 3 >> "$log" 2>&1
  echo "rc $? end $(date +%Y/%m/%d\ %H:%M:%S.%N)" >> "$log"
  sleep 1
done
kill $sampler
nvidia-smi -q -d PERFORMANCE > "$out/smi_after.txt" 2>&1

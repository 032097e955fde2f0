#!/usr/bin/env bash
# compute-sanitizer over the whole GPU test suite, one test suite per sanitizer run, within a time budget:
#   scripts/gpu_sanitize_suite.sh TESTS_BINARY TOOL BUDGET_S PER_SUITE_S OUT_TSV
# TOOL is memcheck or racecheck. Suites run from the fastest (by the native times in the binary's own
# order) until BUDGET_S is spent; every suite gets one line in OUT_TSV:
#   tool  suite  status  seconds  detail
# status: clean, errors (the sanitizer's summary line in detail), failed (a test failed under the
# sanitizer), timeout (PER_SUITE_S passed), not_run (the budget was spent) or excluded (why in detail).
# Excluded: tests whose ranks are simulated on one GPU at tp > 1. The sanitizers serialise kernels, and a
# rank's collective kernel then waits for a peer's kernel that cannot start until it has finished: every
# such test ends in its collective timeout, by design (latentmoe/gpu_group.h). Their collectives are
# covered at one rank (GpuGroup.a_one_rank*), which is the same kernel code.
set -u
bin=$1
tool=$2
budget=$3
per_suite=$4
tsv=$5
log_dir=$(dirname "$tsv")/sanitize_logs
mkdir -p "$log_dir"
excluded_reason="ranks simulated on one GPU at tp > 1: serialised kernels wait for their peers (see header)"
is_excluded() {
  case $1 in
    GpuGroupOddShapes | GpuGroupGraph | CudaRankContext | */GpuGroupCollectives | */GpuGroupLayer) return 0 ;;
    */NcclGroupCollectives | */NcclGroupLayer | */NcclGroupGraph) return 0 ;;
  esac
  return 1
}
# Suites in the binary's order; the timing-based GpuGroup tests (a rank that never arrives, abort) are
# run without the sanitizer's slowdown only, so GpuGroup is narrowed to its one-rank and rejection tests.
# The suites that take tens of seconds natively (minutes under a sanitizer) run last.
heavy='^(Skinny|Cuda_GroupedGemm/GroupedGemmCase|Gemv|GemvBackend|CudaExperts)$'
mapfile -t listed < <("$bin" --gtest_list_tests | grep -E '^[^ ]' | grep -v '^Running main' | sed 's/  *#.*//' | sed 's/\.$//')
mapfile -t suites < <(printf '%s\n' "${listed[@]}" | grep -vE "$heavy"; printf '%s\n' "${listed[@]}" | grep -E "$heavy")
start=$(date +%s)
for suite in "${suites[@]}"; do
  if is_excluded "$suite"; then
    printf '%s\t%s\texcluded\t0\t%s\n' "$tool" "$suite" "$excluded_reason" >> "$tsv"
    continue
  fi
  now=$(date +%s)
  if (( now - start >= budget )); then
    printf '%s\t%s\tnot_run\t0\tthe %s s budget was spent\n' "$tool" "$suite" "$budget" >> "$tsv"
    continue
  fi
  filter="$suite.*"
  [[ $suite == GpuGroup ]] && filter='GpuGroup.a_one_rank*:GpuGroup.rejects*'
  log="$log_dir/${tool}_${suite//\//_}.log"
  t0=$(date +%s)
  timeout "$per_suite" compute-sanitizer --tool "$tool" --error-exitcode 9 "$bin" --gtest_filter="$filter" > "$log" 2>&1
  rc=$?
  seconds=$(( $(date +%s) - t0 ))
  summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log" | tail -1 | sed 's/^========= //')
  if (( rc == 124 )); then status=timeout
  elif (( rc == 9 )); then status=errors
  elif (( rc != 0 )); then status=failed; summary="rc $rc; $(grep -E '^\[  FAILED  \]' "$log" | head -3 | tr '\n' ' ')"
  else status=clean
  fi
  printf '%s\t%s\t%s\t%s\t%s\n' "$tool" "$suite" "$status" "$seconds" "$summary" >> "$tsv"
done

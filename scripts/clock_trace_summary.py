#!/usr/bin/env python3
"""Summarises a trace of scripts/gpu_clock_trace.sh: for each case (its log's start and end time), the
samples nvidia-smi took meanwhile: SM clock (median, 5th and 95th percentile), power (median, max),
and the share of samples with the software power cap or a thermal or hardware slowdown active; then the
same over the case's loaded samples only (power at least half the case's maximum), since a case's window
also holds the benchmark's set-up.

  python3 scripts/clock_trace_summary.py TRACE_DIR   (clock_trace.csv and trace_*.log in it)
"""
import datetime
import glob
import os
import statistics
import sys

# clocks_event_reasons bits (nvidia-smi --help-query-gpu)
SW_POWER_CAP, HW_SLOWDOWN, SW_THERMAL, HW_THERMAL, HW_POWER_BRAKE = 0x4, 0x8, 0x20, 0x40, 0x80


def parse_time(text):
    text = text.strip()
    if "." in text:  # nanoseconds from `date +%N`: keep microseconds
        head, frac = text.split(".")
        text = head + "." + frac[:6]
    return datetime.datetime.strptime(text, "%Y/%m/%d %H:%M:%S.%f")


def samples(path):
    rows = []
    with open(path) as f:
        for line in f:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) < 6 or not parts[1].endswith("MHz"):
                continue
            rows.append(dict(t=parse_time(parts[0]), sm=float(parts[1].split()[0]), power=float(parts[3].split()[0]),
                             reasons=int(parts[5], 16)))
    return rows


def case_window(path):
    start = end = None
    with open(path) as f:
        for line in f:
            if line.startswith("start "):
                start = parse_time(line[len("start "):])
            elif line.startswith("rc ") and " end " in line:
                end = parse_time(line.split(" end ", 1)[1])
    return start, end


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))]


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: clock_trace_summary.py TRACE_DIR")
    trace_dir = sys.argv[1]
    rows = samples(os.path.join(trace_dir, "clock_trace.csv"))
    if not rows:
        sys.exit(f"no samples in {trace_dir}/clock_trace.csv")
    print("# case                              samples  sm_MHz(p5 med p95)  power_W(med max)  sw_power_cap  thermal/hw")
    for log in sorted(glob.glob(os.path.join(trace_dir, "trace_*.log"))):
        start, end = case_window(log)
        name = os.path.basename(log)[len("trace_"):-len(".log")]
        if start is None or end is None:
            print(f"  {name:34s} no start/end in its log")
            continue
        window = [r for r in rows if start <= r["t"] <= end]
        if not window:
            print(f"  {name:34s} no samples between {start} and {end}")
            continue
        top = max(r["power"] for r in window)
        loaded = [r for r in window if r["power"] >= 0.5 * top]
        for label, part in ((name, window), (name + " (loaded)", loaded)):
            sm = [r["sm"] for r in part]
            power = [r["power"] for r in part]
            capped = sum(1 for r in part if r["reasons"] & SW_POWER_CAP) / len(part)
            slowed = sum(1 for r in part if r["reasons"] & (HW_SLOWDOWN | SW_THERMAL | HW_THERMAL | HW_POWER_BRAKE))
            print(f"  {label:34s} {len(part):7d}  {percentile(sm, 0.05):6.0f} {statistics.median(sm):5.0f} "
                  f"{percentile(sm, 0.95):5.0f}     {statistics.median(power):6.1f} {max(power):6.1f}     "
                  f"{100 * capped:8.1f}%   {100 * slowed / len(part):6.1f}%")


if __name__ == "__main__":
    main()

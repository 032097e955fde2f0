#!/usr/bin/env python3
"""scripts/clock_trace_summary.py on a hand-made trace: two cases, samples inside and outside their windows,
the power-cap bit in some of them; the printed counts, clocks and shares are checked against the values worked
out by hand, and a trace without samples is refused with a non-zero exit."""
import os
import subprocess
import sys
import tempfile

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts", "clock_trace_summary.py")


def sample(second, sm, power, reasons):
    return f"2026/12/06 09:00:{second:02d}.000, {sm} MHz, 2619 MHz, {power} W, 50, 0x{reasons:016x}\n"


def run(trace_dir):
    return subprocess.run([sys.executable, SCRIPT, trace_dir], capture_output=True, text=True)


def main():
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "clock_trace.csv"), "w") as f:
            f.write(sample(0, 1980, 100.0, 0x1))  # before case a: not counted
            f.write(sample(1, 1980, 100.0, 0x0))  # case a: idle sample (below half of its maximum power)
            f.write(sample(2, 1800, 680.0, 0x4))  # case a: capped
            f.write(sample(3, 1600, 700.0, 0x4))  # case a: capped
            f.write(sample(4, 1980, 600.0, 0x0))  # case a
            f.write(sample(6, 1500, 650.0, 0x44))  # case b: capped and thermal
            f.write("garbage line\n")
        with open(os.path.join(d, "trace_a_tp8_t4096.log"), "w") as f:
            f.write("start 2026/12/06 09:00:00.500000000\n# bench output\nrc 0 end 2026/12/06 09:00:04.500000000\n")
        with open(os.path.join(d, "trace_b_tp8_t4096.log"), "w") as f:
            f.write("start 2026/12/06 09:00:05.500000000\nrc 0 end 2026/12/06 09:00:06.500000000\n")
        result = run(d)
        assert result.returncode == 0, result.stderr
        rows = {}
        for line in result.stdout.splitlines()[1:]:
            name, rest = line[:36].strip(), line[36:].split()
            rows[name] = rest
        # case a: 4 samples; clocks sorted 1600 1800 1980 1980 -> p5 1600, median 1890, p95 1980; power median
        # (600 + 680) / 2 = 640, max 700; capped 2 of 4.
        assert rows["a_tp8_t4096"] == ["4", "1600", "1890", "1980", "640.0", "700.0", "50.0%", "0.0%"], rows
        # loaded (power >= 350 W): 3 samples, clocks 1600 1800 1980; capped 2 of 3.
        assert rows["a_tp8_t4096 (loaded)"] == ["3", "1600", "1800", "1980", "680.0", "700.0", "66.7%", "0.0%"], rows
        assert rows["b_tp8_t4096"] == ["1", "1500", "1500", "1500", "650.0", "650.0", "100.0%", "100.0%"], rows
        open(os.path.join(d, "clock_trace.csv"), "w").close()
        empty = run(d)
        assert empty.returncode != 0 and "no samples" in empty.stderr, (empty.returncode, empty.stderr)
    print("clock_trace_summary: ok")


if __name__ == "__main__":
    main()

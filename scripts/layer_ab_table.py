#!/usr/bin/env python3
"""Summarises an alternating A/B of `latentmoe bench layer` (scripts/gpu_run.sh's bench_ab step, or any
call that writes one JSON per build, experts format and round): per (experts, preset, tp-shard, tokens), the
median over rounds of each build's graph time, each build's ratio to the baseline, and the baseline's
multiple of its byte floor. Files are named layer_ab_<build>_<experts>_<round>.json; the baseline build is
`base` (--base names another). A build missing a row prints "-" there; a folder without such files is an
error.

  python3 scripts/layer_ab_table.py RESULTS_DIR [--base NAME]
"""
import argparse
import glob
import json
import os
import re
import statistics
import sys

NAME = re.compile(r"layer_ab_(?P<build>[A-Za-z0-9-]+)_(?P<experts>[a-z0-9]+)_(?P<round>\d+)\.json$")


def load(folder):
    """{(experts, preset, tp_shard, tokens): {build: [graph µs per round]}}, {key: floor µs}, [builds]."""
    times, floors, builds = {}, {}, []
    for path in sorted(glob.glob(os.path.join(folder, "layer_ab_*.json"))):
        match = NAME.search(os.path.basename(path))
        if match is None:
            continue
        build, experts = match.group("build"), match.group("experts")
        if build not in builds:
            builds.append(build)
        with open(path) as f:
            rows = json.load(f).get("rows", [])
        for row in rows:
            key = (experts, row["preset"], row["tp_shard"], row["tokens"])
            times.setdefault(key, {}).setdefault(build, []).append(row["graph_total_time_us"])
            floors[key] = row["total_floor_us"]
    return times, floors, builds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--base", default="base", help="the baseline build's name (default: base)")
    args = parser.parse_args()
    times, floors, builds = load(args.folder)
    if not times:
        sys.exit(f"layer_ab_table: no layer_ab_<build>_<experts>_<round>.json with rows in {args.folder}")
    if args.base not in builds:
        sys.exit(f"layer_ab_table: no build named {args.base!r} (found {', '.join(builds)})")
    others = [b for b in builds if b != args.base]
    order = [args.base] + others
    print("experts preset tp tokens | " + " ".join(f"{b:>9s}" for b in order) + " | " +
          " ".join(f"{b + '/' + args.base:>12s}" for b in others) + " | base/floor | rounds")
    for key in sorted(times):
        medians = {b: statistics.median(times[key][b]) for b in order if times[key].get(b)}
        cells = [f"{medians[b]:9.1f}" if b in medians else f"{'-':>9s}" for b in order]
        base = medians.get(args.base)
        ratios = [f"{medians[b] / base:12.3f}" if base and b in medians else f"{'-':>12s}" for b in others]
        floor = f"{base / floors[key]:9.2f}x" if base and floors[key] > 0 else f"{'-':>10s}"
        counts = ",".join(str(len(times[key].get(b, []))) for b in order)
        experts, preset, tp, tokens = key
        print(f"{experts:5s} {preset:15s} {tp:2d} {tokens:6d} | " + " ".join(cells) + " | " + " ".join(ratios) +
              f" | {floor} | {counts}")


if __name__ == "__main__":
    main()

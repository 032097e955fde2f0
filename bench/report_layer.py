#!/usr/bin/env python3
"""Prints the Markdown table of docs/PERFORMANCE.md's layer section from the bench-layer JSON and the
two peers' JSON (same rows): per row the layer's time (one stream of launches, and replayed as a CUDA
graph), its floor, the experts' fraction of floor, and the peers' times (torch._grouped_mm: its two
GEMMs, its best case).

    python3 bench/report_layer.py LAYER.json EAGER.json GROUPED_MM.json
"""
import json
import sys


def index(rows):
    return {(r["preset"], r["tp_shard"], r["tokens"]): r for r in rows}


def main():
    layer = json.load(open(sys.argv[1]))
    eager = index(json.load(open(sys.argv[2]))["rows"])
    grouped = index(json.load(open(sys.argv[3]))["rows"])
    print("| preset | tp-shard | T | touched | layer µs | layer graph µs | layer floor µs | graph / floor | experts µs "
          "| experts fraction of floor | torch eager layer µs | torch._grouped_mm experts µs | vs eager | "
          "vs grouped_mm |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in layer["rows"]:
        key = (r["preset"], r["tp_shard"], r["tokens"])
        experts = r["phases"]["experts"]["time_us"]
        e = eager.get(key, {}).get("total_time_us")
        g = (grouped.get(key, {}).get("experts") or {}).get("time_us")
        ratio = r["graph_total_time_us"] / r["total_floor_us"]
        print(f"| {r['preset']} | {r['tp_shard']} | {r['tokens']} | {r['touched_experts']} | {r['total_time_us']:.1f} | "
              f"{r['graph_total_time_us']:.1f} | {r['total_floor_us']:.1f} | {ratio:.2f}x | {experts:.1f} | "
              f"**{r['experts_fraction_of_floor']:.2f}** | "
              f"{e:.0f} | {g:.1f} | {e / r['total_time_us']:.0f}x faster | "
              f"{'%.2fx faster' % (g / experts) if g >= experts else '%.2fx (slower)' % (g / experts)} |")


if __name__ == "__main__":
    main()

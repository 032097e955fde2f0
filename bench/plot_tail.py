#!/usr/bin/env python3
"""Draws the bench-tail report: per (preset, tp), the tail of every tier and the unfused tail against
tokens (top), and the whole layer with each tier (bottom), beside the all-reduce ceiling and tier 0's
floor; the rows of a PyTorch peer (bench/peers/torch_tail.py) are drawn beside them.

    python3 bench/plot_tail.py TAIL.json [--peer PEER.json ...] --out plot.png

TAIL.json is written by `latentmoe bench tail --json` (format latentmoe-bench-tail-1, documented in
docs/PERFORMANCE.md, "Tail benchmark"); a peer JSON has rows of the same schema (path "torch_unfused").
Simulated rows (every rank on one device) say so in the panel titles: no NVLink cost is in them.
"""
import argparse
import json

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

TIERS = ("native", "tail_fusion", "allreduce_overlap", "column_parallel")


def series(rows, path, key):
    points = sorted((r["tokens"], r[key]) for r in rows if r["path"] == path and r.get("ran") and key in r)
    return [t for t, _ in points], [v for _, v in points]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tail_json")
    parser.add_argument("--peer", action="append", default=[])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    report = json.load(open(args.tail_json))
    peers = [json.load(open(path)) for path in args.peer]
    groups = sorted({(row["preset"], row["tp"], row["placement"]) for row in report["rows"]})
    if not groups:
        raise SystemExit(f"{args.tail_json}: no rows")
    fig, axes = plt.subplots(2, len(groups), figsize=(4.8 * len(groups), 8.5), squeeze=False)
    for column, (preset, tp, placement) in enumerate(groups):
        rows = [r for r in report["rows"] if r["preset"] == preset and r["tp"] == tp and r["placement"] == placement]
        top, bottom = axes[0][column], axes[1][column]
        for tier in TIERS:
            top.plot(*series(rows, tier, "time_us"), "o-", markersize=3, label=f"{tier} tail")
            bottom.plot(*series(rows, tier, "layer_time_us"), "o-", markersize=3, label=f"layer, {tier}")
        top.plot(*series(rows, "unfused", "time_us"), "s--", markersize=3, label="unfused (AR, norm, GEMM, AR, add)")
        top.plot(*series(rows, "ar_rmsnorm", "time_us"), "^:", markersize=3, label="AR+RMSNorm step")
        top.plot(*series(rows, "ar_then_rmsnorm", "time_us"), "v:", markersize=3, label="AR, then RMSNorm")
        top.plot(*series(rows, "all_reduce", "time_us"), "k:", label="AR of [T, d]")
        top.plot(*series(rows, "tail_fusion", "floor_us"), "k--", label="tier 0 floor")
        bottom.plot(*series(rows, "native", "layer_floor_us"), "k--", label="layer floor (native)")
        for peer in peers:
            peer_rows = [r for r in peer.get("rows", []) if r.get("preset") == preset and r.get("tp") == tp]
            label = f"torch unfused ({peer_rows[0]['placement']})" if peer_rows else None
            if peer_rows:
                top.plot(*series(peer_rows, "torch_unfused", "time_us"), "x-.", label=label)
        where = "simulated on one device:\nno NVLink cost" if placement == "simulated" else "one GPU per rank"
        top.set(yscale="log", title=f"{preset}, tp {tp}\n({where})", xlabel="tokens",
                ylabel="tail time (us), slowest rank")
        bottom.set(yscale="log", xlabel="tokens", ylabel="layer time (us), slowest rank")
        for axis in (top, bottom):
            axis.set_xscale("log", base=2)
            axis.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        top.legend(fontsize=6)
        bottom.legend(fontsize=6)
    commit = report.get("commit") or "?"
    fig.suptitle(f"latentmoe bench tail on {report.get('device', '?')}, {report.get('backend', '?')} backend "
                 f"(commit {commit[:10]})")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()

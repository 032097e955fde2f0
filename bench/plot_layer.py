#!/usr/bin/env python3
"""Draws the bench-layer report: time and fraction of floor against tokens, one panel pair per
(preset, tp_shard), latentmoe beside its peers.

    python3 bench/plot_layer.py LAYER.json [--peer PEER.json ...] --out plot.png

LAYER.json is written by `latentmoe bench layer --json`; a peer JSON has rows with preset,
tp_shard, tokens and total_time_us (bench/peers/torch_eager_layer.py) or experts.time_us and
chain.time_us (bench/peers/torch_grouped_mm.py).
"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("layer_json")
    parser.add_argument("--peer", action="append", default=[])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    report = json.load(open(args.layer_json))
    peers = [json.load(open(path)) for path in args.peer]
    groups = sorted({(row["preset"], row["tp_shard"]) for row in report["rows"]})
    fig, axes = plt.subplots(2, len(groups), figsize=(4.5 * len(groups), 8), squeeze=False)
    for column, (preset, tp_shard) in enumerate(groups):
        rows = sorted((r for r in report["rows"] if r["preset"] == preset and r["tp_shard"] == tp_shard),
                      key=lambda r: r["tokens"])
        tokens = [r["tokens"] for r in rows]
        top, bottom = axes[0][column], axes[1][column]
        top.plot(tokens, [r["total_time_us"] for r in rows], "o-", label="latentmoe layer")
        top.plot(tokens, [r["total_floor_us"] for r in rows], "k--", label="layer floor")
        top.plot(tokens, [r["phases"]["experts"]["time_us"] for r in rows], "s-", label="latentmoe experts")
        for peer in peers:
            peer_rows = sorted((r for r in peer["rows"] if r["preset"] == preset and r["tp_shard"] == tp_shard),
                               key=lambda r: r["tokens"])
            series = (
                ("torch eager layer", lambda r: r.get("total_time_us")),
                ("torch._grouped_mm experts", lambda r: (r.get("experts") or {}).get("time_us")),
                ("torch gather+grouped_mm+act chain", lambda r: (r.get("chain") or {}).get("time_us")),
            )
            for label, value in series:
                points = [(r["tokens"], value(r)) for r in peer_rows if value(r) is not None]
                if points:
                    top.plot(*zip(*points), "x:", label=label)
        top.set(xscale="log", yscale="log", title=f"{preset}, tp-shard {tp_shard}", xlabel="tokens",
                ylabel="time (us)")
        top.legend(fontsize=7)
        bottom.plot(tokens, [r["total_fraction_of_floor"] for r in rows], "o-", label="layer")
        bottom.plot(tokens, [r["experts_fraction_of_floor"] for r in rows], "s-", label="experts")
        bottom.axhline(0.85, color="gray", linestyle=":", label="0.85 target")
        bottom.set(xscale="log", ylim=(0, 1.05), xlabel="tokens", ylabel="fraction of floor")
        bottom.legend(fontsize=7)
    fig.suptitle(f"latentmoe bench layer on {report.get('device', '?')} (commit {report.get('commit', '?')[:10]})")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()

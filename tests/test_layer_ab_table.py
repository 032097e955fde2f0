#!/usr/bin/env python3
"""scripts/layer_ab_table.py on hand-made bench JSON: two builds, three rounds, one row that one build lacks;
the printed medians, ratios and floor multiples are checked against values worked out by hand, and a folder
without A/B files or without the named baseline is refused with a non-zero exit."""
import json
import os
import subprocess
import sys
import tempfile

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts", "layer_ab_table.py")


def row(tokens, graph_us, floor_us, preset="kimi-k3", tp_shard=8):
    return {"preset": preset, "tp_shard": tp_shard, "tokens": tokens, "graph_total_time_us": graph_us,
            "total_floor_us": floor_us}


def write(folder, name, rows):
    with open(os.path.join(folder, name), "w") as f:
        json.dump({"rows": rows}, f)


def run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True)


def table(stdout):
    """{(experts, preset, tp, tokens): the cells after the key} from the printed lines."""
    rows = {}
    for line in stdout.splitlines()[1:]:
        key, _, rest = line.partition("|")
        experts, preset, tp, tokens = key.split()
        rows[(experts, preset, int(tp), int(tokens))] = [cell.split() for cell in rest.split("|")]
    return rows


def main():
    with tempfile.TemporaryDirectory() as d:
        # base at one token: 100, 104, 98 -> median 100; new: 90, 95, 97 -> median 95; floor 50.
        for round_, (base_t1, new_t1) in enumerate([(100.0, 90.0), (104.0, 95.0), (98.0, 97.0)], start=1):
            write(d, f"layer_ab_base_mxfp4_{round_}.json", [row(1, base_t1, 50.0), row(8, 200.0, 160.0)])
            # new lacks the 8-token row in round 3 only: its median is over two rounds (210, 230 -> 220).
            new_rows = [row(1, new_t1, 50.0)] + ([row(8, 190.0 + 20.0 * round_, 160.0)] if round_ < 3 else [])
            write(d, f"layer_ab_new_mxfp4_{round_}.json", new_rows)
        write(d, "layer_ab_base_dense_1.json", [row(64, 300.0, 250.0, preset="nemotron3-super")])
        write(d, "unrelated.json", [row(1, 1.0, 1.0)])  # not an A/B file: ignored
        result = run(d)
        assert result.returncode == 0, result.stderr
        rows = table(result.stdout)
        assert rows[("mxfp4", "kimi-k3", 8, 1)] == [["100.0", "95.0"], ["0.950"], ["2.00x"], ["3,3"]], rows
        assert rows[("mxfp4", "kimi-k3", 8, 8)] == [["200.0", "220.0"], ["1.100"], ["1.25x"], ["3,2"]], rows
        # new has no dense files: "-" in its cells, its ratio, and a zero count.
        assert rows[("dense", "nemotron3-super", 8, 64)] == [["300.0", "-"], ["-"], ["1.20x"], ["1,0"]], rows
        assert len(rows) == 3, rows
        # Another baseline by name: the ratios turn over.
        flipped = table(run(d, "--base", "new").stdout)
        assert flipped[("mxfp4", "kimi-k3", 8, 1)][:2] == [["95.0", "100.0"], ["1.053"]], flipped
        missing = run(d, "--base", "main")
        assert missing.returncode != 0 and "no build named 'main'" in missing.stderr, missing.stderr
    with tempfile.TemporaryDirectory() as empty_dir:
        empty = run(empty_dir)
        assert empty.returncode != 0 and "no layer_ab_" in empty.stderr, (empty.returncode, empty.stderr)
    print("layer_ab_table: ok")


if __name__ == "__main__":
    main()

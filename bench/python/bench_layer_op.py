#!/usr/bin/env python3
"""The Python package's overhead on a GPU (issue 30, item 8; docs/PYTHON.md): ready to run on the GPU machine.

1. graph: torch.ops.latentmoe.layer_forward captured in a torch CUDA graph and replayed, against
   `latentmoe bench layer`'s graph time (graph_total_time_us) for the same rows: kimi-k3 at tp-shard 8 (one
   rank's share of a tp 8 deployment: every expert with I/8 rows, the shared expert with Is/8, no
   collective), bf16, T = 1 and 64. Same method as the C++ bench (docs/PERFORMANCE.md): seeded random
   weights made on the GPU, router logits U(-2, 2), correction bias U(-1e-3, 1e-3), the L2 flushed (read)
   before every replay outside the events, 3 warm-ups, median of 20. The C++ figures are run here with
   --cli (a latentmoe binary: scripts/gpu_build.sh) or read from --cli-json; the target is within 2%.
2. host: the eager op's host time per call beside plain torch ops (bench/python/host_cost.py's rows, on the
   GPU).
3. eager: the layer op (eager, tier native) against the reference's native path written with torch ops
   (bench/peers/torch_eager_layer.py: routing, W_down, a loop over the touched experts, the shared expert,
   the norm, W_up) on the same row, T = 1..4096, each timed as in 1 (events, L2 flushed, median).

    python3 bench/python/bench_layer_op.py --json bench/results/python_op_h200_<commit>.json \\
        [--cli .device/bin/latentmoe | --cli-json layer.json] [--tokens 1,64] [--sweep 1,2,4,...,4096]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch

import latentmoe

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "peers"))
sys.path.insert(0, HERE)

PRESETS = {
    "kimi-k3": dict(d=7168, l=3584, E=896, k=16, I=3072, Is=6144, act="situ", norm=True, scale=1.0),
    "nemotron3-super": dict(d=4096, l=1024, E=512, k=22, I=2688, Is=5376, act="relu2", norm=False, scale=5.0),
}


def config_of(preset, tp_shard):
    p = PRESETS[preset]
    return {
        "hidden_size": p["d"],
        "moe_latent_size": p["l"],
        "n_routed_experts": p["E"],
        "num_experts_per_tok": p["k"],
        "moe_intermediate_size": p["I"] // tp_shard,
        "shared_expert_intermediate_size": p["Is"] // tp_shard,
        "hidden_act": p["act"],
        "latent_moe_use_norm": p["norm"],
        "routed_scaling_factor": p["scale"],
        "norm_topk_prob": True,
    }


def make_layer(preset, tp_shard, ctx, seed=2026):
    """The shard's layer from seeded random bf16 weights made on the GPU (as `latentmoe bench layer` does),
    given to LatentMoE as full tp-1 tensors of the shard's config (so the rank takes them as they are)."""
    p = PRESETS[preset]
    device = ctx.device
    g = torch.Generator(device=device).manual_seed(seed)
    d, l, e, i, s = p["d"], p["l"], p["E"], p["I"] // tp_shard, p["Is"] // tp_shard

    def rand(*shape, fan_in):
        t = torch.empty(*shape, device=device, dtype=torch.bfloat16)
        return t.uniform_(-1.0, 1.0, generator=g).mul_(fan_in ** -0.5)

    w = {
        "gate.e_score_correction_bias": torch.empty(e, device=device).uniform_(-1e-3, 1e-3, generator=g),
        "routed_expert_down_proj.weight": rand(l, d, fan_in=d),
        "routed_expert_up_proj.weight": rand(d, l, fan_in=l),
        "shared_experts.up_proj.weight": rand(s, d, fan_in=d),
        "shared_experts.down_proj.weight": rand(d, s, fan_in=s),
    }
    if p["norm"]:
        w["routed_expert_norm.weight"] = torch.ones(l, device=device)
    gated = p["act"] != "relu2"
    if gated:
        w["shared_experts.gate_proj.weight"] = rand(s, d, fan_in=d)
    # One stacked tensor per projection, handed over as per-expert views (no copy here; the layer stacks
    # its own, as an engine's load would).
    stacks = {"up_proj": rand(e, i, l, fan_in=l), "down_proj": rand(e, l, i, fan_in=i)}
    if gated:
        stacks["gate_proj"] = rand(e, i, l, fan_in=l)
    for name, stack in stacks.items():
        for x in range(e):
            w[f"experts.{x}.{name}.weight"] = stack[x]
    layer = latentmoe.LatentMoE(config_of(preset, tp_shard), w, ctx)
    del w, stacks
    torch.cuda.empty_cache()
    return layer


class Timer:
    """CUDA events around one call, the L2 flushed (a read of twice its size) before it, outside them."""

    def __init__(self, device):
        size = 2 * torch.cuda.get_device_properties(device).L2_cache_size // 4
        self.flush = torch.zeros(size, dtype=torch.int32, device=device)

    def median_us(self, fn, warmup=3, runs=20):
        times = []
        for run in range(warmup + runs):
            self.flush.sum()
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            if run >= warmup:
                times.append(1000.0 * start.elapsed_time(stop))
        return statistics.median(times)


def inputs(preset, tokens, device, seed):
    p = PRESETS[preset]
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.empty(tokens, p["d"], device=device, dtype=torch.bfloat16).uniform_(-1, 1, generator=g)
    logits = torch.empty(tokens, p["E"], device=device).uniform_(-2, 2, generator=g)
    return x, logits


def graph_us(layer, timer, x, logits):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            layer(x, logits, tier="native")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer(x, logits, tier="native")
    return timer.median_us(graph.replay)


def cli_rows(args, preset, tp_shard, tokens):
    if args.cli_json:
        with open(args.cli_json, encoding="utf-8") as file:
            report = json.load(file)
    elif args.cli:
        with tempfile.TemporaryDirectory() as folder:
            out = os.path.join(folder, "layer.json")
            subprocess.run([args.cli, "bench", "layer", "--preset", preset, "--tp-shard", str(tp_shard), "--tokens",
                            ",".join(map(str, tokens)), "--json", out], check=True)
            with open(out, encoding="utf-8") as file:
                report = json.load(file)
    else:
        return {}
    return {row["tokens"]: row for row in report["rows"] if row["preset"] == preset and row["tp_shard"] == tp_shard}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="kimi-k3")
    parser.add_argument("--tp-shard", type=int, default=8)
    parser.add_argument("--tokens", default="1,64", help="graph rows (against latentmoe bench layer)")
    parser.add_argument("--sweep", default="1,2,4,8,16,32,64,128,256,512,1024,2048,4096", help="eager rows")
    parser.add_argument("--cli", default="", help="a latentmoe binary to run `bench layer` with, in this call")
    parser.add_argument("--cli-json", default="", help="or its JSON, run before")
    parser.add_argument("--skip", default="", help="comma-separated parts to leave out: graph,host,eager")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    device = torch.device("cuda", torch.cuda.current_device())
    tokens = [int(t) for t in args.tokens.split(",")]
    sweep = [int(t) for t in args.sweep.split(",")]
    report = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
              "latentmoe": latentmoe.build_info(), "preset": args.preset, "tp_shard": args.tp_shard}
    print(f"# {report['device']}, torch {torch.__version__}, {args.preset} tp-shard {args.tp_shard}, bf16")

    if "host" not in skip:
        import host_cost

        print("# host time per eager call (median of 4000)")
        report["host"] = host_cost.measure(device, 4000)

    ctx = latentmoe.RankContext(device, max_tokens=max(sweep + tokens))
    layer = make_layer(args.preset, args.tp_shard, ctx)
    timer = Timer(device)

    if "graph" not in skip:
        cli = cli_rows(args, args.preset, args.tp_shard, tokens)
        report["graph"] = []
        print(f"# {'T':>5} {'op graph us':>12} {'C++ graph us':>13} {'ratio':>7}")
        for t in tokens:
            x, logits = inputs(args.preset, t, device, seed=t)
            ours = graph_us(layer, timer, x, logits)
            theirs = cli.get(t, {}).get("graph_total_time_us")
            ratio = ours / theirs if theirs else None
            report["graph"].append({"tokens": t, "op_graph_us": ours, "cli_graph_us": theirs, "ratio": ratio,
                                    "within_2_percent": None if ratio is None else abs(ratio - 1) <= 0.02})
            print(f"  {t:>5} {ours:>12.1f} {theirs or float('nan'):>13.1f} {ratio or float('nan'):>7.3f}")

    if "eager" not in skip:
        from torch_eager_layer import Layer as TorchLayer

        peer = TorchLayer(args.preset, args.tp_shard, device, torch.bfloat16, seed=2026)
        report["eager"] = []
        print(f"# {'T':>5} {'op eager us':>12} {'torch eager us':>15} {'speed-up':>9}")
        for t in sweep:
            x, logits = inputs(args.preset, t, device, seed=t)
            ours = timer.median_us(lambda: layer(x, logits, tier="native"))
            theirs = timer.median_us(lambda: peer.forward(x, logits))
            report["eager"].append({"tokens": t, "op_eager_us": ours, "torch_eager_us": theirs, "speedup": theirs / ours})
            print(f"  {t:>5} {ours:>12.1f} {theirs:>15.1f} {theirs / ours:>9.2f}")
        del peer

    if args.json:
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump(report, file, indent=2)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""PyTorch peer of bench/grouped_gemm_bench.cu: torch._grouped_mm on the same expert problem.

Same presets, tp shards and token counts, the same routing distribution (k distinct uniform random
experts per token, seeded), 16 routings and inputs rotated, a CUDA graph of the 16 iterations per phase
(eager timing if capture fails), the median over replays, and the same floors against ceilings measured
in the same run. Phases:
  gate_up  torch._grouped_mm(x_sorted, W_gu^T, offs), x already gathered, gate and up stacked in one
           weight [E, 2 I_r, l] (one weight [E, I_r, l] for relu2): the most favourable form for torch.
  down     torch._grouped_mm(a, W_d^T, offs).
  chain    what a user writes: gather, gate_up, activation, down.
experts_fraction_of_floor uses gate_up + down (the grouped GEMMs alone).

  python3 bench/peers/torch_grouped_mm.py --json out.json [--presets ...] [--tp-shards 8,1] [--tokens ...]
"""
import argparse
import json
import statistics

import torch

PRESETS = {
    "kimi-k3": dict(latent=3584, experts=896, top_k=16, intermediate=3072, act="situ"),
    "nemotron3-super": dict(latent=1024, experts=512, top_k=22, intermediate=2688, act="relu2"),
}
NUM_LAYOUTS = 16


def time_ms(fn, reps_budget_ms=150.0):
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    start.record()
    fn()
    stop.record()
    stop.synchronize()
    first = start.elapsed_time(stop)
    reps = int(min(50, max(5, reps_budget_ms / max(first, 1e-3))))
    times = []
    for _ in range(reps):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def ceilings():
    n = 1 << 30  # 2 GiB of bf16
    a = torch.empty(n, dtype=torch.bfloat16, device="cuda").uniform_()
    b = torch.empty_like(a)
    ms = time_ms(lambda: b.copy_(a))
    copy_bw = 2 * a.numel() * 2 / (ms * 1e-3)
    del a, b
    m = 8192
    x = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    y = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    ms = time_ms(lambda: x @ y)
    gemm = 2 * m**3 / (ms * 1e-3)
    return copy_bw, gemm


def situ(g, u, b1=4.0, b2=25.0):
    return (b1 * torch.tanh(g / b1) * torch.sigmoid(g)) * (b2 * torch.tanh(u / b2))


def graph_or_eager(body):
    """Returns a callable running `body` (all NUM_LAYOUTS iterations): a CUDA graph replay if capture works."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            body()  # warm-up outside capture (allocations, kernel selection)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        return graph.replay, "graph"
    except Exception as exc:  # noqa: BLE001 - report and fall back
        print(f"  (graph capture failed: {type(exc).__name__}: {exc}; timing eagerly)")
        torch.cuda.synchronize()
        return body, "eager"


def run_row(preset_name, p, tp, tokens, weights, copy_bw, gemm_rate, gen):
    gated = p["act"] != "relu2"
    E, k, l = p["experts"], p["top_k"], p["latent"]
    ir = p["intermediate"] // tp
    w_gu, w_d = weights
    pairs = tokens * k
    layouts = []
    touched = 0.0
    for li in range(NUM_LAYOUTS):
        scores = torch.rand(tokens, E, device="cuda", generator=gen)
        ids = scores.topk(k, dim=1).indices.flatten()
        order = torch.argsort(ids, stable=True)
        counts = torch.bincount(ids, minlength=E)
        touched += float((counts > 0).sum())
        offs = torch.cumsum(counts, 0).to(torch.int32)
        token_of_row = (order // k).contiguous()
        z = torch.empty(tokens, l, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)
        layouts.append((offs, token_of_row, z))
    touched /= NUM_LAYOUTS
    x_sorted = [z[tok] for (_, tok, z) in layouts]
    a_in = [torch.empty(pairs, ir, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1) for _ in range(NUM_LAYOUTS)]
    w_gu_t = w_gu.transpose(1, 2)
    w_d_t = w_d.transpose(1, 2)

    def gate_up():
        for li in range(NUM_LAYOUTS):
            torch._grouped_mm(x_sorted[li], w_gu_t, offs=layouts[li][0])

    def down():
        for li in range(NUM_LAYOUTS):
            torch._grouped_mm(a_in[li], w_d_t, offs=layouts[li][0])

    def chain():
        for li in range(NUM_LAYOUTS):
            offs, tok, z = layouts[li]
            h = torch._grouped_mm(z[tok], w_gu_t, offs=offs)
            if gated:
                a = situ(h[:, :ir], h[:, ir:])
            else:
                a = torch.relu(h).square()
            torch._grouped_mm(a, w_d_t, offs=offs)

    result = dict(preset=preset_name, tp_shard=tp, tokens=tokens, dtype="bf16", touched_experts=touched)
    mats = 2 if gated else 1
    gu_bytes = touched * mats * ir * l * 2 + tokens * l * 2 + pairs * ir * 2
    dn_bytes = touched * ir * l * 2 + pairs * ir * 2 + pairs * l * 2
    gu_flops = 2.0 * pairs * l * ir * mats
    dn_flops = 2.0 * pairs * ir * l
    floor_gu = max(gu_bytes / copy_bw, gu_flops / gemm_rate) * 1e6
    floor_dn = max(dn_bytes / copy_bw, dn_flops / gemm_rate) * 1e6
    floor_all = max((gu_bytes + dn_bytes) / copy_bw, (gu_flops + dn_flops) / gemm_rate) * 1e6
    modes = {}
    for name, body, floor in (("gate_up", gate_up, floor_gu), ("down", down, floor_dn), ("chain", chain, floor_all)):
        try:
            fn, mode = graph_or_eager(body)
            us = time_ms(fn) / NUM_LAYOUTS * 1e3
            modes[name] = mode
            result[name] = dict(time_us=us, floor_us=floor, fraction_of_floor=floor / us)
        except Exception as exc:  # noqa: BLE001
            result[name] = dict(error=f"{type(exc).__name__}: {exc}")
    result["timing"] = modes
    if "time_us" in result["gate_up"] and "time_us" in result["down"]:
        t = result["gate_up"]["time_us"] + result["down"]["time_us"]
        result["experts"] = dict(time_us=t, floor_us=floor_all)
        result["experts_fraction_of_floor"] = floor_all / t
    return result


def write_json(path, copy_bw, gemm_rate, rows):
    """Rewritten after every row, so that a run cut short still leaves its rows."""
    if not path:
        return
    with open(path, "w") as f:
        json.dump(dict(bench="torch_grouped_mm", torch=torch.__version__, device=torch.cuda.get_device_name(),
                       copy_bandwidth_tb_per_s=copy_bw / 1e12, gemm_bf16_tflop_per_s=gemm_rate / 1e12,
                       rows=rows), f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="kimi-k3,nemotron3-super")
    ap.add_argument("--tp-shards", default="8,1")
    ap.add_argument("--tokens", default="1,8,64,256,1024,4096")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    torch.manual_seed(0)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(1234)
    copy_bw, gemm_rate = ceilings()
    print(f"# torch {torch.__version__}  {torch.cuda.get_device_name()}  copy {copy_bw / 1e12:.3f} TB/s  "
          f"gemm {gemm_rate / 1e12:.1f} TFLOP/s")
    print(f"# {'preset':16s} {'tp':>3s} {'tokens':>6s} {'gu_us':>10s} {'down_us':>10s} {'chain_us':>10s} "
          f"{'floor_us':>10s} {'frac':>6s}")
    rows = []
    for preset_name in args.presets.split(","):
        p = PRESETS[preset_name]
        for tp in [int(t) for t in args.tp_shards.split(",")]:
            gated = p["act"] != "relu2"
            ir = p["intermediate"] // tp
            mats = 2 if gated else 1
            w_gu = torch.empty(p["experts"], mats * ir, p["latent"], dtype=torch.bfloat16, device="cuda")
            w_gu.uniform_(-2 / p["latent"] ** 0.5, 2 / p["latent"] ** 0.5)
            w_d = torch.empty(p["experts"], p["latent"], ir, dtype=torch.bfloat16, device="cuda")
            w_d.uniform_(-1 / ir**0.5, 1 / ir**0.5)
            for tokens in [int(t) for t in args.tokens.split(",")]:
                try:
                    r = run_row(preset_name, p, tp, tokens, (w_gu, w_d), copy_bw, gemm_rate, gen)
                except torch.OutOfMemoryError:
                    r = None
                if r is None:
                    # A row that does not fit this GPU (Kimi-K3's tp-shard 1 at 8192 tokens on 80 GB) is recorded
                    # as such, its tensors freed (outside the except block, whose traceback holds them), and the
                    # rows after it still run.
                    torch.cuda.empty_cache()
                    rows.append(dict(preset=preset_name, tp_shard=tp, tokens=tokens, error="out of GPU memory"))
                    write_json(args.json, copy_bw, gemm_rate, rows)
                    print(f"  {preset_name:16s} {tp:3d} {tokens:6d} skipped: out of GPU memory", flush=True)
                    continue
                rows.append(r)
                write_json(args.json, copy_bw, gemm_rate, rows)
                g = r["gate_up"].get("time_us", float("nan"))
                d = r["down"].get("time_us", float("nan"))
                c = r["chain"].get("time_us", float("nan"))
                fl = r.get("experts", {}).get("floor_us", float("nan"))
                print(f"  {preset_name:16s} {tp:3d} {tokens:6d} {g:10.2f} {d:10.2f} {c:10.2f} {fl:10.2f} "
                      f"{r.get('experts_fraction_of_floor', float('nan')):6.3f}", flush=True)
                torch.cuda.empty_cache()
            del w_gu, w_d
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Peer of `latentmoe bench tail`: the unfused tail written with torch.distributed (NCCL) and torch
ops, on real GPUs, one process per GPU:

    torchrun --nproc-per-node 8 bench/peers/torch_tail.py --json torch_tail_tp8.json [--commit C]

Per rank, for each preset and token count T: L_r [T, l] and S_r [T, d] (seeded random, different on
each rank), the replicated W_up [d, l] and the latent norm's weight; then
    unfused          all_reduce(L); L = rmsnorm(L) (kimi-k3 only: nemotron3-super has no latent norm);
                     out = L @ W_up^T; all_reduce(S); out += S      (the layer's native tail)
    ar_then_rmsnorm  all_reduce(L); rmsnorm(L)
    all_reduce       all_reduce of a [T, d] message
Timing as latentmoe's: before every run each rank restores its partials and flushes the L2 (reads a
buffer twice its size), all ranks meet (a barrier, then a device synchronise), CUDA events around the
work on the rank's stream; warm-ups first. The body runs as a CUDA graph captured once per measurement
(NCCL collectives included; --eager: the eager body; where capture fails, the eager body, said on a
line and in the row's "cuda_graph"), so the host's Python and c10d costs are not timed: an engine
replays graphs at decode. Like latentmoe's start gate, the GPUs, not the host threads, start each run
together (after the first): the stream sleeps ~1 ms (torch.cuda._sleep) while the host enqueues the
run, then an all-reduce of one element lines the GPUs up (they leave an NCCL collective within about a
microsecond of each other), then the start event; a row records the longest host enqueue
("host_enqueue_us_max"; "host_bound" if it reached the sleep, when the held GPU may have waited for
the host). On two H200s at b07d179 a 100 µs sleep and the eager body read 172 µs for the all-reduce
of 14 KB (kimi-k3, one token) and 800 µs for the unfused tail, most likely the host (not established).
time_us is the median over the runs of the slowest rank's time, time_us_per_rank each rank's median.
Rank 0 writes JSON rows of latentmoe's schema (paths
torch_unfused, torch_ar_then_rmsnorm, torch_all_reduce; placement "devices", backend "torch"), which
bench/plot_tail.py draws beside latentmoe's rows. It needs one GPU per rank (NCCL refuses two ranks on
one GPU), so it does not run on simulated ranks.
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist

PRESETS = {
    "kimi-k3": dict(d=7168, l=3584, norm=True),
    "nemotron3-super": dict(d=4096, l=1024, norm=False),
}
DEFAULT_TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096]
EPS = 1e-6


def rms_norm(x, gamma):
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + EPS) * gamma).to(x.dtype)


CLOCK_GHZ = 1.98  # the H200's SM clock
SLEEP_CYCLES = 2_000_000  # ~1 ms: far longer than the host takes to enqueue one run
SLEEP_US = SLEEP_CYCLES / (CLOCK_GHZ * 1e3)


def capture(prepare, body):
    """body() captured into a CUDA graph (NCCL collectives included), or None where capture fails."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # eager warm-up on a side stream, as torch asks before a capture
            prepare()
            body()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        torch.cuda.synchronize()
        return graph
    except Exception as error:  # noqa: BLE001 -- any capture failure: time the eager body instead
        print(f"CUDA graph capture failed ({error!r}); timing the eager body", flush=True)
        torch.cuda.synchronize()
        return None


def time_runs(prepare, body, warmup, iterations, flush, sink, graphs):
    """The runs' times in µs, whether they ran as a CUDA graph, and the longest host enqueue in µs."""
    graph = capture(prepare, body) if graphs else None
    run_body = graph.replay if graph is not None else body
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    align = torch.zeros(1, device="cuda")
    times = []
    enqueue_us = 0.0
    for run in range(warmup + iterations):
        sink += flush.sum(dtype=torch.int64)  # read the flush buffer through the L2
        prepare()
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda.synchronize()
        if run > 0:  # the first run as latentmoe's: not held
            torch.cuda._sleep(SLEEP_CYCLES)
            dist.all_reduce(align)
        enqueue_start = time.perf_counter()
        start.record()
        run_body()
        stop.record()
        if run > 0:
            enqueue_us = max(enqueue_us, (time.perf_counter() - enqueue_start) * 1e6)
        stop.synchronize()
        if run >= warmup:
            times.append(start.elapsed_time(stop) * 1000.0)
    return times, graph is not None, enqueue_us


def upper_median(values):
    return sorted(values)[len(values) // 2]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="kimi-k3,nemotron3-super")
    parser.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--commit", default="")
    parser.add_argument("--json", default="")
    parser.add_argument("--eager", action="store_true", help="time the eager body (default: a CUDA graph of it)")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, tp = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    dtype = torch.bfloat16
    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
    flush = torch.ones(max(2 * l2_bytes, 64 << 20) // 4, dtype=torch.int32, device=device)
    sink = torch.zeros((), dtype=torch.int64, device=device)
    tokens_list = [int(t) for t in args.tokens.split(",")]
    rows = []
    for preset in args.preset.split(","):
        p = PRESETS[preset]
        d, l = p["d"], p["l"]
        max_t = max(tokens_list)
        g = torch.Generator(device=device).manual_seed(2026 + 1000 * rank)
        shared_g = torch.Generator(device=device).manual_seed(2026)
        w_up = (torch.rand(d, l, device=device, generator=shared_g) * 2 - 1).mul_(l ** -0.5).to(dtype)
        gamma = 1.0 + 0.25 * (torch.rand(l, device=device, generator=shared_g) * 2 - 1)
        latent_snapshot = (torch.rand(max_t, l, device=device, generator=g) * 2 - 1).to(dtype)
        shared_snapshot = (torch.rand(max_t, d, device=device, generator=g) * 2 - 1).to(dtype)
        latent_all = torch.empty_like(latent_snapshot)
        shared_all = torch.empty_like(shared_snapshot)
        for tokens in tokens_list:
            latent, shared = latent_all[:tokens], shared_all[:tokens]

            def restore_both():
                latent.copy_(latent_snapshot[:tokens])
                shared.copy_(shared_snapshot[:tokens])

            def unfused():
                dist.all_reduce(latent)
                up_in = rms_norm(latent, gamma) if p["norm"] else latent
                out = up_in @ w_up.t()
                dist.all_reduce(shared)
                out += shared

            def ar_then_rmsnorm():
                dist.all_reduce(latent)
                rms_norm(latent, gamma)

            measurements = (
                ("torch_unfused", "unfused", restore_both, unfused, 0),
                ("torch_ar_then_rmsnorm", "collective", restore_both, ar_then_rmsnorm, tokens * l * 2),
                ("torch_all_reduce", "collective", restore_both, lambda: dist.all_reduce(shared), tokens * d * 2),
            )
            for path, kind, prepare, body, message_bytes in measurements:
                mine, graphed, enqueue_us = time_runs(prepare, body, args.warmup, args.iterations, flush, sink,
                                                      not args.eager)
                everyone = [None] * tp
                dist.all_gather_object(everyone, (mine, graphed, enqueue_us))
                graphed = all(e[1] for e in everyone)
                enqueue_us = max(e[2] for e in everyone)
                everyone = [e[0] for e in everyone]
                if rank == 0:
                    slowest = [max(run) for run in zip(*everyone)]
                    row = dict(preset=preset, scale=1, tp=tp, tokens=tokens, dtype="bf16", hidden_size=d,
                               latent_size=l, placement="devices", collectives="nccl", backend="torch",
                               device=torch.cuda.get_device_name(device), commit=args.commit, path=path,
                               kind=kind, ran=True, time_us=upper_median(slowest),
                               time_us_per_rank=[upper_median(times) for times in everyone])
                    if message_bytes:
                        row["message_bytes"] = message_bytes
                    # How the body ran, and whether the held GPU could have waited for the host.
                    row["cuda_graph"] = graphed
                    row["host_enqueue_us_max"] = enqueue_us
                    row["host_bound"] = enqueue_us >= SLEEP_US
                    rows.append(row)
                    print(f"{preset:16s} tp {tp} T {tokens:5d} {path:22s} {row['time_us']:10.1f} us", flush=True)
    if rank == 0 and args.json:
        document = dict(format="latentmoe-bench-tail-1", commit=args.commit, backend="torch", placement="devices",
                        device=torch.cuda.get_device_name(device), torch=torch.__version__,
                        nccl=".".join(map(str, torch.cuda.nccl.version())),
                        runs=dict(warmup=args.warmup, iterations=args.iterations, flush=True), rows=rows)
        with open(args.json, "w") as f:
            json.dump(document, f, indent=2)
            f.write("\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

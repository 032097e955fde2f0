#!/usr/bin/env python3
"""Host time per eager call of latentmoe's torch custom ops, beside plain torch ops (docs/PYTHON.md, "Host
cost per call").

Each call is timed alone (time.perf_counter_ns around it; median over the calls after a warm-up). On a GPU
the device work only queues, so this is the host's share; the device is synchronised every 32 calls,
outside the timings, so that the launch queue never fills. Rows:

  torch.add                  a plain aten op on tiny tensors (the dispatcher's floor)
  empty custom op            a torch.library.custom_op with the layer op's schema that only allocates its
                             three outputs (torch.library's and the Python impl's own cost)
  layer op, T=0              torch.ops.latentmoe.layer_forward with no token: the binding alone (argument
                             checks, output allocation, descriptors, ctypes, the library's validation)
  C ABI call, T=0            lmoe_layer_forward through ctypes with prebuilt descriptors
  layer op, T=1              one token of a tiny layer (CPU: includes its arithmetic; GPU: the launches)
  tail op, T=0 / T=1         torch.ops.latentmoe.tail_forward likewise

  python3 bench/python/host_cost.py [--device cpu|cuda:0] [--calls 4000] [--json out.json]
"""

import argparse
import json
import platform
import statistics
import time

import torch

import latentmoe
from latentmoe import _lib

CONFIG = {
    "hidden_size": 64,
    "moe_latent_size": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
    "hidden_act": "silu",
}


def tiny_weights(dtype):
    g = torch.Generator().manual_seed(0)
    d, l, e, i, s = 64, 32, 8, 32, 64
    r = lambda *shape: (torch.rand(shape, generator=g) - 0.5).to(dtype)  # noqa: E731
    w = {
        "routed_expert_down_proj.weight": r(l, d),
        "routed_expert_up_proj.weight": r(d, l),
        "shared_experts.gate_proj.weight": r(s, d),
        "shared_experts.up_proj.weight": r(s, d),
        "shared_experts.down_proj.weight": r(d, s),
    }
    for x in range(e):
        w[f"experts.{x}.gate_proj.weight"] = r(i, l)
        w[f"experts.{x}.up_proj.weight"] = r(i, l)
        w[f"experts.{x}.down_proj.weight"] = r(l, i)
    return w


@torch.library.custom_op("latentmoe_bench::empty_layer", mutates_args=(),
                         schema="(Tensor hidden_states, Tensor? router_logits, Tensor? latent_states, int handle, int tier) -> (Tensor, Tensor, Tensor)")
def empty_layer(hidden_states, router_logits, latent_states, handle, tier):
    tokens = hidden_states.shape[0]
    return (torch.empty((tokens, 64), dtype=hidden_states.dtype, device=hidden_states.device),
            torch.empty((tokens, 2), dtype=torch.int32, device=hidden_states.device),
            torch.empty((tokens, 2), dtype=torch.float32, device=hidden_states.device))


def per_call_us(fn, calls, device):
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(min(200, calls)):
        fn()
    sync()
    times = []
    for call in range(calls):
        start = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - start)
        if call % 32 == 31:
            sync()
    sync()
    return statistics.median(times) / 1000.0


def measure(device, calls):
    """The rows above for `device` (a torch.device), printed as they come."""
    torch.set_num_threads(1)
    dtype = torch.bfloat16
    ctx = latentmoe.RankContext(device, max_tokens=8)
    layer = latentmoe.LatentMoE(CONFIG, tiny_weights(dtype), ctx)
    tail = latentmoe.LatentTail(None, tiny_weights(dtype)["routed_expert_up_proj.weight"], ctx)
    rows = []

    def row(name, fn):
        us = per_call_us(fn, calls, device)
        rows.append({"row": name, "host_us_per_call": us})
        print(f"  {name:28} {us:8.2f} us", flush=True)

    a = torch.ones(4, device=device)
    for tokens in (0, 1):
        x = torch.zeros((tokens, 64), dtype=dtype, device=device)
        logits = torch.randn((tokens, 8), device=device)
        s = torch.zeros((tokens, 64), dtype=dtype, device=device)
        lat = torch.zeros((tokens, 32), dtype=dtype, device=device)
        if tokens == 0:
            row("torch.add", lambda: torch.add(a, a))
            row("empty custom op", lambda: torch.ops.latentmoe_bench.empty_layer(x, logits, None, 0, -1))
            out = torch.empty((0, 64), dtype=dtype, device=device)
            ids = torch.empty((0, 2), dtype=torch.int32, device=device)
            weights = torch.empty((0, 2), dtype=torch.float32, device=device)
            descs = [_lib.describe(t, "t") for t in (x, logits, out, ids, weights)]
            stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
            handle = layer.handle
            forward = _lib.lib.lmoe_layer_forward
            row("C ABI call, T=0",
                lambda: forward(handle, descs[0], descs[1], None, descs[2], descs[3], descs[4], -1, stream, None))
        row(f"layer op, T={tokens}", lambda: layer(x, logits))
        row(f"tail op, T={tokens}", lambda: tail(s, lat))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--calls", type=int, default=4000)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    device = torch.device(args.device)
    rows = measure(device, args.calls)
    report = {
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "latentmoe": latentmoe.__version__,
        "calls": args.calls,
        "rows": rows,
    }
    if args.json:
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump(report, file, indent=2)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Peer: one rank's latent-MoE layer written the way a PyTorch eager model writes it.

Same rows as `latentmoe bench layer` (preset, tp_shard, tokens): routing (sigmoid + bias, top-k,
renormalise, scale), the latent down-projection, the routed experts (a loop over the touched
experts, as Hugging Face MoE blocks do), the shared expert, the latent RMSNorm and the
up-projection. Weights are seeded random bf16 on the GPU; the L2 is flushed (read) before every timed run;
times are medians of CUDA-event timings after warm-up. Writes JSON with --json.
"""
import argparse
import json
import math

import torch

PRESETS = {
    "kimi-k3": dict(d=7168, l=3584, E=896, k=16, I=3072, Is=6144, act="situ", norm=True, scale=1.0),
    "nemotron3-super": dict(d=4096, l=1024, E=512, k=22, I=2688, Is=5376, act="relu2", norm=False, scale=5.0),
}


def activation(kind, g, u):
    if kind == "situ":
        b1, b2 = 4.0, 25.0
        return (b1 * torch.tanh(g / b1) * torch.sigmoid(g)) * (b2 * torch.tanh(u / b2))
    if kind == "silu":
        return torch.nn.functional.silu(g) * u
    return torch.relu(u).square()


class Layer:
    def __init__(self, preset, tp_shard, device, dtype, seed):
        p = PRESETS[preset]
        self.p = p
        g = torch.Generator(device=device).manual_seed(seed)
        d, l, E, I, Is = p["d"], p["l"], p["E"], p["I"] // tp_shard, p["Is"] // tp_shard
        gated = p["act"] != "relu2"

        def rand(*shape, fan_in):
            t = torch.empty(*shape, device=device, dtype=dtype)
            t.uniform_(-1.0, 1.0, generator=g)
            return t.mul_(1.0 / math.sqrt(fan_in))

        self.w_down = rand(l, d, fan_in=d)
        self.w_up = rand(d, l, fan_in=l)
        self.gamma = torch.ones(l, device=device, dtype=torch.float32)
        # Small, so each token's experts stay close to uniformly random (as in latentmoe bench layer).
        self.bias = torch.zeros(E, device=device, dtype=torch.float32).uniform_(-1e-3, 1e-3, generator=g)
        self.w_gate = rand(E, I, l, fan_in=l) if gated else None
        self.w_up_e = rand(E, I, l, fan_in=l)
        self.w_down_e = rand(E, l, I, fan_in=I)
        self.s_gate = rand(Is, d, fan_in=d) if gated else None
        self.s_up = rand(Is, d, fan_in=d)
        self.s_down = rand(d, Is, fan_in=Is)

    def forward(self, x, logits):
        p = self.p
        scores = torch.sigmoid(logits)
        _, ids = torch.topk(scores + self.bias, p["k"], dim=-1)
        weights = scores.gather(1, ids)
        weights = weights / weights.sum(-1, keepdim=True) * p["scale"]
        z = x @ self.w_down.t()
        latent = torch.zeros_like(z)
        flat_ids = ids.flatten()
        order = torch.argsort(flat_ids)
        counts = torch.bincount(flat_ids, minlength=p["E"]).tolist()  # host sync, as eager code does
        tokens = order // p["k"]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = tokens[start:start + n]
            slots = order[start:start + n]
            start += n
            u = z[rows]
            up = u @ self.w_up_e[e].t()
            gate = u @ self.w_gate[e].t() if self.w_gate is not None else None
            a = activation(p["act"], gate, up)
            y = a @ self.w_down_e[e].t()
            latent.index_add_(0, rows, y * weights.flatten()[slots, None].to(y.dtype))
        if p["norm"]:
            v = latent.float()
            latent = (v * torch.rsqrt(v.square().mean(-1, keepdim=True) + 1e-5) * self.gamma).to(x.dtype)
        out = latent @ self.w_up.t()
        sg = x @ self.s_gate.t() if self.s_gate is not None else None
        shared = activation(p["act"], sg, x @ self.s_up.t()) @ self.s_down.t()
        return out + shared


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="kimi-k3,nemotron3-super")
    parser.add_argument("--tp-shard", default="8,1")
    parser.add_argument("--tokens", default="1,8,64,256,1024,4096")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    device = torch.device("cuda")
    # The L2 is flushed by reading a buffer twice its size, as latentmoe's bench does (a fill would leave
    # dirty lines whose write-back the timed layer would pay for).
    flush = torch.zeros(2 * torch.cuda.get_device_properties(0).L2_cache_size // 4, dtype=torch.int32, device=device)
    rows = []
    print(f"# torch {torch.__version__} eager layer on {torch.cuda.get_device_name(0)}; medians, L2 flushed")
    print(f"# {'preset':16} {'tp':>3} {'tokens':>6} {'total_us':>10}")
    for preset in args.preset.split(","):
        for tp_shard in map(int, args.tp_shard.split(",")):
            layer = Layer(preset, tp_shard, device, torch.bfloat16, seed=2026)
            p = PRESETS[preset]
            for tokens in map(int, args.tokens.split(",")):
                x = torch.empty(tokens, p["d"], device=device, dtype=torch.bfloat16).uniform_(-1, 1)
                logits = torch.empty(tokens, p["E"], device=device).uniform_(-2, 2)
                times = []
                for run in range(args.warmup + args.iterations):
                    flush.sum()
                    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    layer.forward(x, logits)
                    stop.record()
                    stop.synchronize()
                    if run >= args.warmup:
                        times.append(1000.0 * start.elapsed_time(stop))
                times.sort()
                median = times[len(times) // 2]
                print(f"  {preset:16} {tp_shard:>3} {tokens:>6} {median:>10.1f}")
                rows.append(dict(preset=preset, tp_shard=tp_shard, tokens=tokens, peer="torch_eager_layer",
                                 total_time_us=median))
            del layer
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(0), torch=torch.__version__, rows=rows), f, indent=2)


if __name__ == "__main__":
    main()

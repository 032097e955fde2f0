#!/usr/bin/env python3
"""An engine's latent-MoE block on latentmoe: the reference runner's interface (vLLM's LatentMoERunner:
forward(hidden_states, router_logits, input_ids=None, shared_experts_input=None) -> output, the shared expert
included, the fused tail chosen by token count) as a torch.nn.Module over latentmoe.LatentMoE.

Runs a scaled-down Kimi-K3-like layer (seeded random weights, the same on every rank) at a few token counts,
checks that every rank holds the same output and that it matches the same layer written in plain PyTorch
(the reference's native path), and prints one line per call.

    torchrun --nproc-per-node N examples/engine_layer.py            # N GPUs, one process each (NCCL)
    python3 examples/engine_layer.py --simulated N [--device cuda]  # N ranks simulated on one GPU
    python3 examples/engine_layer.py --simulated N --device cpu     # N ranks as threads on the CPU

With torchrun, NCCL_NVLS_ENABLE=0 must be in the environment (latentmoe keeps NVLink multicast off).
"""

import argparse
import concurrent.futures
import math
import os

import torch

import latentmoe


class LatentMoERunner(torch.nn.Module):
    """The reference runner's interface on latentmoe. `weights`: the layer's full (tp 1) tensors under the
    checkpoint names; the rank context `ctx` decides which shard this rank holds."""

    def __init__(self, config, weights, ctx, tier="auto"):
        super().__init__()
        self.moe = latentmoe.LatentMoE(config, weights, ctx)
        self.tier = tier

    def forward(self, hidden_states, router_logits, input_ids=None, shared_experts_input=None):
        # As the reference: a caller that pre-applied the routed input transform passes the latent as
        # hidden_states and the original hidden states as shared_experts_input.
        if shared_experts_input is not None:
            out, _, _ = self.moe(shared_experts_input, router_logits, latent_states=hidden_states, tier=self.tier)
        else:
            out, _, _ = self.moe(hidden_states, router_logits, tier=self.tier)
        return out


# --- the model and the plain PyTorch twin ----------------------------------------------------------------

CONFIG = {
    "hidden_size": 256,
    "moe_latent_size": 128,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 128,
    "n_shared_experts": 1,
    "shared_expert_intermediate_size": 256,
    "hidden_act": "situ",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "latent_moe_use_norm": True,
    "rms_norm_eps": 1e-5,
}


def make_weights(config, dtype, seed=2026):
    """Full weights under the checkpoint names of DESIGN section 3, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    d, l = config["hidden_size"], config["moe_latent_size"]
    e, i, s = config["n_routed_experts"], config["moe_intermediate_size"], config["shared_expert_intermediate_size"]

    def rand(*shape, fan_in, out_dtype=dtype):
        return ((torch.rand(shape, generator=g) * 2 - 1) / math.sqrt(fan_in)).to(out_dtype)

    w = {
        "gate.weight": rand(e, d, fan_in=d, out_dtype=torch.float32),
        "gate.e_score_correction_bias": (torch.rand(e, generator=g) * 1e-3),
        "routed_expert_down_proj.weight": rand(l, d, fan_in=d),
        "routed_expert_norm.weight": 1 + 0.1 * torch.rand(l, generator=g),
        "routed_expert_up_proj.weight": rand(d, l, fan_in=l),
        "shared_experts.gate_proj.weight": rand(s, d, fan_in=d),
        "shared_experts.up_proj.weight": rand(s, d, fan_in=d),
        "shared_experts.down_proj.weight": rand(d, s, fan_in=s),
    }
    for expert in range(e):
        w[f"experts.{expert}.gate_proj.weight"] = rand(i, l, fan_in=l)
        w[f"experts.{expert}.up_proj.weight"] = rand(i, l, fan_in=l)
        w[f"experts.{expert}.down_proj.weight"] = rand(l, i, fan_in=i)
    return w


def situ(g, u):
    return (4.0 * torch.tanh(g / 4.0) * torch.sigmoid(g)) * (25.0 * torch.tanh(u / 25.0))


def torch_layer(config, w, x, logits):
    """The same layer in plain PyTorch, float32 (the reference runner's native path on one device)."""
    x = x.float()
    scores = torch.sigmoid(logits.float())
    _, ids = torch.topk(scores + w["gate.e_score_correction_bias"], config["num_experts_per_tok"], dim=-1)
    weights = scores.gather(1, ids)
    weights = weights / weights.sum(-1, keepdim=True) * config["routed_scaling_factor"]
    z = x @ w["routed_expert_down_proj.weight"].float().T
    latent = torch.zeros_like(z)
    for expert in range(config["n_routed_experts"]):
        tokens, slots = (ids == expert).nonzero(as_tuple=True)
        if tokens.numel():
            u = z[tokens]
            a = situ(u @ w[f"experts.{expert}.gate_proj.weight"].float().T, u @ w[f"experts.{expert}.up_proj.weight"].float().T)
            latent.index_add_(0, tokens, weights[tokens, slots, None] * (a @ w[f"experts.{expert}.down_proj.weight"].float().T))
    latent = latent * torch.rsqrt(latent.square().mean(-1, keepdim=True) + config["rms_norm_eps"]) * w["routed_expert_norm.weight"]
    shared = situ(x @ w["shared_experts.gate_proj.weight"].float().T, x @ w["shared_experts.up_proj.weight"].float().T)
    return latent @ w["routed_expert_up_proj.weight"].float().T + shared @ w["shared_experts.down_proj.weight"].float().T


# --- running --------------------------------------------------------------------------------------------

TOKENS = (1, 8, 64, 200)


def inputs(tokens, dtype, device):
    g = torch.Generator().manual_seed(tokens)
    x = (torch.rand((tokens, CONFIG["hidden_size"]), generator=g) * 2 - 1).to(dtype)
    logits = torch.randn((tokens, CONFIG["n_routed_experts"]), generator=g) * 2
    return x.to(device), logits.to(device)


def rank_loop(runner, ctx, dtype, device, weights, report):
    outputs = []
    for tokens in TOKENS:
        x, logits = inputs(tokens, dtype, device)
        out = runner(x, logits)
        expected = torch_layer(CONFIG, weights, x.cpu(), logits.cpu())
        error = ((out.cpu().float() - expected).abs().max() / expected.abs().max()).item()
        report(ctx, tokens, runner.moe.select_tier(tokens), error)
        # latentmoe stores activations in the compute dtype; the PyTorch twin rounds nothing.
        limit = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}[dtype]
        assert error <= limit, f"rank {ctx.rank}: T={tokens} differs from the PyTorch layer by {error:.2e} (> {limit})"
        outputs.append(out.cpu())
    return outputs


def print_line(ctx, tokens, tier, error):
    print(f"rank {ctx.rank}/{ctx.tp} T={tokens:<4} tier={tier:<18} max|out - torch| / max|torch| = {error:.2e}", flush=True)


def simulated(args, dtype):
    device = torch.device(args.device)
    contexts = latentmoe.simulated_group(args.simulated, device, max_tokens=max(TOKENS))
    weights = make_weights(CONFIG, dtype)
    runners = [LatentMoERunner(CONFIG, weights, ctx) for ctx in contexts]
    streams = [torch.cuda.Stream(device) for _ in contexts] if device.type == "cuda" else [None] * len(contexts)

    def rank(r):
        if streams[r] is None:
            return rank_loop(runners[r], contexts[r], dtype, device, weights, print_line)
        with torch.cuda.stream(streams[r]):  # simulated ranks each need a stream of their own
            return rank_loop(runners[r], contexts[r], dtype, device, weights, print_line)

    with concurrent.futures.ThreadPoolExecutor(len(contexts)) as pool:
        futures = [pool.submit(rank, r) for r in range(len(contexts))]
        try:
            results = [f.result() for f in futures]
        except BaseException:
            for ctx in contexts:
                ctx.abort()
            raise
    for per_rank in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(per_rank, results[0])), "ranks differ"
    print(f"engine_layer: {len(contexts)} simulated ranks on {device}: every rank holds the same output")


def distributed(dtype):
    import torch.distributed as dist

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=device)
    ctx = latentmoe.RankContext(device, max_tokens=max(TOKENS), group=dist.group.WORLD)
    weights = make_weights(CONFIG, dtype)
    runner = LatentMoERunner(CONFIG, weights, ctx)
    outputs = rank_loop(runner, ctx, dtype, device, weights, print_line)
    for out in outputs:
        gathered = [torch.empty_like(out.to(device)) for _ in range(ctx.tp)]
        dist.all_gather(gathered, out.to(device))
        assert all(torch.equal(g, gathered[0]) for g in gathered), "ranks differ"
    torch.cuda.synchronize()
    ctx.check()
    if ctx.rank == 0:
        print(f"engine_layer: {ctx.tp} processes over NCCL: every rank holds the same output")
    del runner, ctx
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--simulated", type=int, default=0, help="run N ranks in this process (threads)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bf16", choices=["f32", "bf16", "f16"])
    args = parser.parse_args()
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[args.dtype]
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1 and not args.simulated:
        if torch.device(args.device).type != "cuda":
            parser.error("one process per rank runs on GPUs (NCCL); on the CPU run the ranks as threads: --simulated N")
        distributed(dtype)
    else:
        args.simulated = args.simulated or 1
        simulated(args, dtype)


if __name__ == "__main__":
    main()

"""One rank of test_gpu.py's torchrun test (not collected by pytest): every process builds its RankContext
over the torch.distributed NCCL group (latentmoe's own NCCL communicator from an id broadcast over it), the
same layer from the same seeded full weights, and runs every tier and the tail; all ranks must hold the
same bits and agree with the float64 reference. Prints "distributed_worker: OK" on success."""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

import latentmoe  # noqa: E402
import reference  # noqa: E402
from conftest import FAMILIES, make_inputs, make_weights, uniform  # noqa: E402


def gather_equal(tensor):
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor.contiguous())
    return all(torch.equal(g, gathered[0]) for g in gathered)


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    device = f"cuda:{local_rank}"
    tp = dist.get_world_size()
    ctx = latentmoe.RankContext(device, max_tokens=64, group=dist.group.WORLD)
    assert (ctx.tp, ctx.rank) == (tp, dist.get_rank()), (ctx.tp, ctx.rank)
    dtype = torch.bfloat16
    config = FAMILIES["kimi"]()
    named, roles = make_weights(config, dtype, seed=77)
    layer = latentmoe.LatentMoE(config, named, ctx)
    g = torch.Generator().manual_seed(5)
    norm, up = uniform((24,), g, 0.2, 1.0).float(), uniform((40, 24), g, 0.2).to(dtype)
    tail = latentmoe.LatentTail(norm, up, ctx)
    normalized = latentmoe.normalize_config(config)
    for tokens in (1, 9, 64):
        cpu_x, cpu_logits = make_inputs(config, tokens, dtype, seed=tokens)
        x, logits = cpu_x.to(device), cpu_logits.to(device)
        ref = reference.layer(normalized, roles, cpu_x, cpu_logits)[0]
        # Each rank's own partials for the tail.
        pg = torch.Generator().manual_seed(1000 * tokens + ctx.rank)
        shared, latent = uniform((tokens, 40), pg).to(dtype), uniform((tokens, 24), pg).to(dtype)
        all_shared = [torch.empty_like(shared.to(device)) for _ in range(tp)]
        all_latent = [torch.empty_like(latent.to(device)) for _ in range(tp)]
        dist.all_gather(all_shared, shared.to(device))
        dist.all_gather(all_latent, latent.to(device))
        for tier in ("native", "tail_fusion", "allreduce_overlap", "column_parallel", "auto"):
            out, ids, _ = layer(x, logits, tier=tier)
            assert gather_equal(out) and gather_equal(ids), f"ranks differ: {tier} T={tokens}"
            error = reference.relative_error(out.cpu(), ref)
            assert error <= reference.tolerance(dtype), f"layer {tier} T={tokens}: {error}"
            tail_out = tail(shared.to(device), latent.to(device), tier=tier)
            assert gather_equal(tail_out), f"tail ranks differ: {tier}"
            tail_ref = reference.tail_native([s.cpu().double() for s in all_shared], [l.cpu().double() for l in all_latent],
                                             norm.double(), up.double(), 1e-5)
            assert reference.relative_error(tail_out.cpu(), tail_ref) <= reference.tolerance(dtype)
    # One graph per process, replayed with new inputs.
    x, logits = [t.to(device) for t in make_inputs(config, 9, dtype, seed=1)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layer(x, logits)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = layer(x, logits)[0]
    for seed in range(20):
        new_x, new_logits = make_inputs(config, 9, dtype, seed=100 + seed)
        x.copy_(new_x)
        logits.copy_(new_logits)
        graph.replay()
        assert torch.equal(captured, layer(x, logits)[0]), f"replay {seed}"
    torch.cuda.synchronize()
    ctx.check()
    dist.barrier()
    del layer, tail, ctx
    dist.destroy_process_group()
    print("distributed_worker: OK", flush=True)


if __name__ == "__main__":
    main()

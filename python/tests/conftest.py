"""Shared fixtures of the latentmoe package tests: small configs of both model families with odd shapes,
seeded full (tp 1) weights under the checkpoint names (dense and MXFP4), the ranks of a simulated group
driven by threads, poisoned op outputs, a minimal safetensors writer."""

import concurrent.futures
import json
import math
import os
import struct

import pytest
import torch

import latentmoe
import reference

# The tests' tensors are tiny: torch's intra-op thread pool only adds its start-up and spin-waits (on a
# 2-core CI machine, 40 ms per index_add_), while the ranks themselves run on threads of their own.
torch.set_num_threads(1)

CUDA = torch.cuda.is_available() and latentmoe.build_info()["cuda"]
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA build of latentmoe and a GPU")

MXFP4_QUANTIZATION = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "format": "mxfp4-pack-quantized",
            "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32},
            "input_activations": None,
        }
    },
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*"],
}


def kimi_like():
    """Kimi-K3-like: situ, latent norm, biased sigmoid routing in groups, a shared expert. Every size
    divisible by 8 (tp 1/2/4/8) but odd per rank (I/8 = 3, Is/8 = 5). Primary key names."""
    return {
        "hidden_size": 40,
        "moe_latent_size": 24,
        "n_routed_experts": 12,
        "num_experts_per_tok": 3,
        "moe_intermediate_size": 24,
        "n_shared_experts": 1,
        "shared_expert_intermediate_size": 40,
        "hidden_act": "situ",
        "scoring_func": "sigmoid",
        "n_group": 4,
        "topk_group": 2,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "latent_moe_use_norm": True,
        "rms_norm_eps": 1e-5,
        "unrelated_key_of_a_whole_hf_config": [1, 2, 3],
    }


def nemotron_like():
    """Nemotron-3-like through the aliases: relu2, no latent norm, softmax scores, scaling 5, two zero
    experts, a shared expert given by its width only."""
    return {
        "hidden_size": 48,
        "routed_expert_hidden_size": 16,
        "num_experts": 10,
        "num_experts_per_token": 4,
        "moe_intermediate_size": 56,
        "moe_shared_expert_intermediate_size": 72,
        "hidden_act": "relu2",
        "scoring_func": "softmax",
        "moe_renormalize": True,
        "routed_scaling_factor": 5.0,
        "zero_expert_num": 2,
    }


def silu_like():
    """silu experts, no shared expert (so only the native tail runs), no renormalisation."""
    return {
        "hidden_size": 32,
        "moe_latent_size": 16,
        "n_routed_experts": 6,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 24,
        "hidden_act": "silu",
        "norm_topk_prob": False,
    }


def mxfp4_like():
    """Kimi-K3-like with MXFP4 experts: l and I/8 multiples of 32."""
    config = kimi_like()
    config.update({"moe_latent_size": 64, "moe_intermediate_size": 256, "n_routed_experts": 6, "n_group": 1,
                   "topk_group": 1, "quantization_config": MXFP4_QUANTIZATION})
    return config


FAMILIES = {"kimi": kimi_like, "nemotron": nemotron_like, "silu": silu_like, "mxfp4": mxfp4_like}


def uniform(shape, generator, scale=1.0, offset=0.0):
    return (torch.rand(shape, generator=generator, dtype=torch.float64) * 2 - 1) * scale + offset


def make_weights(config, dtype, seed, with_gate=True, bias=True):
    """Full (tp 1) weights: ({checkpoint name: tensor in `dtype`}, {role: float64 values as stored}).

    Matrices ~ U(-1, 1)/sqrt(fan_in); router gate, correction bias and latent gamma in float32; MXFP4
    experts as random E2M1 codes with E8M0 scales around 1/sqrt(fan_in)."""
    c = latentmoe.normalize_config(config)
    g = torch.Generator().manual_seed(seed)
    d, l, e = c["hidden_size"], c["moe_latent_size"], c["n_routed_experts"]
    inter, shared = c["moe_intermediate_size"], c["shared_expert_intermediate_size"]
    outputs = e + c["zero_expert_num"]
    gated = c["hidden_act"] != "relu2"
    mxfp4 = "quantization_config" in c
    named, roles = {}, {}

    def add(name, role, values, tensor_dtype=dtype):
        tensor = values.to(tensor_dtype)
        named[name] = tensor
        if role is not None:
            roles[role] = tensor.to(torch.float64)
        return tensor

    if with_gate:
        add("gate.weight", "gate", uniform((outputs, d), g, 1 / math.sqrt(d)), torch.float32)
    if bias:
        add("gate.e_score_correction_bias", "score_bias", uniform((outputs,), g, 0.1, 1.0), torch.float32)
    add("routed_expert_down_proj.weight", "down_proj", uniform((l, d), g, 1 / math.sqrt(d)))
    if c["latent_moe_use_norm"]:
        add("routed_expert_norm.weight", "latent_norm", uniform((l,), g, 0.25, 1.0), torch.float32)
    add("routed_expert_up_proj.weight", "up_proj", uniform((d, l), g, 1 / math.sqrt(l)))
    for role in ("experts_gate", "experts_up", "experts_down"):
        roles[role] = []
    projections = ([("gate_proj", "w1", "experts_gate", inter, l)] if gated else []) + [
        ("up_proj", "w3", "experts_up", inter, l),
        ("down_proj", "w2", "experts_down", l, inter),
    ]
    for expert in range(e):
        for dense_name, mxfp4_name, role, rows, cols in projections:
            if mxfp4:
                codes = torch.randint(0, 16, (rows, cols), generator=g)
                base = 124 - (int(cols).bit_length() - 1) // 2
                scales = (base + torch.randint(-1, 2, (rows, cols // 32), generator=g)).to(torch.uint8)
                packed = reference.pack_mxfp4(codes)
                named[f"experts.{expert}.{mxfp4_name}.weight_packed"] = packed
                named[f"experts.{expert}.{mxfp4_name}.weight_scale"] = scales
                roles[role].append(reference.decode_mxfp4(packed, scales))
            else:
                tensor = uniform((rows, cols), g, 1 / math.sqrt(cols)).to(dtype)
                named[f"experts.{expert}.{dense_name}.weight"] = tensor
                roles[role].append(tensor.to(torch.float64))
    if shared > 0:
        if gated:
            add("shared_experts.gate_proj.weight", "shared_gate", uniform((shared, d), g, 1 / math.sqrt(d)))
        add("shared_experts.up_proj.weight", "shared_up", uniform((shared, d), g, 1 / math.sqrt(d)))
        add("shared_experts.down_proj.weight", "shared_down", uniform((d, shared), g, 1 / math.sqrt(shared)))
    return named, roles


def make_inputs(config, tokens, dtype, seed, logits=True):
    c = latentmoe.normalize_config(config)
    g = torch.Generator().manual_seed(seed)
    x = uniform((tokens, c["hidden_size"]), g).to(dtype)
    router = uniform((tokens, c["n_routed_experts"] + c["zero_expert_num"]), g, 3.0).to(torch.float32) if logits else None
    return x, router


def run_ranks(contexts, body):
    """body(rank, ctx) for every rank, each on its own thread (the ranks' collectives wait for one
    another); the first failure aborts the group and is raised here."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(contexts)) as pool:
        futures = [pool.submit(body, rank, ctx) for rank, ctx in enumerate(contexts)]
        error = None
        for future in futures:
            try:
                future.exception() if error is not None else future.result()
            except BaseException as caught:  # noqa: BLE001 - the first failure is reraised below
                error = caught
                for ctx in contexts:
                    ctx.abort()
        if error is not None:
            raise error
        return [future.result() for future in futures]


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Every torch.empty (the ops' output allocations among them) comes back poisoned (NaN, or -1 for
    integers), so an element the library fails to write shows up in the comparison."""
    original = torch.empty

    def poisoned(*args, **kwargs):
        tensor = original(*args, **kwargs)
        if tensor.is_floating_point():
            tensor.fill_(float("nan"))
        else:
            tensor.fill_(-1)
        return tensor

    monkeypatch.setattr(torch, "empty", poisoned)
    return original


def write_safetensors(path, tensors, metadata=None):
    """A safetensors file (8-byte little-endian header length, JSON header, data), written here so that the
    tests need no package beyond torch."""
    names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.uint8: "U8", torch.int32: "I32",
             torch.float64: "F64"}
    header, chunks, offset = {}, [], 0
    for name, tensor in tensors.items():
        data = tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        header[name] = {"dtype": names[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(text)))
        file.write(text)
        for chunk in chunks:
            file.write(chunk)


def save_checkpoint(folder, named, config, prefix, shards=1):
    """config.json and the weights under `prefix`: one model.safetensors, or `shards` files and an index."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as file:
        json.dump(config, file)
    prefixed = {prefix + name: tensor for name, tensor in named.items()}
    if shards == 1:
        write_safetensors(os.path.join(folder, "model.safetensors"), prefixed)
        return os.path.join(folder, "model.safetensors")
    names = sorted(prefixed)
    weight_map = {}
    for shard in range(shards):
        file_name = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: prefixed[name] for name in names[shard::shards]}
        write_safetensors(os.path.join(folder, file_name), part)
        weight_map.update({name: file_name for name in part})
    index = os.path.join(folder, "model.safetensors.index.json")
    with open(index, "w", encoding="utf-8") as file:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, file)
    return index

"""LatentMoE.from_pretrained through the library's loader (memory-mapped; only the rank's slices read): one
safetensors file, a checkpoint folder, an index over shards; names under a prefix; the config read from
config.json beside the weights; the compute dtype the checkpoint's. Each gives exactly what the same weights
give through LatentMoE(config, weights, ctx)."""

import os

import pytest
import torch

import latentmoe
import reference
from conftest import FAMILIES, make_inputs, make_weights, run_ranks, save_checkpoint

PREFIX = "model.layers.3.mlp."


def outputs(layers, contexts, x, logits, tier="auto"):
    return run_ranks(contexts, lambda rank, ctx: layers[rank](x, logits, tier=tier))


@pytest.mark.parametrize("family", ["kimi", "mxfp4"])
@pytest.mark.parametrize("form", ["file", "folder", "index"])
def test_from_pretrained_equals_the_in_memory_layer(tmp_path, family, form):
    tp = 2
    config = FAMILIES[family]()
    named, roles = make_weights(config, torch.bfloat16, seed=41)
    folder = tmp_path / "checkpoint"
    saved = save_checkpoint(str(folder), named, config, PREFIX, shards=1 if form == "file" else 3)
    path = {"file": saved, "folder": str(folder), "index": saved}[form]
    if form == "index":
        assert saved.endswith("model.safetensors.index.json")

    contexts = latentmoe.simulated_group(tp, "cpu", max_tokens=16)
    loaded = [latentmoe.LatentMoE.from_pretrained(path, ctx, prefix=PREFIX) for ctx in contexts]
    assert loaded[0].dtype == torch.bfloat16  # the checkpoint's
    contexts2 = latentmoe.simulated_group(tp, "cpu", max_tokens=16)
    built = [latentmoe.LatentMoE(config, named, ctx) for ctx in contexts2]
    x, logits = make_inputs(config, 7, torch.bfloat16, seed=3)
    for tier in ("native", "column_parallel"):
        a = outputs(loaded, contexts, x, logits, tier)
        b = outputs(built, contexts2, x, logits, tier)
        for ra, rb in zip(a, b):
            assert all(torch.equal(p, q) for p, q in zip(ra, rb))
    ref = reference.layer(latentmoe.normalize_config(config), roles, x, logits)[0]
    assert reference.relative_error(a[0][0], ref) <= reference.tolerance(torch.bfloat16)


def test_from_pretrained_with_a_given_config_and_dtype(tmp_path):
    config = FAMILIES["nemotron"]()
    named, roles = make_weights(config, torch.float32, seed=43)
    path = save_checkpoint(str(tmp_path), named, config, "")
    os.remove(tmp_path / "config.json")
    ctx = latentmoe.RankContext("cpu", max_tokens=8)
    with pytest.raises(ValueError, match="no config given and no config.json"):
        latentmoe.LatentMoE.from_pretrained(path, ctx)
    layer = latentmoe.LatentMoE.from_pretrained(path, ctx, config=config, dtype=torch.float16)
    assert layer.dtype == torch.float16
    x, logits = make_inputs(config, 5, torch.float16, seed=1)
    out = layer(x, logits)[0]
    _, roles16 = make_weights(config, torch.float16, seed=43)  # the same values rounded to float16
    ref = reference.layer(latentmoe.normalize_config(config), roles16, x, logits)[0]
    assert reference.relative_error(out, ref) <= reference.tolerance(torch.float16)


def test_from_pretrained_errors_name_the_file_and_tensor(tmp_path):
    config = FAMILIES["kimi"]()
    named, _ = make_weights(config, torch.float32, seed=44)
    del named["experts.5.up_proj.weight"]
    path = save_checkpoint(str(tmp_path), named, config, PREFIX)
    ctx = latentmoe.RankContext("cpu", max_tokens=8)
    with pytest.raises(ValueError, match=r"missing tensor model\.layers\.3\.mlp\.experts\.5\.up_proj\.weight"):
        latentmoe.LatentMoE.from_pretrained(path, ctx, prefix=PREFIX)
    with pytest.raises(ValueError, match="missing tensor wrong.routed_expert_down_proj.weight"):
        latentmoe.LatentMoE.from_pretrained(path, ctx, prefix="wrong.")
    with pytest.raises(ValueError, match="nothing.safetensors"):
        latentmoe.LatentMoE.from_pretrained(str(tmp_path / "nothing.safetensors"), ctx, config=config)
    with open(tmp_path / "broken.safetensors", "wb") as file:
        file.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    with pytest.raises(ValueError, match="broken.safetensors"):
        latentmoe.LatentMoE.from_pretrained(str(tmp_path / "broken.safetensors"), ctx, config=config)

"""LatentTail (torch.ops.latentmoe.tail_forward) against the reference runner's tails written in float64
(reference.py: native, tail_fusion, allreduce_overlap, column_parallel over every rank's partials), at tp 1,
2, 4 and 8, with and without the latent norm, in float32, bfloat16 and float16. The partials are left as
they were; every rank holds the same bits."""

import math

import pytest
import torch

import latentmoe
import reference
from conftest import run_ranks, uniform

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
D, L = 56, 40  # d/8 = 7, l/8 = 5


def make_tail_weights(dtype, with_norm, seed):
    g = torch.Generator().manual_seed(seed)
    up = uniform((D, L), g, 1 / math.sqrt(L)).to(dtype)
    norm = uniform((L,), g, 0.25, 1.0).to(torch.float32) if with_norm else None
    return up, norm


def make_partials(tp, tokens, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    shared = [uniform((tokens, D), g).to(dtype) for _ in range(tp)]
    latent = [uniform((tokens, L), g).to(dtype) for _ in range(tp)]
    return shared, latent


def make_tail_inputs(tp, tokens, dtype, with_norm, seed):
    up, norm = make_tail_weights(dtype, with_norm, seed)
    return make_partials(tp, tokens, dtype, seed + 1) + (up, norm)


CASES = [(dtype, tp, norm) for dtype in DTYPES for tp in (1, 2, 4, 8) for norm in (True, False)]


@pytest.mark.parametrize("dtype_name,tp,with_norm", CASES, ids=[f"{d}-tp{t}-{'norm' if n else 'nonorm'}" for d, t, n in CASES])
def test_every_tier_matches_the_reference_tail(dtype_name, tp, with_norm, poisoned_outputs):
    dtype = DTYPES[dtype_name]
    contexts = latentmoe.simulated_group(tp, "cpu", max_tokens=48)
    up, norm = make_tail_weights(dtype, with_norm, seed=tp)
    tails = [latentmoe.LatentTail(norm, up, ctx, eps=1e-5) for ctx in contexts]
    for tokens in (1, 6, 48):
        shared, latent = make_partials(tp, tokens, dtype, seed=tokens * 10 + tp)
        before = [(s.clone(), l.clone()) for s, l in zip(shared, latent)]
        tiers = ("native",) + (("tail_fusion", "allreduce_overlap", "column_parallel") if tp > 1 else ()) + ("auto",)
        for tier in tiers:
            outs = run_ranks(contexts, lambda rank, ctx: tails[rank](shared[rank], latent[rank], tier=tier))
            for rank, out in enumerate(outs):
                assert out.dtype == dtype and out.shape == (tokens, D)
                assert torch.equal(out, outs[0]), f"rank {rank} differs from rank 0 ({tier})"
            expected_tier = tails[0].select_tier(tokens) if tier == "auto" else tier
            ref = reference.TAILS[expected_tier](
                [s.double() for s in shared], [l.double() for l in latent], None if norm is None else norm.double(),
                up.double(), 1e-5)
            assert torch.isfinite(outs[0]).all()
            error = reference.relative_error(outs[0], ref)
            assert error <= reference.tolerance(dtype), f"{tier}: {error:.3g} > {reference.tolerance(dtype)}"
        for (s0, l0), s, l in zip(before, shared, latent):
            assert torch.equal(s0, s) and torch.equal(l0, l), "the tail modified its inputs"


def test_the_reference_tails_agree():
    """The four reference tails are one computation (a check of the test itself)."""
    shared, latent, up, norm = make_tail_inputs(4, 5, torch.float64, True, seed=1)
    outs = [tail(shared, latent, norm.double(), up, 1e-5) for tail in reference.TAILS.values()]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=1e-12, atol=1e-12)


def test_tail_beside_a_layer_on_one_context():
    """An engine keeping its own experts for one layer and latentmoe's for another: a tail and a layer
    on the same contexts."""
    from conftest import FAMILIES, make_inputs, make_weights

    config = FAMILIES["kimi"]()
    named, roles = make_weights(config, torch.float32, seed=4)
    contexts = latentmoe.simulated_group(2, "cpu", max_tokens=16)
    layers = [latentmoe.LatentMoE(config, named, ctx) for ctx in contexts]
    shared, latent, up, norm = make_tail_inputs(2, 9, torch.float32, True, seed=2)
    tails = [latentmoe.LatentTail(norm, up, ctx) for ctx in contexts]
    assert contexts[0].num_layers == 2
    x, logits = make_inputs(config, 9, torch.float32, seed=3)

    def body(rank, ctx):
        out = layers[rank](x, logits)[0]
        return out, tails[rank](shared[rank], latent[rank])

    results = run_ranks(contexts, body)
    ref = reference.tail_native([s.double() for s in shared], [l.double() for l in latent], norm.double(), up.double(), 1e-5)
    assert reference.relative_error(results[0][1], ref) <= reference.tolerance(torch.float32)
    ref_layer = reference.layer(latentmoe.normalize_config(config), roles, x, logits)[0]
    assert reference.relative_error(results[0][0], ref_layer) <= reference.tolerance(torch.float32)


def test_norm_weight_in_another_dtype_is_taken_as_float32():
    ctx = latentmoe.RankContext("cpu", max_tokens=4)
    shared, latent, up, norm = make_tail_inputs(1, 3, torch.bfloat16, True, seed=3)
    tail = latentmoe.LatentTail(norm.to(torch.bfloat16), up, ctx)
    ref = reference.tail_native([shared[0].double()], [latent[0].double()], norm.to(torch.bfloat16).double(), up.double(), 1e-5)
    assert reference.relative_error(tail(shared[0], latent[0]), ref) <= reference.tolerance(torch.bfloat16)

"""Bad input raises ValueError (shapes, dtypes, devices, names, config, non-contiguous, too many tokens, an
impossible tier) and everything else RuntimeError, each with the library's one-line message; nothing
crashes, and the layer keeps working after a refused call."""

import re

import pytest
import torch

import latentmoe
from latentmoe import _lib
from conftest import FAMILIES, make_inputs, make_weights


def one_line(excinfo):
    message = str(excinfo.value)
    assert "\n" not in message and message.strip() == message and message, repr(message)
    return message


def raises(kind, pattern):
    """pytest.raises that also checks the message is one line."""

    class Check:
        def __enter__(self):
            self.context = pytest.raises(kind, match=pattern)
            self.info = self.context.__enter__()
            return self.info

        def __exit__(self, *exc):
            suppressed = self.context.__exit__(*exc)
            if suppressed:
                one_line(self.info)
            return suppressed

    return Check()


@pytest.fixture(scope="module")
def setup():
    config = FAMILIES["kimi"]()
    named, _ = make_weights(config, torch.bfloat16, seed=3)
    ctx = latentmoe.RankContext("cpu", max_tokens=16)
    layer = latentmoe.LatentMoE(config, named, ctx)
    return config, named, ctx, layer


def good_inputs(config, tokens=5):
    return make_inputs(config, tokens, torch.bfloat16, seed=tokens)


def test_forward_input_errors(setup):
    config, _, _, layer = setup
    x, logits = good_inputs(config)
    with raises(ValueError, "hidden_states has dtype F32, expected BF16"):
        layer(x.float(), logits)
    with raises(ValueError, re.escape("hidden_states has shape [5, 41], expected [5, 40]")):
        layer(torch.zeros((5, 41), dtype=torch.bfloat16), logits)
    with raises(ValueError, "hidden_states must be a rank-2 tensor"):
        layer(x.reshape(-1), logits)
    with raises(ValueError, re.escape("router_logits has shape [5, 11], expected [5, 12]")):
        layer(x, logits[:, :11].contiguous())
    with raises(ValueError, "router_logits has dtype BF16, expected F32"):
        layer(x, logits.to(torch.bfloat16))
    with raises(ValueError, "hidden_states must be contiguous"):
        layer(torch.zeros((40, 5), dtype=torch.bfloat16).t(), logits)
    with raises(ValueError, "router_logits must be contiguous"):
        layer(x, torch.zeros((5, 24), dtype=torch.float32)[:, ::2])
    with raises(ValueError, re.escape("latent_states has shape [5, 23], expected [5, 24]")):
        layer(x, logits, torch.zeros((5, 23), dtype=torch.bfloat16))
    with raises(ValueError, "forward got 17 tokens but the runner was built for at most max_tokens = 16"):
        big, big_logits = good_inputs(config, 17)
        layer(big, big_logits)
    with raises(ValueError, "hidden_states must be a torch.Tensor, got list"):
        layer([[1.0]], logits)
    with raises(ValueError, "hidden_states has dtype torch.float64, which latentmoe does not take"):
        layer(x.double(), logits)
    # Still works after the refusals.
    out, _, _ = layer(x, logits)
    assert torch.isfinite(out).all()


def test_device_mismatch_is_refused_by_the_library(setup):
    """A tensor on another device than the context's: the C ABI refuses it before touching its memory
    (described by hand here, since this machine may have no GPU; tests/test_gpu.py passes real ones)."""
    import ctypes

    config, _, _, layer = setup
    x, logits = good_inputs(config)
    foreign = _lib.describe(x, "hidden_states")
    foreign.device_type, foreign.device_index, foreign.data = _lib.DEVICE_CUDA, 1, 16
    out = torch.empty((5, 40), dtype=torch.bfloat16)
    status = _lib.lib.lmoe_layer_forward(layer.handle, foreign, _lib.describe(logits, "router_logits"), None,
                                         _lib.describe(out, "output"), None, None, -1, None, None)
    with raises(ValueError, "hidden_states is on cuda:1 but the rank context is on cpu"):
        _lib.check(status)
    del ctypes


def test_tier_errors(setup):
    config, _, _, layer = setup
    x, logits = good_inputs(config)
    with raises(ValueError, "tier tail_fusion needs tp > 1"):
        layer(x, logits, tier="tail_fusion")
    with raises(ValueError, "unknown tier 'fastest'"):
        layer(x, logits, tier="fastest")
    with raises(ValueError, "unknown tier 7"):
        layer(x, logits, tier=7)


def test_missing_gate_and_logits():
    config = FAMILIES["silu"]()
    named, _ = make_weights(config, torch.float32, seed=2, with_gate=False)
    layer = latentmoe.LatentMoE(config, named, latentmoe.RankContext("cpu", max_tokens=4))
    x, _ = make_inputs(config, 2, torch.float32, seed=1, logits=False)
    with raises(ValueError, "router_logits were not given and the weights have no gate.weight"):
        layer(x)


def test_weight_errors(setup):
    config, named, ctx, _ = setup
    missing = dict(named)
    del missing["experts.3.up_proj.weight"]
    with raises(ValueError, re.escape("weights: missing tensor experts.3.up_proj.weight (expected shape [24, 24])")):
        latentmoe.LatentMoE(config, missing, ctx)
    wrong_shape = dict(named, **{"shared_experts.down_proj.weight": torch.zeros((40, 41), dtype=torch.bfloat16)})
    with raises(ValueError, re.escape("weights: tensor shared_experts.down_proj.weight has shape [40, 41], expected [40, 40]")):
        latentmoe.LatentMoE(config, wrong_shape, ctx)
    wrong_dtype = dict(named, **{"experts.0.gate_proj.weight": named["experts.0.gate_proj.weight"].to(torch.int32)})
    with raises(ValueError, "experts.0.gate_proj.weight has dtype torch.int32; weights must be float32, bfloat16 or float16"):
        latentmoe.LatentMoE(config, wrong_dtype, ctx)
    both = dict(named, **{"fc1_latent_proj.weight": named["routed_expert_down_proj.weight"]})
    with raises(ValueError, "both routed_expert_down_proj.weight and fc1_latent_proj.weight are present"):
        latentmoe.LatentMoE(config, both, ctx)
    mxfp4_config = FAMILIES["mxfp4"]()
    dense_config = {k: v for k, v in mxfp4_config.items() if k != "quantization_config"}
    dense_named, _ = make_weights(dense_config, torch.bfloat16, seed=1)
    mxfp4_named, _ = make_weights(mxfp4_config, torch.bfloat16, seed=1)
    with raises(ValueError, "the config declares MXFP4 experts .* but the weights hold dense expert tensors"):
        latentmoe.LatentMoE(mxfp4_config, dense_named, ctx)
    with raises(ValueError, "the weights hold MXFP4 expert tensors .* but the config declares dense experts"):
        latentmoe.LatentMoE(dense_config, mxfp4_named, ctx)
    bad_scale = dict(mxfp4_named, **{"experts.2.w2.weight_scale": torch.full((64, 8), 0xFF, dtype=torch.uint8)})
    with raises(ValueError, "0xFF"):
        latentmoe.LatentMoE(mxfp4_config, bad_scale, ctx)
    with raises(ValueError, "weights must be a dict"):
        latentmoe.LatentMoE(config, [1, 2], ctx)


def test_mxfp4_to_kernel_order_errors():
    # Only codes on a CUDA device are converted: host codes stay canonical (the layer converts what it copies).
    with raises(ValueError, "codes are on cpu; only codes on a CUDA device are converted"):
        latentmoe.mxfp4_to_kernel_order(torch.zeros(16, dtype=torch.uint8))
    with raises(ValueError, "codes must be a torch.Tensor"):
        latentmoe.mxfp4_to_kernel_order([0] * 16)


def test_config_errors(setup):
    config, named, ctx, _ = setup
    missing = {k: v for k, v in config.items() if k != "moe_latent_size"}
    with raises(ValueError, "config: missing required key 'moe_latent_size' \\(or its alias 'routed_expert_hidden_size'\\)"):
        latentmoe.LatentMoE(missing, named, ctx)
    with raises(ValueError, "config: unknown hidden_act 'gelu'; accepted: silu, situ, relu2"):
        latentmoe.LatentMoE(dict(config, hidden_act="gelu"), named, ctx)
    with raises(ValueError, "'hidden_size' must be an integer"):
        latentmoe.LatentMoE(dict(config, hidden_size="40"), named, ctx)
    with raises(ValueError, "num_experts_per_tok 13 exceeds"):
        latentmoe.LatentMoE(dict(config, num_experts_per_tok=13), named, ctx)
    # A layout tp cannot split: I = 24 over 5 ranks.
    contexts = latentmoe.simulated_group(5, "cpu", 4)
    with raises(ValueError, "tp 5"):
        latentmoe.LatentMoE(config, named, contexts[0])
    with raises(ValueError, "unknown tier policy knob"):
        latentmoe.LatentMoE(config, named, ctx, policy={"fastest": True})


def test_context_errors():
    with raises(ValueError, "max_tokens must be at least 1, got 0"):
        latentmoe.RankContext("cpu", max_tokens=0)
    with raises(ValueError, "latentmoe runs on cpu or cuda"):
        latentmoe.RankContext("meta")
    with raises(ValueError, "tp must be at least 1"):
        latentmoe.simulated_group(0, "cpu")
    with raises(ValueError, "an NCCL communicator needs a CUDA device"):
        latentmoe.RankContext("cpu", nccl_comm=1234)
    if not latentmoe.build_info()["cuda"]:
        with raises(ValueError, "latentmoe was built without CUDA"):
            latentmoe.RankContext("cuda:0")


def test_process_group_on_the_cpu_is_refused():
    import torch.distributed as dist

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with raises(ValueError, "process groups are supported on CUDA devices only"):
            latentmoe.RankContext("cpu", max_tokens=4, group=dist.group.WORLD)
    finally:
        dist.destroy_process_group()


def test_runtime_errors(setup):
    config, named, _, _ = setup
    ctx = latentmoe.RankContext("cpu", max_tokens=4)
    layer = latentmoe.LatentMoE(config, named, ctx)
    x, logits = good_inputs(config, 2)
    layer(x, logits)
    bigger = FAMILIES["nemotron"]()
    bigger_named, _ = make_weights(bigger, torch.bfloat16, seed=1)
    with raises(RuntimeError, "construct every layer before the first forward"):
        latentmoe.LatentMoE(bigger, bigger_named, ctx)
    handle = layer.handle
    layer.close()
    with raises(RuntimeError, "no live latentmoe layer has handle"):
        torch.ops.latentmoe.layer_forward(x, logits, None, handle, -1)


def test_tail_errors():
    ctx = latentmoe.RankContext("cpu", max_tokens=4)
    up = torch.zeros((8, 4), dtype=torch.bfloat16)
    with raises(ValueError, "up_weight must be W_up as a 2-d torch.Tensor"):
        latentmoe.LatentTail(None, up.reshape(-1), ctx)
    with raises(ValueError, re.escape("tail: latent_norm has shape [5], expected [4]")):
        latentmoe.LatentTail(torch.ones(5), up, ctx)
    with raises(ValueError, "tail: eps must be positive"):
        latentmoe.LatentTail(None, up, ctx, eps=0.0)
    tail = latentmoe.LatentTail(None, up, ctx)
    s, l = torch.zeros((3, 8), dtype=torch.bfloat16), torch.zeros((3, 4), dtype=torch.bfloat16)
    with raises(ValueError, re.escape("latent_partial has shape [3, 8], expected [3, 4]")):
        tail(s, s)
    with raises(ValueError, "shared_partial has dtype F16, expected BF16"):
        tail(s.half(), l)
    with raises(ValueError, "tail got 5 tokens but its rank context was built for at most max_tokens = 4"):
        tail(torch.zeros((5, 8), dtype=torch.bfloat16), torch.zeros((5, 4), dtype=torch.bfloat16))
    with raises(ValueError, "tier column_parallel needs tp > 1"):
        tail(s, l, tier="column_parallel")
    contexts = latentmoe.simulated_group(3, "cpu", 4)
    with raises(ValueError, "tail: tp 3 must divide hidden_size"):
        latentmoe.LatentTail(None, up, contexts[0])

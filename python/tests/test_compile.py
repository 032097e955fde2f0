"""torch.compile(fullgraph=True) of a module that calls the layer and the tail: the custom ops trace through
their fake implementations without a graph break (fullgraph raises on one), and the compiled module gives
what eager gives."""

import pytest
import torch

import latentmoe
from conftest import FAMILIES, make_inputs, make_weights, uniform

D, L = 40, 24


class Block(torch.nn.Module):
    """An engine's block: latentmoe's layer, then an engine-side op, then latentmoe's tail on partials the
    engine made itself (its own experts, say)."""

    def __init__(self, layer, tail):
        super().__init__()
        self.layer = layer
        self.tail = tail

    def forward(self, x, logits, shared_partial, latent_partial):
        out, topk_ids, topk_weights = self.layer(x, logits, tier="native")
        tail_out = self.tail(shared_partial * 0.5, latent_partial, tier="auto")
        return out * 2.0 + tail_out, topk_ids, topk_weights.sum(dim=-1)


def make_block(dtype):
    config = FAMILIES["kimi"]()
    named, _ = make_weights(config, dtype, seed=31)
    ctx = latentmoe.RankContext("cpu", max_tokens=64)
    layer = latentmoe.LatentMoE(config, named, ctx)
    g = torch.Generator().manual_seed(5)
    tail = latentmoe.LatentTail(uniform((L,), g, 0.2, 1.0).float(), uniform((D, L), g, 0.2).to(dtype), ctx)
    return config, Block(layer, tail)


def inputs(config, tokens, dtype, seed):
    x, logits = make_inputs(config, tokens, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    return x, logits, uniform((tokens, D), g).to(dtype), uniform((tokens, L), g).to(dtype)


@pytest.mark.parametrize("backend,dynamic", [("aot_eager", False), ("aot_eager", True), ("inductor", None)])
def test_compiled_block_has_no_graph_break_and_matches_eager(backend, dynamic):
    torch._dynamo.reset()
    config, block = make_block(torch.float32)
    compiled = torch.compile(block, fullgraph=True, backend=backend, dynamic=dynamic)
    for tokens in (3, 17, 64):
        args = inputs(config, tokens, torch.float32, seed=tokens)
        eager = block(*args)
        traced = compiled(*args)
        for a, b in zip(traced, eager):
            # The library's outputs are the same bits; inductor may contract out * 2 + tail_out into an fma.
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_graph_holds_the_custom_ops():
    """The ops appear in the traced graph as themselves (not as a fallback around them)."""
    torch._dynamo.reset()
    config, block = make_block(torch.bfloat16)
    graphs = []

    def capture(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    compiled = torch.compile(block, fullgraph=True, backend=capture)
    compiled(*inputs(config, 5, torch.bfloat16, seed=2))
    assert len(graphs) == 1
    targets = {str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"}
    assert any("latentmoe.layer_forward" in t for t in targets), targets
    assert any("latentmoe.tail_forward" in t for t in targets), targets


def test_fake_implementations_give_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    config, block = make_block(torch.float16)
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.empty((7, D), dtype=torch.float16))
        out, ids, weights = torch.ops.latentmoe.layer_forward(x, None, None, block.layer.handle, -1)
        tail_out = torch.ops.latentmoe.tail_forward(x, mode.from_tensor(torch.empty((7, L), dtype=torch.float16)),
                                                    block.tail.handle, -1)
    assert out.shape == (7, D) and out.dtype == torch.float16
    assert ids.shape == (7, 3) and ids.dtype == torch.int32
    assert weights.shape == (7, 3) and weights.dtype == torch.float32
    assert tail_out.shape == (7, D) and tail_out.dtype == torch.float16


def test_opcheck():
    """torch.library.opcheck: schema, fake implementation and dispatch agree."""
    config, block = make_block(torch.float32)
    x, logits, shared, latent = inputs(config, 4, torch.float32, seed=9)
    torch.library.opcheck(torch.ops.latentmoe.layer_forward.default, (x, logits, None, block.layer.handle, 0))
    torch.library.opcheck(torch.ops.latentmoe.tail_forward.default, (shared, latent, block.tail.handle, -1))

"""The torch custom ops torch.ops.latentmoe.layer_forward and torch.ops.latentmoe.tail_forward.

Each op allocates its outputs with torch.empty (torch's allocator owns them; captured into a CUDA graph's
pool under torch.cuda.graph), passes torch's current stream to the library, and calls the C ABI, which
enqueues the work on that stream: no host synchronisation, no other allocation, no environment read.
ctypes releases the GIL during the call. The fake implementations give the outputs' shapes and dtypes
from the layer's metadata, so torch.compile traces the ops without running them (fullgraph, no break).

A layer or tail is named by its C handle, an int: the ops look its metadata up here.
"""

from dataclasses import dataclass

import torch

from . import _lib
from ._lib import lib


@dataclass(frozen=True)
class _Entry:
    handle: int
    dtype: torch.dtype
    hidden_size: int
    top_k: int  # layers only
    # Ranks simulated on one GPU each need a stream of their own: the library refuses the default one.
    device: torch.device


_LAYERS = {}
_TAILS = {}


def register_layer(entry):
    _LAYERS[entry.handle] = entry


def register_tail(entry):
    _TAILS[entry.handle] = entry


def unregister(handle):
    _LAYERS.pop(handle, None)
    _TAILS.pop(handle, None)


def _lookup(table, handle, what):
    entry = table.get(handle)
    if entry is None:
        raise RuntimeError(f"latentmoe: no live {what} has handle {handle:#x} (was it destroyed?)")
    return entry


def _stream_of(device):
    # The C ABI's 0 is CUDA's legacy default stream, which is what torch's default stream is.
    if device.type == "cuda":
        return torch.cuda.current_stream(device).cuda_stream
    return 0


def _rows(tensor):
    return tensor.shape[0] if tensor.dim() >= 1 else 0


@torch.library.custom_op(
    "latentmoe::layer_forward",
    mutates_args=(),
    schema="(Tensor hidden_states, Tensor? router_logits, Tensor? latent_states, int handle, int tier) -> (Tensor, Tensor, Tensor)",
)
def layer_forward(hidden_states, router_logits, latent_states, handle, tier):
    entry = _lookup(_LAYERS, handle, "latentmoe layer")
    tokens = _rows(hidden_states)
    device = hidden_states.device
    out = torch.empty((tokens, entry.hidden_size), dtype=entry.dtype, device=device)
    topk_ids = torch.empty((tokens, entry.top_k), dtype=torch.int32, device=device)
    topk_weights = torch.empty((tokens, entry.top_k), dtype=torch.float32, device=device)
    describe = _lib.describe
    _lib.check(
        lib.lmoe_layer_forward(
            handle,
            describe(hidden_states, "hidden_states"),
            None if router_logits is None else describe(router_logits, "router_logits"),
            None if latent_states is None else describe(latent_states, "latent_states"),
            describe(out, "output"),
            describe(topk_ids, "topk_ids"),
            describe(topk_weights, "topk_weights"),
            tier,
            _stream_of(device),
            None,
        )
    )
    return out, topk_ids, topk_weights


@layer_forward.register_fake
def _layer_forward_fake(hidden_states, router_logits, latent_states, handle, tier):
    entry = _lookup(_LAYERS, handle, "latentmoe layer")
    tokens = _rows(hidden_states)
    return (
        hidden_states.new_empty((tokens, entry.hidden_size), dtype=entry.dtype),
        hidden_states.new_empty((tokens, entry.top_k), dtype=torch.int32),
        hidden_states.new_empty((tokens, entry.top_k), dtype=torch.float32),
    )


@torch.library.custom_op(
    "latentmoe::tail_forward",
    mutates_args=(),
    schema="(Tensor shared_partial, Tensor latent_partial, int handle, int tier) -> Tensor",
)
def tail_forward(shared_partial, latent_partial, handle, tier):
    entry = _lookup(_TAILS, handle, "latentmoe tail")
    device = shared_partial.device
    out = torch.empty((_rows(shared_partial), entry.hidden_size), dtype=entry.dtype, device=device)
    describe = _lib.describe
    _lib.check(
        lib.lmoe_tail_forward(
            handle,
            describe(shared_partial, "shared_partial"),
            describe(latent_partial, "latent_partial"),
            describe(out, "out"),
            tier,
            _stream_of(device),
            None,
        )
    )
    return out


@tail_forward.register_fake
def _tail_forward_fake(shared_partial, latent_partial, handle, tier):
    entry = _lookup(_TAILS, handle, "latentmoe tail")
    return shared_partial.new_empty((_rows(shared_partial), entry.hidden_size), dtype=entry.dtype)


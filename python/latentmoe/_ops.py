"""The torch custom ops torch.ops.latentmoe.layer_forward and torch.ops.latentmoe.tail_forward.

Each op allocates its outputs with torch.empty (torch's allocator owns them; captured into a CUDA graph's
pool under torch.cuda.graph), passes torch's current stream to the library, and calls the C ABI, which
enqueues the work on that stream: no host synchronisation, no other allocation, no environment read.
ctypes releases the GIL during the call. The fake implementations give the outputs' shapes and dtypes
from the layer's metadata, so torch.compile traces the ops without running them (fullgraph, no break).

A layer or tail is named by its C handle, an int: the ops look its metadata up here.
"""

import ctypes
import struct
import threading
from dataclasses import dataclass

import torch

from . import _lib
from ._lib import lib

# The per-call descriptors (lmoe_tensor) are packed with one struct.pack_into each into a buffer of the
# calling thread's, and passed by address: a ctypes.Structure per tensor costs about twice as much host
# time (docs/PYTHON.md, "Host cost per call"). Each thread has its own buffer, so ranks driven by threads
# never share one.
_PACKED = struct.Struct("=Qii4q4qii")
assert _PACKED.size == ctypes.sizeof(_lib.Tensor), "lmoe_tensor's layout"
_SLOTS = 6
_local = threading.local()
_CODES = {dtype: code for code, dtype in _lib.DTYPES_BY_CODE.items()}


def _buffer():
    state = getattr(_local, "state", None)
    if state is None:
        buffer = ctypes.create_string_buffer(_PACKED.size * _SLOTS)
        state = _local.state = (buffer, ctypes.addressof(buffer))
    return state


def _pack_made(buffer, base, slot, tensor, code, rows, cols, device_type, device_index):
    """The descriptor of an output the op just made itself ([rows, cols], contiguous, known dtype and device),
    without asking the tensor for what is known."""
    offset = slot * _PACKED.size
    _PACKED.pack_into(buffer, offset, tensor.data_ptr(), code, 2, rows, cols, 0, 0, cols, 1, 0, 0, device_type,
                      device_index)
    return base + offset


def _where(device):
    return (_lib.DEVICE_CUDA, device.index) if device.type == "cuda" else (_lib.DEVICE_CPU, 0)


def _pack(buffer, base, slot, tensor, what):
    """Writes `tensor`'s descriptor into slot `slot` of the thread's buffer; returns its address."""
    device = tensor.device
    if device.type == "cuda":
        device_type, device_index = _lib.DEVICE_CUDA, device.index
    elif device.type == "cpu":
        device_type, device_index = _lib.DEVICE_CPU, 0
    else:
        raise ValueError(f"{what} is on {device}, which latentmoe does not run on (cpu, cuda)")
    code = _CODES.get(tensor.dtype)
    if code is None:
        _lib.dtype_code(tensor.dtype, what)  # raises the message
    ndim = tensor.dim()
    offset = slot * _PACKED.size
    if ndim == 2:
        rows, cols = tensor.shape
        row_stride, col_stride = tensor.stride()
        _PACKED.pack_into(buffer, offset, tensor.data_ptr(), code, 2, rows, cols, 0, 0, row_stride, col_stride, 0, 0,
                          device_type, device_index)
    elif ndim <= 4:
        shape = (*tensor.shape, 0, 0, 0, 0)
        strides = (*tensor.stride(), 0, 0, 0, 0)
        _PACKED.pack_into(buffer, offset, tensor.data_ptr(), code, ndim, *shape[:4], *strides[:4], device_type,
                          device_index)
    else:
        raise ValueError(f"{what} has {ndim} dimensions (at most 4)")
    return base + offset


@dataclass(frozen=True)
class _Entry:
    handle: int
    dtype: torch.dtype
    hidden_size: int
    top_k: int  # layers only
    device: torch.device

    @property
    def code(self):
        return _CODES[self.dtype]


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


# The forward entry points with the descriptors passed by address (void*): the same C functions as
# lib.lmoe_layer_forward / lmoe_tail_forward, declared a second time so that ctypes converts plain ints.
_layer_forward_abi = _lib.function("lmoe_layer_forward", ctypes.c_int,
                                   [ctypes.c_void_p] * 7 + [ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p])
_tail_forward_abi = _lib.function("lmoe_tail_forward", ctypes.c_int,
                                  [ctypes.c_void_p] * 4 + [ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p])


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
    buffer, base = _buffer()
    device_type, device_index = _where(device)
    d, k = entry.hidden_size, entry.top_k
    status = _layer_forward_abi(
        handle,
        _pack(buffer, base, 0, hidden_states, "hidden_states"),
        None if router_logits is None else _pack(buffer, base, 1, router_logits, "router_logits"),
        None if latent_states is None else _pack(buffer, base, 2, latent_states, "latent_states"),
        _pack_made(buffer, base, 3, out, entry.code, tokens, d, device_type, device_index),
        _pack_made(buffer, base, 4, topk_ids, _lib.DTYPE_I32, tokens, k, device_type, device_index),
        _pack_made(buffer, base, 5, topk_weights, _lib.DTYPE_F32, tokens, k, device_type, device_index),
        tier,
        _stream_of(device),
        None,
    )
    if status:
        _lib.check(status)
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
    buffer, base = _buffer()
    device_type, device_index = _where(device)
    status = _tail_forward_abi(
        handle,
        _pack(buffer, base, 0, shared_partial, "shared_partial"),
        _pack(buffer, base, 1, latent_partial, "latent_partial"),
        _pack_made(buffer, base, 2, out, entry.code, out.shape[0], entry.hidden_size, device_type, device_index),
        tier,
        _stream_of(device),
        None,
    )
    if status:
        _lib.check(status)
    return out


@tail_forward.register_fake
def _tail_forward_fake(shared_partial, latent_partial, handle, tier):
    entry = _lookup(_TAILS, handle, "latentmoe tail")
    return shared_partial.new_empty((_rows(shared_partial), entry.hidden_size), dtype=entry.dtype)


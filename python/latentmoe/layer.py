"""LatentMoE: one MoE layer of one rank (latentmoe::Runner) as a torch.nn.Module over the custom op
torch.ops.latentmoe.layer_forward."""

import ctypes
import json
import os
import weakref

import torch

from . import _lib, _ops, _weights
from ._lib import check, lib
from .context import RankContext


def _read_config(config, path):
    """A config as a dict or JSON text: the dict given, a JSON file's text, or config.json beside `path`."""
    if config is None:
        folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
        candidate = os.path.join(folder, "config.json")
        if not os.path.isfile(candidate):
            raise ValueError(f"{path}: no config given and no config.json in {folder}")
        config = candidate
    if isinstance(config, dict):
        return json.dumps(config)
    if isinstance(config, (str, os.PathLike)) and os.path.isfile(config):
        with open(config, encoding="utf-8") as file:
            return file.read()
    if isinstance(config, str):
        return config
    raise ValueError(f"config must be a dict, JSON text or a path to config.json, got {type(config).__name__}")


class _Module(torch.nn.Module):
    """What LatentMoE and LatentTail share: the C handle's life, and no device or dtype moves (the library
    holds the weights on the context's device; moving the module would leave them behind)."""

    def _own(self, handle, destroy):
        self._handle = handle
        self._finalizer = weakref.finalize(self, _release, handle, destroy)

    def _apply(self, fn, recurse=True):
        raise RuntimeError(
            f"{type(self).__name__} lives on its rank context's device in its dtype; it cannot be moved or cast "
            "(.to/.cuda/.half/...): build it on a context of the device you want"
        )

    @property
    def handle(self):
        """The C ABI's handle as an int (the custom ops' argument)."""
        return self._handle

    def select_tier(self, num_tokens):
        """The tier "auto" takes for num_tokens tokens."""
        tier = ctypes.c_int32()
        check(self._select_tier(ctypes.c_void_p(self._handle), num_tokens, ctypes.byref(tier)))
        return _lib.TIER_NAMES[tier.value]

    @property
    def tier_support(self):
        """What each tier can run here: {tier: {"supported", "max_tokens", "reason"}, "collectives": ...}."""
        return json.loads(_lib.read_text(self._describe_tiers, ctypes.c_void_p(self._handle)))

    def close(self):
        """Releases the layer now (else when the module is collected)."""
        self._finalizer()


def _require_tensor(value, what, optional=False):
    # The op's schema would refuse anything else too, but with torch's multi-line message and a RuntimeError.
    if not isinstance(value, torch.Tensor) and not (optional and value is None):
        raise ValueError(f"{what} must be a torch.Tensor{' or None' if optional else ''}, got {type(value).__name__}")


def _release(handle, destroy):
    _ops.unregister(handle)
    destroy(ctypes.c_void_p(handle))


class LatentMoE(_Module):
    """The latent-MoE layer of one tensor-parallel rank (DESIGN sections 1-2).

    LatentMoE(config, weights, ctx): config is a dict as config.json holds (Hugging Face keys and aliases);
    weights a dict name -> torch.Tensor of the FULL (tp 1) layer under the checkpoint names of DESIGN
    section 3 (either alias set; MXFP4 experts as experts.{e}.w1|w3|w2.weight_packed/.weight_scale), on any
    device; the rank takes its own shard (views where they already fit, the routed experts stacked on
    ctx's device). Optional: dtype (the compute dtype; default that of routed_expert_down_proj.weight),
    prefix (stripped from the names), policy (a dict of tier-policy knobs: tail_fusion_max_tokens,
    shared_stream_token_threshold, disable_shared_stream, disable_tail_fusion).

    forward(hidden_states, router_logits=None, latent_states=None, tier="auto") -> (out, topk_ids, topk_weights)
    """

    _select_tier = staticmethod(lib.lmoe_layer_select_tier)
    _describe_tiers = staticmethod(lib.lmoe_layer_describe_tiers)

    def __init__(self, config, weights, ctx, *, dtype=None, prefix="", policy=None):
        super().__init__()
        if not isinstance(ctx, RankContext):
            raise ValueError(f"ctx must be a latentmoe.RankContext, got {type(ctx).__name__}")
        config_text = _read_config(config, ".") if not isinstance(config, dict) else json.dumps(config)
        normalized = _lib.normalize_config(config_text)
        check(lib.lmoe_config_check_parallel(config_text.encode(), ctx.tp))
        dtype = _weights.compute_dtype(weights, prefix, dtype)
        shard, code_order = _weights.shard(weights, normalized, ctx.tp, ctx.rank, dtype, ctx.device, prefix)
        c_weights = _lib.sized(_lib.LayerWeights)
        c_weights.dtype = _lib.dtype_code(dtype, "dtype")
        c_weights.expert_code_order = code_order
        for name, tensor in shard.items():
            _lib.describe(tensor, name, getattr(c_weights, name))
        handle = ctypes.c_void_p()
        check(lib.lmoe_layer_create(ctypes.c_void_p(ctx.handle), config_text.encode(), ctypes.byref(c_weights),
                                    _lib.policy_struct(policy), ctypes.byref(handle)))
        # The runner uses tensors on its device in place: keep them. On the CPU it copied them.
        self._shard = shard if ctx.device.type == "cuda" else None
        self._setup(handle.value, ctx, normalized)

    @classmethod
    def from_pretrained(cls, path, ctx, prefix="", *, config=None, dtype=None, policy=None):
        """The layer under `prefix` of a checkpoint: one safetensors file, a folder (its
        model.safetensors.index.json or its one .safetensors file) or an index, read through the library's
        loader (memory-mapped; only this rank's slices are read). config: a dict, JSON text or a path;
        default: config.json beside the weights. dtype: default the checkpoint's."""
        if not isinstance(ctx, RankContext):
            raise ValueError(f"ctx must be a latentmoe.RankContext, got {type(ctx).__name__}")
        path = os.fspath(path)
        config_text = _read_config(config, path)
        normalized = _lib.normalize_config(config_text)
        code = _lib.DTYPE_AUTO if dtype is None else _lib.dtype_code(dtype, "dtype")
        handle = ctypes.c_void_p()
        check(lib.lmoe_layer_load(ctypes.c_void_p(ctx.handle), config_text.encode(), path.encode(), prefix.encode(), code,
                                  _lib.policy_struct(policy), ctypes.byref(handle)))
        self = cls.__new__(cls)
        _Module.__init__(self)
        self._shard = None
        self._setup(handle.value, ctx, normalized)
        return self

    def _setup(self, handle, ctx, config):
        self._own(handle, lib.lmoe_layer_destroy)
        info = _lib.sized(_lib.LayerInfo)
        check(lib.lmoe_layer_get_info(ctypes.c_void_p(handle), ctypes.byref(info)))
        self.ctx = ctx
        self.config = config
        self.dtype = _lib.DTYPES_BY_CODE[info.dtype]
        self.hidden_size = info.hidden_size
        self.latent_size = info.latent_size
        self.top_k = info.top_k
        self.num_router_outputs = info.num_router_outputs
        self.has_gate = bool(info.has_gate)
        _ops.register_layer(_ops._Entry(handle, self.dtype, info.hidden_size, info.top_k, ctx.device))

    def forward(self, hidden_states, router_logits=None, latent_states=None, tier="auto"):
        """hidden_states [T, d] in the layer's dtype; router_logits [T, E+Z] float32 (None: computed from
        gate.weight); latent_states [T, l] (None: hidden_states W_down^T); tier "auto" or a tier's name.
        Returns out [T, d], topk_ids [T, k] int32, topk_weights [T, k] float32."""
        _require_tensor(hidden_states, "hidden_states")
        _require_tensor(router_logits, "router_logits", optional=True)
        _require_tensor(latent_states, "latent_states", optional=True)
        return torch.ops.latentmoe.layer_forward(hidden_states, router_logits, latent_states, self._handle,
                                                 _lib.tier_code(tier))

    def extra_repr(self):
        return (f"d={self.hidden_size}, l={self.latent_size}, k={self.top_k}, dtype={self.dtype}, "
                f"rank={self.ctx.rank}/{self.ctx.tp}, device={self.ctx.device}")


class LatentTail(_Module):
    """The reference runner's tail alone: this rank's un-reduced S_r [T, d] and L_r [T, l] -> the layer
    output [T, d] on every rank (native, tail_fusion, allreduce_overlap or column_parallel).

    LatentTail(norm_weight, up_weight, ctx, eps=1e-5): norm_weight the latent RMSNorm's gamma [l] (None:
    no latent norm); up_weight the whole replicated W_up [d, l] in the compute dtype (used in place when it
    is already on ctx's device and contiguous; keep it unchanged).

    forward(shared_partial, latent_partial, tier="auto") -> out
    """

    _select_tier = staticmethod(lib.lmoe_tail_select_tier)
    _describe_tiers = staticmethod(lib.lmoe_tail_describe_tiers)

    def __init__(self, norm_weight, up_weight, ctx, eps=1e-5, *, policy=None):
        super().__init__()
        if not isinstance(ctx, RankContext):
            raise ValueError(f"ctx must be a latentmoe.RankContext, got {type(ctx).__name__}")
        if not isinstance(up_weight, torch.Tensor) or up_weight.dim() != 2:
            raise ValueError("up_weight must be W_up as a 2-d torch.Tensor [hidden_size, latent_size]")
        if up_weight.dtype not in _lib.COMPUTE_DTYPES:
            raise ValueError(f"up_weight has dtype {up_weight.dtype}; the compute dtype must be float32, bfloat16 or float16")
        hidden_size, latent_size = up_weight.shape
        dtype = up_weight.dtype
        up = _weights._place(up_weight, dtype, ctx.device)
        norm = None
        if norm_weight is not None:
            if not isinstance(norm_weight, torch.Tensor):
                raise ValueError(f"norm_weight must be a torch.Tensor or None, got {type(norm_weight).__name__}")
            if norm_weight.dtype not in _lib.COMPUTE_DTYPES:
                raise ValueError(f"norm_weight has dtype {norm_weight.dtype}; it must be float32, bfloat16 or float16")
            norm = _weights._place(norm_weight, torch.float32, ctx.device)
        handle = ctypes.c_void_p()
        check(lib.lmoe_tail_create(ctypes.c_void_p(ctx.handle), hidden_size, latent_size,
                                   None if norm is None else _lib.describe(norm, "norm_weight"),
                                   _lib.describe(up, "up_weight"), float(eps), _lib.dtype_code(dtype, "up_weight"),
                                   _lib.policy_struct(policy), ctypes.byref(handle)))
        self._own(handle.value, lib.lmoe_tail_destroy)
        # Device tensors are used in place by the library: keep them (the CPU backend copied them).
        self._weights = (norm, up) if ctx.device.type == "cuda" else None
        self.ctx = ctx
        self.dtype = dtype
        self.hidden_size = hidden_size
        self.latent_size = latent_size
        self.eps = float(eps)
        _ops.register_tail(_ops._Entry(handle.value, dtype, hidden_size, 0, ctx.device))

    def forward(self, shared_partial, latent_partial, tier="auto"):
        """shared_partial: this rank's S_r [T, d]; latent_partial: its L_r [T, l] (both un-reduced, left as
        they are). Returns out [T, d], the same on every rank."""
        _require_tensor(shared_partial, "shared_partial")
        _require_tensor(latent_partial, "latent_partial")
        return torch.ops.latentmoe.tail_forward(shared_partial, latent_partial, self._handle, _lib.tier_code(tier))

    def extra_repr(self):
        return (f"d={self.hidden_size}, l={self.latent_size}, dtype={self.dtype}, eps={self.eps}, "
                f"rank={self.ctx.rank}/{self.ctx.tp}, device={self.ctx.device}")

"""A layer's full (tp 1) weights under the checkpoint names of DESIGN section 3 -> this rank's shard in the
stacked layout the library takes (latentmoe/weights.h, LayerWeightViews), as torch tensors on the rank's
device.

What already fits is passed as it is, without a copy: a replicated matrix in the compute dtype on the
device, a row block of the shared expert (contiguous). What does not is made once: the routed experts
stacked into [E, rows, cols] (each expert's rows of gate/up, its columns of down), a column block of the
shared expert's down projection, a conversion to the compute dtype or to f32 (router, bias, norm), a copy
to the device. MXFP4 codes stacked on a GPU are then converted there, in place, to the kernel order the CUDA
kernels read (mxfp4_to_kernel_order); host codes stay in the checkpoint's (canonical) order.
"""

import ctypes

import torch

from . import _lib

MXFP4_GROUP = 32


def mxfp4_to_kernel_order(codes):
    """Converts MXFP4 codes (a contiguous torch.uint8 tensor on a CUDA device, e.g. the stacked expert codes an
    engine keeps on the GPU) in place from the checkpoint's (canonical) order to the kernel order the CUDA kernels
    read (latentmoe/mxfp4.h, docs/MXFP4.md), on torch's current stream of the tensor's device; returns `codes`.
    Convert a tensor once. LatentMoE does this itself for the codes it stacks; it is for engines that hand the
    library device codes through the C ABI (lmoe_layer_weights.expert_code_order = kernel)."""
    if not isinstance(codes, torch.Tensor):
        raise ValueError(f"codes must be a torch.Tensor, got {type(codes).__name__}")
    if codes.device.type != "cuda":
        raise ValueError(
            f"codes are on {codes.device}; only codes on a CUDA device are converted (host codes stay in the canonical "
            "order: the layer converts the codes it copies to the GPU)"
        )
    desc = _lib.describe(codes, "codes")
    stream = torch.cuda.current_stream(codes.device).cuda_stream
    _lib.check(_lib.lib.lmoe_mxfp4_to_kernel_order(ctypes.byref(desc), stream))
    return codes


def _shape(shape):
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


class _Source:
    """The caller's dict, looked up with the loader's rules: a name or its alias (never both), the shape and
    the dtype checked, messages naming the tensor."""

    def __init__(self, weights, prefix):
        if not isinstance(weights, dict):
            raise ValueError(f"weights must be a dict of name -> torch.Tensor, got {type(weights).__name__}")
        self.weights = weights
        self.prefix = prefix

    def has(self, name):
        return self.prefix + name in self.weights

    def find(self, name, shape, required, alias=None, packed=False):
        full = self.prefix + name
        tensor = self.weights.get(full)
        found = full
        if alias is not None and self.prefix + alias in self.weights:
            if tensor is not None:
                raise ValueError(f"weights: both {full} and {self.prefix + alias} are present; keep one")
            tensor = self.weights[self.prefix + alias]
            found = self.prefix + alias
        if tensor is None:
            if required:
                also = f" (or {self.prefix + alias})" if alias else ""
                raise ValueError(f"weights: missing tensor {full}{also} (expected shape {_shape(shape)})")
            return None
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"weights: {found} must be a torch.Tensor, got {type(tensor).__name__}")
        if packed:
            if tensor.dtype != torch.uint8:
                raise ValueError(
                    f"weights: tensor {found} has dtype {tensor.dtype}; MXFP4 weight_packed and weight_scale tensors must be uint8"
                )
        elif tensor.dtype not in _lib.COMPUTE_DTYPES:
            raise ValueError(f"weights: tensor {found} has dtype {tensor.dtype}; weights must be float32, bfloat16 or float16")
        if tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"weights: tensor {found} has shape {_shape(tensor.shape)}, expected {_shape(shape)}")
        return tensor


def _place(tensor, dtype, device):
    """`tensor` in `dtype`, contiguous, on `device`: itself when it already is (a view, no copy)."""
    if tensor is None:
        return None
    if tensor.dtype == dtype and tensor.device == device and tensor.is_contiguous():
        return tensor
    return tensor.to(device=device, dtype=dtype).contiguous()


def compute_dtype(weights, prefix, dtype):
    """The layer's dtype: `dtype` when given, else that of its latent down-projection."""
    if not isinstance(weights, dict):
        raise ValueError(f"weights must be a dict of name -> torch.Tensor, got {type(weights).__name__}")
    if dtype is not None:
        if dtype not in _lib.COMPUTE_DTYPES:
            raise ValueError(f"dtype {dtype} is not a compute dtype (float32, bfloat16, float16)")
        return dtype
    for name in ("routed_expert_down_proj.weight", "fc1_latent_proj.weight"):
        tensor = weights.get(prefix + name)
        if isinstance(tensor, torch.Tensor):
            if tensor.dtype not in _lib.COMPUTE_DTYPES:
                raise ValueError(f"weights: tensor {prefix + name} has dtype {tensor.dtype}; weights must be float32, bfloat16 or float16")
            return tensor.dtype
    raise ValueError(
        f"weights: missing tensor {prefix}routed_expert_down_proj.weight (or {prefix}fc1_latent_proj.weight), whose dtype would be the layer's"
    )


def shard(weights, config, tp, rank, dtype, device, prefix=""):
    """This rank's shard as a dict of the C ABI's field names -> tensors (absent fields left out), and the
    order of its MXFP4 expert codes (_lib.MXFP4_ORDER_*: kernel for the codes stacked on a GPU, which are
    converted here; canonical otherwise).

    `config` is the library's normalised config (primary key names)."""
    source = _Source(weights, prefix)
    d = config["hidden_size"]
    l = config["moe_latent_size"]
    num_experts = config["n_routed_experts"]
    outputs = num_experts + config["zero_expert_num"]
    inter = config["moe_intermediate_size"]
    shared_inter = config["shared_expert_intermediate_size"]
    gated = config["hidden_act"] != "relu2"
    shared = shared_inter > 0
    mxfp4 = "quantization_config" in config
    inter_r, shared_r = inter // tp, shared_inter // tp
    i0, i1 = rank * inter_r, (rank + 1) * inter_r
    s0, s1 = rank * shared_r, (rank + 1) * shared_r
    f32 = torch.float32

    # Every tensor is checked before anything is copied: a config that disagrees with the weights fails on
    # the shape, not after building gigabytes of stacked experts.
    found = {
        "gate": source.find("gate.weight", (outputs, d), False),
        "score_bias": source.find("gate.e_score_correction_bias", (outputs,), False),
        "down_proj": source.find("routed_expert_down_proj.weight", (l, d), True, alias="fc1_latent_proj.weight"),
        "up_proj": source.find("routed_expert_up_proj.weight", (d, l), True, alias="fc2_latent_proj.weight"),
    }
    if config["latent_moe_use_norm"]:
        found["latent_norm"] = source.find("routed_expert_norm.weight", (l,), True)
    projections = [("gate", "gate_proj", "w1", (inter, l))] if gated else []
    projections += [("up", "up_proj", "w3", (inter, l)), ("down", "down_proj", "w2", (l, inter))]
    experts = {field: [] for field, *_ in projections}
    scales = {field: [] for field, *_ in projections}
    for e in range(num_experts):
        for field, dense_name, mxfp4_name, (rows, cols) in projections:
            dense = f"experts.{e}.{dense_name}.weight"
            packed = f"experts.{e}.{mxfp4_name}.weight_packed"
            if mxfp4:
                if not source.has(packed) and source.has(dense):
                    raise ValueError(
                        "weights: the config declares MXFP4 experts (quantization_config) but the weights hold dense expert "
                        f"tensors: {prefix}{dense} instead of {prefix}{packed}"
                    )
                experts[field].append(source.find(packed, (rows, cols // 2), True, packed=True))
                scale = f"experts.{e}.{mxfp4_name}.weight_scale"
                scales[field].append(source.find(scale, (rows, cols // MXFP4_GROUP), True, packed=True))
            else:
                if not source.has(dense) and source.has(packed):
                    raise ValueError(
                        f"weights: the weights hold MXFP4 expert tensors ({prefix}{packed}) but the config declares dense "
                        f"experts (no quantization_config covering them); expected {prefix}{dense}"
                    )
                experts[field].append(source.find(dense, (rows, cols), True))
    if shared:
        if gated:
            found["shared_gate"] = source.find("shared_experts.gate_proj.weight", (shared_inter, d), True)
        found["shared_up"] = source.find("shared_experts.up_proj.weight", (shared_inter, d), True)
        found["shared_down"] = source.find("shared_experts.down_proj.weight", (d, shared_inter), True)

    out = {}
    out["gate"] = _place(found["gate"], f32, device)
    out["score_bias"] = _place(found["score_bias"], f32, device)
    out["down_proj"] = _place(found["down_proj"], dtype, device)
    out["up_proj"] = _place(found["up_proj"], dtype, device)
    out["latent_norm"] = _place(found.get("latent_norm"), f32, device)

    def stack(tensors, out_dtype, rows_of):
        """[E, ...] of each expert's block: rows_of(tensor) selects this rank's rows or columns."""
        first = rows_of(tensors[0])
        stacked = torch.empty((len(tensors),) + tuple(first.shape), dtype=out_dtype, device=device)
        for e, tensor in enumerate(tensors):
            stacked[e].copy_(rows_of(tensor))
        return stacked

    code_order = _lib.MXFP4_ORDER_CANONICAL
    if num_experts > 0:
        row_block = lambda t: t[i0:i1]  # noqa: E731  gate/up: this rank's rows of I
        if mxfp4:
            # Down: the same input columns of I, i.e. packed columns [i0/2, i1/2) and scale groups [i0/32, i1/32).
            down_codes = lambda t: t[:, i0 // 2 : i1 // 2]  # noqa: E731
            down_scales = lambda t: t[:, i0 // MXFP4_GROUP : i1 // MXFP4_GROUP]  # noqa: E731
            for field in experts:
                codes, groups = (down_codes, down_scales) if field == "down" else (row_block, row_block)
                out[f"expert_{field}"] = stack(experts[field], torch.uint8, codes)
                out[f"expert_{field}_scale"] = stack(scales[field], torch.uint8, groups)
                if device.type == "cuda":  # the stacked codes are ours: into the order the kernels read
                    mxfp4_to_kernel_order(out[f"expert_{field}"])
                    code_order = _lib.MXFP4_ORDER_KERNEL
        else:
            for field in experts:
                block = (lambda t: t[:, i0:i1]) if field == "down" else row_block
                out[f"expert_{field}"] = stack(experts[field], dtype, block)
    if shared:
        if gated:
            out["shared_gate"] = _place(found["shared_gate"][s0:s1], dtype, device)
        out["shared_up"] = _place(found["shared_up"][s0:s1], dtype, device)
        out["shared_down"] = _place(found["shared_down"][:, s0:s1], dtype, device)
    return {name: tensor for name, tensor in out.items() if tensor is not None}, code_order

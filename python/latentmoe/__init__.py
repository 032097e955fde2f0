"""latentmoe for PyTorch engines: the MoE block of latent-MoE models (Kimi K3, Nemotron 3) and its fused tail
under tensor parallelism, as torch custom ops (torch.ops.latentmoe.layer_forward, tail_forward).

    ctx = latentmoe.RankContext(device="cuda:0", max_tokens=4096, group=None)
    ctxs = latentmoe.simulated_group(tp=4, device="cuda:0", max_tokens=4096)
    layer = latentmoe.LatentMoE(config, weights, ctx)
    layer = latentmoe.LatentMoE.from_pretrained(path, ctx, prefix="model.layers.3.mlp.")
    out, topk_ids, topk_weights = layer(hidden_states, router_logits=None, latent_states=None, tier="auto")
    tail = latentmoe.LatentTail(norm_weight, up_weight, ctx, eps=1e-5)
    out = tail(shared_partial, latent_partial, tier="auto")

docs/PYTHON.md: the binding (a C ABI through ctypes: one build for every Python >= 3.10 and PyTorch >= 2.6),
the ops' contract, groups, errors (ValueError for bad input, RuntimeError otherwise) and the host cost.
"""

import os

import torch

# Ranks simulated on one GPU spin on each other, so CUDA must load every kernel up front and give each
# rank's streams hardware queues of their own (latentmoe/gpu_group.h). Both are read when CUDA starts:
# set them now unless the caller has, or CUDA is already running (then the library's checks say what is
# missing when a simulated group is built). Processes with one rank per GPU need neither, and may set
# CUDA_MODULE_LOADING=LAZY before importing latentmoe to keep PyTorch's lazy loading.
if not torch.cuda.is_initialized():
    os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

from . import _lib  # noqa: E402  (after torch: its libnccl and cuBLAS are the process's)
from . import _ops  # noqa: E402,F401  (registers torch.ops.latentmoe.*)
from .context import RankContext, simulated_group  # noqa: E402
from ._weights import mxfp4_to_kernel_order  # noqa: E402
from .layer import LatentMoE, LatentTail  # noqa: E402

__version__ = _lib.VERSION
TIERS = ("native", "tail_fusion", "allreduce_overlap", "column_parallel")


def build_info():
    """What this build of the library has: version, library path, ABI version, CUDA, NCCL (and the release
    it was built against), the CUDA devices it sees."""
    return _lib.build_info()


def normalize_config(config):
    """A config (dict or JSON text, Hugging Face keys and aliases) parsed and validated by the library, as a
    dict with the primary key names."""
    return _lib.normalize_config(config)


__all__ = [
    "RankContext",
    "simulated_group",
    "LatentMoE",
    "LatentTail",
    "TIERS",
    "build_info",
    "normalize_config",
    "mxfp4_to_kernel_order",
    "__version__",
]

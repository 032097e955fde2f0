"""The C ABI of latentmoe (include/latentmoe/c_api.h) through ctypes.

One shared library, liblatentmoe_capi.so, serves every CPython and every PyTorch: nothing here is
compiled against either. ctypes.CDLL releases the GIL for the duration of each foreign call, so ranks
driven by threads run their collectives concurrently.

Loading order matters on CUDA builds: torch is imported first, so that the libnccl.so.2 and cuBLAS the
process holds are PyTorch's (the library is linked against their sonames and the loader reuses a library
already loaded); cuBLAS missing from the loader's search path is then preloaded from the NVIDIA wheels'
folders. LATENTMOE_LIBRARY, when set, names another build of the library (a build tree's), read once here.
"""

import ctypes
import importlib.util
import json
import os

import torch

ABI_VERSION = 3

OK = 0
INVALID_ARGUMENT = 1
RUNTIME_ERROR = 2

DTYPE_AUTO = -1
_DTYPE_CODES = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.float16: 2,
    torch.int32: 3,
    torch.uint8: 4,
}
DTYPES_BY_CODE = {code: dtype for dtype, code in _DTYPE_CODES.items()}
DTYPE_F32 = 0
DTYPE_I32 = 3
COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

DEVICE_CPU = 0
DEVICE_CUDA = 1

TIER_AUTO = -1
TIER_CODES = {"native": 0, "tail_fusion": 1, "allreduce_overlap": 2, "column_parallel": 3}
TIER_NAMES = {code: name for name, code in TIER_CODES.items()}

NCCL_UNIQUE_ID_BYTES = 128

# lmoe_layer_weights.expert_code_order (latentmoe::Mxfp4CodeOrder).
MXFP4_ORDER_CANONICAL = 0
MXFP4_ORDER_KERNEL = 1


class Tensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("dtype", ctypes.c_int32),
        ("ndim", ctypes.c_int32),
        ("shape", ctypes.c_int64 * 4),
        ("strides", ctypes.c_int64 * 4),
        ("device_type", ctypes.c_int32),
        ("device_index", ctypes.c_int32),
    ]


class BuildInfo(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("has_cuda", ctypes.c_int32),
        ("has_nccl", ctypes.c_int32),
        ("nccl_version_code", ctypes.c_int32),
        ("cuda_device_count", ctypes.c_int32),
    ]


class ContextOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("device_type", ctypes.c_int32),
        ("device_index", ctypes.c_int32),
        ("max_tokens", ctypes.c_int64),
    ]


class ContextInfo(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("tp", ctypes.c_int32),
        ("rank", ctypes.c_int32),
        ("device_type", ctypes.c_int32),
        ("device_index", ctypes.c_int32),
        ("max_tokens", ctypes.c_int64),
        ("num_layers", ctypes.c_int32),
        ("frozen", ctypes.c_int32),
    ]


class TierPolicy(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("tail_fusion_max_tokens", ctypes.c_int64),
        ("shared_stream_token_threshold", ctypes.c_int64),
        ("disable_shared_stream", ctypes.c_int32),
        ("disable_tail_fusion", ctypes.c_int32),
    ]


WEIGHT_FIELDS = (
    "gate",
    "score_bias",
    "down_proj",
    "latent_norm",
    "up_proj",
    "expert_gate",
    "expert_up",
    "expert_down",
    "expert_gate_scale",
    "expert_up_scale",
    "expert_down_scale",
    "shared_gate",
    "shared_up",
    "shared_down",
)


class LayerWeights(ctypes.Structure):
    _fields_ = (
        [("struct_size", ctypes.c_uint32), ("dtype", ctypes.c_int32)]
        + [(name, Tensor) for name in WEIGHT_FIELDS]
        + [("expert_code_order", ctypes.c_int32)]
    )


class LayerInfo(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("dtype", ctypes.c_int32),
        ("device_type", ctypes.c_int32),
        ("device_index", ctypes.c_int32),
        ("has_gate", ctypes.c_int32),
        ("hidden_size", ctypes.c_int64),
        ("latent_size", ctypes.c_int64),
        ("top_k", ctypes.c_int64),
        ("num_router_outputs", ctypes.c_int64),
        ("max_tokens", ctypes.c_int64),
    ]


def sized(structure):
    """A new `structure` with struct_size set."""
    value = structure()
    value.struct_size = ctypes.sizeof(structure)
    return value


# --- loading -----------------------------------------------------------------------------------------

_LIBRARY_NAME = "liblatentmoe_capi.so"
# What a CUDA build of the library needs beyond the C and C++ runtimes, and where NVIDIA's wheels keep
# it (CUDA 13 wheels in nvidia/cu13/lib, older ones in a folder per library).
_CUDA_DEPENDENCIES = (
    ("libcublasLt.so.13", ("cu13/lib", "cublas/lib")),
    ("libcublas.so.13", ("cu13/lib", "cublas/lib")),
    ("libnccl.so.2", ("nccl/lib",)),
)


def _nvidia_folders():
    spec = importlib.util.find_spec("nvidia")
    if spec is None or spec.submodule_search_locations is None:
        return []
    return list(spec.submodule_search_locations)


def _preload_cuda_dependencies():
    """Loads (RTLD_GLOBAL) each CUDA library the loader cannot find by itself from the NVIDIA wheels."""
    for soname, subfolders in _CUDA_DEPENDENCIES:
        try:
            ctypes.CDLL(soname, mode=ctypes.RTLD_GLOBAL)
            continue
        except OSError:
            pass
        for root in _nvidia_folders():
            for sub in subfolders:
                candidate = os.path.join(root, sub, soname)
                if os.path.exists(candidate):
                    ctypes.CDLL(candidate, mode=ctypes.RTLD_GLOBAL)
                    break
            else:
                continue
            break


def _load():
    path = os.environ.get("LATENTMOE_LIBRARY") or os.path.join(os.path.dirname(__file__), _LIBRARY_NAME)
    if not os.path.exists(path):
        raise ImportError(f"latentmoe: the C ABI library {path} is missing (is the package built? pip install .)")
    try:
        return ctypes.CDLL(path)
    except OSError as first:
        # A CUDA build whose cuBLAS or NCCL the loader does not find: take them from NVIDIA's wheels.
        _preload_cuda_dependencies()
        try:
            return ctypes.CDLL(path)
        except OSError:
            raise ImportError(f"latentmoe: cannot load {path}: {first}") from None


lib = _load()
LIBRARY_PATH = lib._name

_c_int = ctypes.c_int
_ptr = ctypes.c_void_p
_signatures = {
    "lmoe_abi_version": (ctypes.c_int32, []),
    "lmoe_version": (ctypes.c_char_p, []),
    "lmoe_last_error": (ctypes.c_char_p, []),
    "lmoe_get_build_info": (_c_int, [ctypes.POINTER(BuildInfo)]),
    "lmoe_config_normalize": (_c_int, [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]),
    "lmoe_config_check_parallel": (_c_int, [ctypes.c_char_p, ctypes.c_int32]),
    "lmoe_context_create": (_c_int, [ctypes.POINTER(ContextOptions), ctypes.POINTER(_ptr)]),
    "lmoe_simulated_group_create": (_c_int, [ctypes.c_int32, ctypes.POINTER(ContextOptions), ctypes.POINTER(_ptr)]),
    "lmoe_nccl_unique_id": (_c_int, [ctypes.c_char_p, ctypes.c_size_t]),
    "lmoe_nccl_check": (_c_int, []),
    "lmoe_context_create_nccl": (
        _c_int,
        [ctypes.POINTER(ContextOptions), ctypes.c_int32, ctypes.c_int32, ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(_ptr)],
    ),
    "lmoe_context_create_from_nccl_comm": (_c_int, [ctypes.POINTER(ContextOptions), _ptr, ctypes.POINTER(_ptr)]),
    "lmoe_context_destroy": (_c_int, [_ptr]),
    "lmoe_context_get_info": (_c_int, [_ptr, ctypes.POINTER(ContextInfo)]),
    "lmoe_context_check": (_c_int, [_ptr]),
    "lmoe_context_abort": (_c_int, [_ptr]),
    "lmoe_layer_create": (_c_int, [_ptr, ctypes.c_char_p, ctypes.POINTER(LayerWeights), ctypes.POINTER(TierPolicy), ctypes.POINTER(_ptr)]),
    "lmoe_layer_load": (
        _c_int,
        [_ptr, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int32, ctypes.POINTER(TierPolicy), ctypes.POINTER(_ptr)],
    ),
    "lmoe_mxfp4_to_kernel_order": (_c_int, [ctypes.POINTER(Tensor), _ptr]),
    "lmoe_layer_destroy": (_c_int, [_ptr]),
    "lmoe_layer_get_info": (_c_int, [_ptr, ctypes.POINTER(LayerInfo)]),
    "lmoe_layer_select_tier": (_c_int, [_ptr, ctypes.c_int64, ctypes.POINTER(ctypes.c_int32)]),
    "lmoe_layer_describe_tiers": (_c_int, [_ptr, ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]),
    "lmoe_layer_forward": (
        _c_int,
        [_ptr] + [ctypes.POINTER(Tensor)] * 6 + [ctypes.c_int32, _ptr, ctypes.POINTER(ctypes.c_int32)],
    ),
    "lmoe_tail_create": (
        _c_int,
        [_ptr, ctypes.c_int64, ctypes.c_int64, ctypes.POINTER(Tensor), ctypes.POINTER(Tensor), ctypes.c_double, ctypes.c_int32,
         ctypes.POINTER(TierPolicy), ctypes.POINTER(_ptr)],
    ),
    "lmoe_tail_destroy": (_c_int, [_ptr]),
    "lmoe_tail_select_tier": (_c_int, [_ptr, ctypes.c_int64, ctypes.POINTER(ctypes.c_int32)]),
    "lmoe_tail_describe_tiers": (_c_int, [_ptr, ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]),
    "lmoe_tail_forward": (
        _c_int,
        [_ptr] + [ctypes.POINTER(Tensor)] * 3 + [ctypes.c_int32, _ptr, ctypes.POINTER(ctypes.c_int32)],
    ),
}
for _name, (_restype, _argtypes) in _signatures.items():
    _function = getattr(lib, _name)
    _function.restype = _restype
    _function.argtypes = _argtypes

def function(name, restype, argtypes):
    """Another ctypes handle on the library's function `name` with its own signature."""
    handle = ctypes.CDLL(LIBRARY_PATH)[name]
    handle.restype = restype
    handle.argtypes = argtypes
    return handle


if lib.lmoe_abi_version() != ABI_VERSION:
    raise ImportError(
        f"latentmoe: {LIBRARY_PATH} has C ABI version {lib.lmoe_abi_version()}, this package speaks version "
        f"{ABI_VERSION}: the library and the Python sources come from different builds (reinstall the package)"
    )

VERSION = lib.lmoe_version().decode()


def check(status):
    """Raises the library's error for a failed call: ValueError for bad input, RuntimeError otherwise."""
    if status == OK:
        return
    message = lib.lmoe_last_error().decode("utf-8", errors="replace")
    if status == INVALID_ARGUMENT:
        raise ValueError(message)
    raise RuntimeError(message)


def read_text(function, *args):
    """A string the library writes into a caller's buffer (first asking how long it is)."""
    needed = ctypes.c_size_t(0)
    check(function(*args, None, 0, ctypes.byref(needed)))
    buffer = ctypes.create_string_buffer(needed.value)
    check(function(*args, buffer, needed.value, ctypes.byref(needed)))
    return buffer.value.decode()


def build_info():
    info = sized(BuildInfo)
    check(lib.lmoe_get_build_info(ctypes.byref(info)))
    return {
        "version": VERSION,
        "library": LIBRARY_PATH,
        "abi_version": ABI_VERSION,
        "cuda": bool(info.has_cuda),
        "nccl": bool(info.has_nccl),
        "nccl_version_code": info.nccl_version_code,
        "cuda_device_count": info.cuda_device_count,
    }


def normalize_config(config):
    """The config (a dict as config.json holds, or its JSON text) parsed and validated by the library, with
    the primary key names (docs/CONFIG.md)."""
    text = config if isinstance(config, str) else json.dumps(config)
    return json.loads(read_text(lib.lmoe_config_normalize, text.encode()))


def dtype_code(dtype, what):
    code = _DTYPE_CODES.get(dtype)
    if code is None:
        raise ValueError(f"{what} has dtype {dtype}, which latentmoe does not take (float32, bfloat16, float16, int32, uint8)")
    return code


def describe(tensor, what, out=None):
    """The C ABI's descriptor of a torch tensor (None: no tensor). Written into `out` when given."""
    desc = Tensor() if out is None else out
    if tensor is None:
        desc.ndim = 0
        return desc
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    ndim = tensor.dim()
    if ndim > 4:
        raise ValueError(f"{what} has {ndim} dimensions (at most 4)")
    device = tensor.device
    if device.type == "cpu":
        desc.device_type, desc.device_index = DEVICE_CPU, 0
    elif device.type == "cuda":
        desc.device_type, desc.device_index = DEVICE_CUDA, device.index
    else:
        raise ValueError(f"{what} is on {device}, which latentmoe does not run on (cpu, cuda)")
    desc.data = tensor.data_ptr()
    desc.dtype = dtype_code(tensor.dtype, what)
    desc.ndim = ndim
    for i, (extent, stride) in enumerate(zip(tensor.shape, tensor.stride())):
        desc.shape[i] = extent
        desc.strides[i] = stride
    return desc


def tier_code(tier):
    """'auto' (or None), a tier's name, or its code (-1 auto, 0 native, 1 tail_fusion, 2 allreduce_overlap,
    3 column_parallel)."""
    if tier is None or tier == "auto":
        return TIER_AUTO
    if isinstance(tier, str):
        code = TIER_CODES.get(tier)
        if code is None:
            raise ValueError(f"unknown tier '{tier}' (expected auto, native, tail_fusion, allreduce_overlap or column_parallel)")
        return code
    if isinstance(tier, int) and not isinstance(tier, bool) and -1 <= tier <= 3:
        return tier
    raise ValueError(f"unknown tier {tier!r} (expected auto, native, tail_fusion, allreduce_overlap, column_parallel or -1..3)")


def policy_struct(policy):
    """A TierPolicy from a dict of latentmoe.TierPolicy's knobs (None: the defaults)."""
    if policy is None:
        return None
    known = ("tail_fusion_max_tokens", "shared_stream_token_threshold", "disable_shared_stream", "disable_tail_fusion")
    unknown = sorted(set(policy) - set(known))
    if unknown:
        raise ValueError(f"unknown tier policy knob(s) {', '.join(unknown)} (expected {', '.join(known)})")
    value = sized(TierPolicy)
    value.tail_fusion_max_tokens = int(policy.get("tail_fusion_max_tokens", -1))
    value.shared_stream_token_threshold = int(policy.get("shared_stream_token_threshold", -1))
    flag = lambda name: -1 if name not in policy else int(bool(policy[name]))  # noqa: E731
    value.disable_shared_stream = flag("disable_shared_stream")
    value.disable_tail_fusion = flag("disable_tail_fusion")
    return value

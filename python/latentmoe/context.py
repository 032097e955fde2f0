"""Per-rank contexts (latentmoe::RankContext): a rank alone, the ranks of a group in this process, and one
rank per process over NCCL from a torch.distributed process group or the caller's ncclComm_t."""

import ctypes
import weakref

import torch

from . import _lib
from ._lib import check, lib


def _parse_device(device):
    device = torch.device(device)
    if device.type == "cpu":
        return device, _lib.DEVICE_CPU, 0
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.device("cuda", index), _lib.DEVICE_CUDA, index
    raise ValueError(f"device {device}: latentmoe runs on cpu or cuda")


def _options(device_type, device_index, max_tokens):
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise ValueError(f"max_tokens must be an int, got {max_tokens!r}")
    options = _lib.sized(_lib.ContextOptions)
    options.device_type = device_type
    options.device_index = device_index
    options.max_tokens = max_tokens
    return options


class RankContext:
    """One tensor-parallel rank: its backend, the scratch its layers share, and its communicator.

    RankContext(device="cuda:0", max_tokens=4096, group=None)
        group None: tp 1. group: a torch.distributed ProcessGroup of the tp ranks, one process per GPU: rank 0
        makes an NCCL id, sends it over the group, and every rank initialises latentmoe's own NCCL communicator
        (NCCL_NVLS_ENABLE=0 must be set in the environment; the libnccl PyTorch loaded must be the release
        latentmoe was built against). Collective: every rank of the group makes its context together.
    RankContext(device="cuda:0", max_tokens=4096, nccl_comm=int(comm))
        over the caller's ncclComm_t (not owned: it must outlive the context).

    Build every layer and tail of a context before the first forward through it. Each context is used by
    one thread at a time.
    """

    def __init__(self, device="cpu", max_tokens=4096, group=None, *, nccl_comm=None):
        self.device, device_type, device_index = _parse_device(device)
        options = _options(device_type, device_index, max_tokens)
        handle = ctypes.c_void_p()
        if group is not None and nccl_comm is not None:
            raise ValueError("give a process group or an NCCL communicator, not both")
        if nccl_comm is not None:
            if device_type != _lib.DEVICE_CUDA:
                raise ValueError(f"an NCCL communicator needs a CUDA device, not {self.device}")
            check(lib.lmoe_context_create_from_nccl_comm(ctypes.byref(options), ctypes.c_void_p(int(nccl_comm)), ctypes.byref(handle)))
        elif group is not None:
            if device_type != _lib.DEVICE_CUDA:
                raise ValueError(
                    f"RankContext(group=...) on {self.device}: process groups are supported on CUDA devices only (NCCL); "
                    "on the CPU use latentmoe.simulated_group(tp, 'cpu', max_tokens) (ranks as threads)"
                )
            if _group_size(group) > 1:
                _create_from_group(options, group, self.device, handle)
            else:  # one rank never communicates
                check(lib.lmoe_context_create(ctypes.byref(options), ctypes.byref(handle)))
        else:
            check(lib.lmoe_context_create(ctypes.byref(options), ctypes.byref(handle)))
        self._adopt(handle.value)

    @classmethod
    def _from_handle(cls, handle, device):
        self = cls.__new__(cls)
        self.device = device
        self._adopt(handle)
        return self

    def _adopt(self, handle):
        self._handle = handle
        self._finalizer = weakref.finalize(self, lib.lmoe_context_destroy, ctypes.c_void_p(handle))
        info = self._info()
        self.tp = info.tp
        self.rank = info.rank
        self.max_tokens = info.max_tokens

    def _info(self):
        info = _lib.sized(_lib.ContextInfo)
        check(lib.lmoe_context_get_info(ctypes.c_void_p(self._handle), ctypes.byref(info)))
        return info

    @property
    def handle(self):
        """The C ABI's lmoe_context* as an int."""
        return self._handle

    @property
    def num_layers(self):
        """Layers and tails built on this context and alive."""
        return self._info().num_layers

    @property
    def frozen(self):
        """Whether a forward has run through the context (its buffers no longer move)."""
        return bool(self._info().frozen)

    def check(self):
        """The communicator's check point (GPU groups): after synchronising this rank's stream, raises
        RuntimeError for a collective that failed on the device (a peer that never came, an abort)."""
        check(lib.lmoe_context_check(ctypes.c_void_p(self._handle)))

    def abort(self):
        """Gives up on the group after a failure on some rank: peers blocked in a collective, now or later,
        fail instead of waiting for their timeout."""
        check(lib.lmoe_context_abort(ctypes.c_void_p(self._handle)))

    def close(self):
        """Releases this handle; the context lives on while a layer or tail built on it does."""
        self._finalizer()

    def __repr__(self):
        return f"RankContext(device={self.device}, rank={self.rank}, tp={self.tp}, max_tokens={self.max_tokens})"


def simulated_group(tp, device="cpu", max_tokens=4096):
    """tp contexts in one process: on the CPU ranks as threads over an in-process group; on CUDA ranks
    simulated on one GPU (their collectives in its memory). Drive each context from its own thread, and on
    CUDA run each rank on a stream of its own (torch.cuda.Stream): the ranks' collectives wait for one
    another. A simulated GPU group needs CUDA_DEVICE_MAX_CONNECTIONS >= 4 tp and CUDA_MODULE_LOADING=EAGER
    set before CUDA starts (importing latentmoe first sets both), and is sized for the dtype and d + l of the
    first layer or tail built on any of its contexts."""
    if isinstance(tp, bool) or not isinstance(tp, int):
        raise ValueError(f"tp must be an int, got {tp!r}")
    device, device_type, device_index = _parse_device(device)
    options = _options(device_type, device_index, max_tokens)
    if tp < 1:
        raise ValueError(f"tp must be at least 1, got {tp}")
    handles = (ctypes.c_void_p * tp)()
    check(lib.lmoe_simulated_group_create(tp, ctypes.byref(options), handles))
    return [RankContext._from_handle(handles[r], device) for r in range(tp)]


def _group_size(group):
    import torch.distributed as dist

    return dist.get_world_size(group)


def _create_from_group(options, group, device, handle):
    """Rank 0 makes the NCCL id and broadcasts it over `group`; then every rank initialises its communicator.
    The checks that could refuse run on every rank first and the ranks agree on them, so that no rank waits
    in ncclCommInitRank for a peer that refused."""
    import torch.distributed as dist

    tp = dist.get_world_size(group)
    rank = dist.get_rank(group)
    backend = str(dist.get_backend(group)).lower()
    carrier = device if "nccl" in backend else torch.device("cpu")

    status = lib.lmoe_nccl_check()
    message = lib.lmoe_last_error().decode() if status != _lib.OK else ""
    failed = torch.tensor([0 if status == _lib.OK else 1], dtype=torch.int32, device=carrier)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    if status != _lib.OK:
        raise RuntimeError(message)
    if failed.item() != 0:
        raise RuntimeError("RankContext(group=...): another rank of the group refused to start NCCL (see its error)")

    # Byte 0: whether rank 0 made the id; then the id's bytes.
    payload = torch.zeros(1 + _lib.NCCL_UNIQUE_ID_BYTES, dtype=torch.uint8)
    error = ""
    if rank == 0:
        unique_id = ctypes.create_string_buffer(_lib.NCCL_UNIQUE_ID_BYTES)
        status = lib.lmoe_nccl_unique_id(unique_id, _lib.NCCL_UNIQUE_ID_BYTES)
        if status == _lib.OK:
            payload[0] = 1
            payload[1:] = torch.frombuffer(bytearray(unique_id.raw), dtype=torch.uint8)
        else:
            error = lib.lmoe_last_error().decode()
    payload = payload.to(carrier)
    dist.broadcast(payload, src=dist.get_global_rank(group, 0), group=group)
    payload = payload.cpu()
    if int(payload[0]) != 1:
        raise RuntimeError(error or "RankContext(group=...): rank 0 could not make the NCCL id (see its error)")
    unique_id = bytes(payload[1:].tolist())
    check(lib.lmoe_context_create_nccl(ctypes.byref(options), tp, rank, unique_id, len(unique_id), ctypes.byref(handle)))

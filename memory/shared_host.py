"""One host copy of the frozen weights for all the ranks of one machine (torchrun data parallel).

Every rank loads the same base model, so N local ranks would hold N host copies of it. Instead local rank 0 copies
its frozen host weights into one file in /dev/shm (space reserved with posix_fallocate, so a full /dev/shm is an
error, not a SIGBUS), the other local ranks check that their own weights equal it byte for byte and map the same
file, and every rank points its parameters at views of the mapping and drops its own copy. The ranks' offloaded
blocks then stream from that one copy (layer_offload streams in place; host_pinning page-locks the mapping once per
process), and the run's undo gives each parameter back the same shared view: no copy at either end. A /dev/shm
without room for the copy (Docker's default is 64 MB) leaves every rank its own copy, with a warning naming the fix.

The file is unlinked as soon as every rank has mapped it (in `finally`, also when a rank failed), so nothing is left
in /dev/shm whatever happens next: the memory lives as long as some process maps it. Only a rank killed within those
seconds (SIGKILL) leaves the file behind; the next run on the machine removes such files (`sweep_stale`).
Parameters already in such a mapping (a second training run in the same processes) are left as they are. Shared are
the parameters that are frozen, in host memory, plain contiguous tensors; anything else (trainable LoRA weights,
quantized tensor subclasses) stays private. Frozen weights are never written during training, so sharing them
changes no result.
"""
from __future__ import annotations

import os
import time
import uuid
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from .process_maps import mappings
from .strategy import StrategyError

SHM_DIR = "/dev/shm"
PREFIX = "tightrope-weights-"
SHM_MARGIN = 16 << 20  # bytes left free in /dev/shm beyond the copy (other programs' shared memory)
STALE_AFTER_S = 3600.0  # a file older than this in /dev/shm was left by a killed run (sharing takes seconds)
_ALIGN = 256  # bytes: every view aligned for any dtype and for vectorised kernels


class SharedWeightsError(StrategyError):
    """The ranks of one machine could not share one host copy of the frozen weights (they loaded different models,
    or /dev/shm cannot hold it); the message says why. A user error: `tightrope run` prints it without a traceback."""


@dataclass
class SharedHostWeights:
    path: str                      # the /dev/shm file (already unlinked when share_host_weights returns)
    storage: torch.UntypedStorage  # the mapping
    params: list[nn.Parameter]     # the parameters now viewing it

    @property
    def nbytes(self) -> int:
        return self.storage.nbytes()


def shareable(p: torch.Tensor) -> bool:
    return (not p.requires_grad and type(p.data) is torch.Tensor and p.device.type == "cpu" and p.is_contiguous()
            and p.numel() > 0)


def shared_mappings() -> list[tuple[int, int]]:
    """(start, end) of this process's mappings of files made by share_host_weights (from /proc/self/maps)."""
    return [(m.start, m.end) for m in mappings() or () if os.path.basename(m.path).startswith(PREFIX)]


def params_to_share(model: nn.Module) -> list[nn.Parameter]:
    """The model's shareable parameters (each once, in model order) not already in a shared mapping."""
    mapped = shared_mappings()
    seen, out = set(), []
    for p in model.parameters():
        if id(p) in seen or not shareable(p):
            continue
        seen.add(id(p))
        if not any(a <= p.data_ptr() < b for a, b in mapped):
            out.append(p)
    return out


def _layout(params: list[nn.Parameter]) -> tuple[list[int], int]:
    offsets, n = [], 0
    for p in params:
        offsets.append(n)
        n += -(-p.numel() * p.element_size() // _ALIGN) * _ALIGN
    return offsets, max(n, _ALIGN)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def share_host_weights(model: nn.Module, *, local_rank: int, token: str,
                       exchange: Callable[[Any], list[Any]], folder: str = SHM_DIR) -> SharedHostWeights | None:
    """Point `model`'s shareable parameters at one shared copy per machine. Collective: every rank calls it with the
    same `token`; `exchange(x)` gathers x from every rank (all_gather_object) and doubles as a barrier. Returns None
    when there is nothing left to share. On any rank's failure every rank raises SharedWeightsError and no parameter
    has been touched."""
    if local_rank == 0:
        sweep_stale(folder)
    params = params_to_share(model)
    offsets, nbytes = _layout(params)
    sizes = exchange(nbytes if params else 0)
    if not any(sizes):
        return None
    if len(set(sizes)) != 1:
        raise SharedWeightsError(f"the ranks hold different frozen weights to share ({sorted(set(sizes))} bytes): "
                                 "every rank must load the same base model")
    free = _free_bytes(folder) if local_rank == 0 else None
    short = [f for f in exchange(free) if f is not None and f < nbytes + SHM_MARGIN]
    if short:  # each machine's local rank 0 looked: one copy per rank is slower to set up, not wrong
        warnings.warn(f"tightrope: {folder} has {min(short) / 2**30:.2f} GiB free and one host copy of the frozen "
                      f"weights needs {nbytes / 2**30:.2f} GiB: every rank keeps its own copy in host RAM; to share "
                      "one, give the machine or container more shared memory (e.g. docker run --shm-size=...G, or "
                      "--ipc=host)", RuntimeWarning, stacklevel=2)
        return None
    path = os.path.join(folder, f"{PREFIX}{token}")
    storage, error = None, None
    try:
        if local_rank == 0:
            try:
                storage = _create(path, nbytes, params, offsets)
            except (OSError, RuntimeError) as e:
                error = f"local rank 0 could not write {nbytes / 2**30:.2f} GiB to {path}: {e}"
        _agree(exchange, error)
        if local_rank != 0:
            try:
                storage = _map_and_check(path, nbytes, params, offsets)
            except (OSError, RuntimeError, SharedWeightsError) as e:
                error = f"local rank {local_rank}: {e}"
        _agree(exchange, error)
    finally:
        if local_rank == 0 and os.path.exists(path):
            os.unlink(path)
    flat = torch.empty(0, dtype=torch.uint8).set_(storage)
    for p, off in zip(params, offsets):
        n = p.numel() * p.element_size()
        p.data = flat[off: off + n].view(p.dtype).view(p.shape)
    return SharedHostWeights(path, storage, params)


def sweep_stale(folder: str = SHM_DIR, older_than_s: float = STALE_AFTER_S) -> list[str]:
    """Remove shared-weights files a killed run left in `folder` (a file lives there only while its ranks map it,
    seconds, so one older than `older_than_s` has no run left to map it: it would hold its size of RAM until reboot).
    Returns the paths removed, each said in one warning line."""
    removed = []
    try:
        names = [n for n in os.listdir(folder) if n.startswith(PREFIX)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(folder, name)
        try:
            st = os.stat(path)
            if time.time() - st.st_mtime < older_than_s:
                continue
            os.unlink(path)
        except OSError:  # gone meanwhile, or another user's
            continue
        removed.append(path)
        warnings.warn(f"tightrope: removed {path} ({st.st_size / 2**30:.2f} GiB of shared memory), left by a run that "
                      "was killed while its ranks shared their weights", RuntimeWarning, stacklevel=2)
    return removed


def _free_bytes(folder: str) -> int | None:
    """Bytes free in the file system of `folder` (None where it cannot be read: creating the file then says why)."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _create(path: str, nbytes: int, params: list[nn.Parameter], offsets: list[int]) -> torch.UntypedStorage:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)  # tmpfs pages reserved now: ENOSPC here, not SIGBUS while copying
    finally:
        os.close(fd)
    storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=nbytes)
    flat = torch.empty(0, dtype=torch.uint8).set_(storage)
    for p, off in zip(params, offsets):
        src = _bytes(p.data)
        flat[off: off + src.numel()].copy_(src)
    return storage


def _map_and_check(path: str, nbytes: int, params: list[nn.Parameter], offsets: list[int]) -> torch.UntypedStorage:
    size = os.stat(path).st_size
    if size != nbytes:
        raise SharedWeightsError(f"{path} holds {size} bytes, this rank's weights {nbytes}: every rank must load "
                                 "the same base model")
    storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=nbytes)
    flat = torch.empty(0, dtype=torch.uint8).set_(storage)
    for p, off in zip(params, offsets):
        own = _bytes(p.data)
        if not torch.equal(flat[off: off + own.numel()], own):
            raise SharedWeightsError(f"a frozen weight of shape {tuple(p.shape)} differs from local rank 0's: every "
                                     "rank must load the same base model (same file, weight_dtype and seed)")
    return storage


def _agree(exchange: Callable[[Any], list[Any]], error: str | None) -> None:
    errors = [e for e in exchange(error) if e]
    if errors:
        raise SharedWeightsError("sharing one host copy of the frozen weights between the ranks of this machine "
                                 "failed: " + "; ".join(errors))


def share_across_local_ranks(model: nn.Module, local_rank: int) -> SharedHostWeights | None:
    """share_host_weights over the initialised default process group, when torchrun started several ranks on this
    machine (LOCAL_WORLD_SIZE > 1, as rank 0 sees it) and /dev/shm exists; else None, nothing touched."""
    dist = torch.distributed
    box = [None]
    if dist.get_rank() == 0 and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1 and os.path.isdir(SHM_DIR):
        box[0] = uuid.uuid4().hex
    dist.broadcast_object_list(box, src=0)
    if box[0] is None:
        return None

    def exchange(x: Any) -> list[Any]:
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, x)
        return out
    return share_host_weights(model, local_rank=local_rank, token=box[0], exchange=exchange)

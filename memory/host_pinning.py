"""Page-locking host memory in place (cudaHostRegister), so weights that already sit in host memory stream to the GPU
asynchronously without a second, pinned copy, and without the caching host allocator (which rounds every pinned
allocation up to a power of two and keeps it cached for the life of the process).

- Only the pages that lie wholly inside one storage are registered (`interior_ranges`). A page shared with anything
  else stays pageable: the driver pins whole pages, and a copy whose host buffer is partly inside a registered range
  and partly outside it fails with "invalid argument" (seen on the first H100 run, 2026-11-23, when ranges were
  widened to whole pages: small tensors that malloc put next to a weight, such as `grad.cpu()`'s result, could no
  longer be copied). So no other allocation ever shares a registered page, and the offloader splits each weight's
  copy where its storage's registered interior begins and ends (`split`).
- Each interior is registered in page-aligned chunks of at most `CHUNK_BYTES`, keeping those the driver accepts. The
  driver pins a range all or nothing (one it can pin only in part, as long-term pinning's page migration may leave
  it, is refused as a whole: "invalid argument"; some drivers refuse very large calls), so one refused chunk leaves
  only itself pageable, not the whole model (under shared_host all weights are one storage). `split` cuts at every
  registered edge, so no copy spans two registrations either.
- Memory someone else already pinned (ComfyUI's own pinned weights, a torch pinned tensor) is left as it is.
- A private mapping of a file (ComfyUI's dynamic VRAM maps the model file read-only and private; safetensors'
  zero-copy tensors are a private writable mapping) is only ever registered read-only: a pin for device writes would
  break copy-on-write on every page, a silent second copy of the weights in host RAM. Where the GPU/driver cannot
  pin read-only it stays pageable.
- A read-only mapping (ComfyUI's dynamic VRAM loads weights as a read-only mmap of the model file) cannot be pinned
  for device writes; a range the default registration refuses is registered again read-only
  (`cudaHostRegisterReadOnly`), which is all a host-to-device copy needs. Some GPUs/drivers lack that (error 801,
  cudaDevAttrHostRegisterReadOnlySupported = 0): such weights stream from pageable memory.
- Registration can be refused (read-only registration unsupported, host memory the driver can pin exhausted, WSL and
  Windows limits) or be impossible (a CPU-only torch): the memory stays pageable, host-to-device copies from it are
  staged by the driver, and one warning line says how much, why (the error of the attempt made last) and, where
  there is one, the fix. `ulimit -l` is none: on Linux NVIDIA's kernel module pins with pin_user_pages and charges
  nothing to RLIMIT_MEMLOCK. Every refused call's error is cleared at once, so it cannot surface at the next kernel
  launch.
- `release()` unregisters what this object registered (every chunk); the offloader calls it in `finally`. Until then
  the object holds the tensors it registered: freed while registered, their memory would come back from malloc to
  a later buffer that the driver still maps to the old pinned pages (copies from it would read stale data). An
  object dropped unreleased unregisters when it is collected (not at interpreter exit: CUDA may be gone by then).
"""
from __future__ import annotations

import bisect
import contextlib
import mmap
import warnings
import weakref
from typing import Any, Iterable

import torch

from .process_maps import mappings

ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered: pinned by someone else, who will unpin it
READ_ONLY = 8  # cudaHostRegisterReadOnly: the device only reads the range (every copy from a weight is host-to-device)
INVALID_VALUE, OUT_OF_MEMORY, NOT_SUPPORTED = 1, 2, 801  # cudaErrorInvalidValue, MemoryAllocation, NotSupported
CHUNK_BYTES = 2**30  # the most one cudaHostRegister call asks for (a multiple of every page size)
READ_ONLY_FIX = ("nothing to fix for a read-only mapping of a model file but to accept that speed; under ComfyUI, "
                 "--disable-dynamic-vram loads models into ordinary memory, which can be page-locked")


def storage_spans(tensors: Iterable[torch.Tensor]) -> set[tuple[int, int]]:
    """(address, nbytes) of the tensors' storages, each once."""
    return {(s.data_ptr(), s.nbytes()) for s in (t.untyped_storage() for t in tensors) if s.nbytes() > 0}


def interior_ranges(spans: Iterable[tuple[int, int]], page: int = mmap.PAGESIZE) -> list[tuple[int, int]]:
    """(start, nbytes) of the whole pages inside each (address, nbytes) span, sorted; spans under a page give none."""
    out = []
    for a, n in sorted(spans):
        start, end = -(-a // page) * page, (a + n) // page * page
        if end > start:
            out.append((start, end - start))
    return out


def page_aligned(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat host tensor whose bytes lie wholly inside whole pages of an allocation of its own: page-locking
    registers only whole pages, and a copy from a buffer partly outside them fails."""
    page = mmap.PAGESIZE
    raw = torch.empty(numel * dtype.itemsize + 2 * page, dtype=torch.uint8)
    start = -raw.data_ptr() % page
    return raw[start:start + numel * dtype.itemsize].view(dtype)


class PinnedRanges:
    """Host memory registered with CUDA for the duration of a run. `cudart` defaults to torch.cuda.cudart()."""

    def __init__(self, device: torch.device, cudart: Any = None, *, what: str = "host weights",
                 fallback: str = "streaming them from pageable memory"):
        """what, fallback: the refusal note's words for the memory and for what happens instead."""
        self.device = device
        self._words = (what, fallback)
        self._cudart = cudart
        self.registered: list[tuple[int, int]] = []
        self.refused_bytes = 0
        self.unregister_failures: list[str] = []
        self._holds: list[torch.Tensor] = []  # the registered memory's tensors: alive until it is unregistered
        weakref.finalize(self, _release_quietly, cudart, device, self.registered, self._holds,
                         self.unregister_failures).atexit = False

    def register(self, tensors: Iterable[torch.Tensor], *, read_only_ok: bool = True) -> None:
        """Page-lock the tensors' storages' interior pages. read_only_ok=False: never fall back to a read-only
        registration (for buffers the device writes into: gradients copied to the host)."""
        tensors = [t for t in tensors if not t.is_pinned()]
        if not tensors:
            return
        try:
            cudart = self._cudart or torch.cuda.cudart()
        except (AssertionError, RuntimeError) as e:  # CPU-only torch, or no driver
            self._note(sum(n for _, n in storage_spans(tensors)), f"CUDA runtime unavailable: {e}")
            return
        refused: dict[tuple[str, str], int] = {}  # (cause, fix) -> bytes left pageable
        chunk = max(mmap.PAGESIZE, CHUNK_BYTES // mmap.PAGESIZE * mmap.PAGESIZE)
        maps = mappings() or []
        registered_before = len(self.registered)
        for start, nbytes in interior_ranges(storage_spans(tensors)):
            for a, n in _chunks(start, nbytes, chunk):
                # a private mapping of a file (a model file mapped read-only by ComfyUI's dynamic VRAM; safetensors'
                # zero-copy tensors): only ever pinned read-only, as a pin for writes would copy it page by page
                # (copy on write: as much host RAM again, silently)
                file = read_only_ok and any(m.private_file for m in maps if m.start <= a < m.end)
                first = code = self._try(cudart, a, n, READ_ONLY if file else 0)
                # refused (not for want of memory: read-only pins the same pages): maybe a read-only mapping
                if not file and code not in (0, ALREADY_REGISTERED, OUT_OF_MEMORY) and read_only_ok:
                    code = self._try(cudart, a, n, READ_ONLY)  # a read-only mapping: the device only reads it
                if code == 0:
                    self.registered.append((a, n))
                elif code != ALREADY_REGISTERED:
                    read_only = code == NOT_SUPPORTED and (file or first == INVALID_VALUE)
                    writable = bool(maps) and all(m.writable for m in maps if m.overlaps(a, n))
                    if read_only and not file and writable:  # refused for another reason: the retry's 801 does not
                        read_only, code = False, first       # tell it
                    cause = _cause(cudart, code, read_only)
                    refused[cause] = refused.get(cause, 0) + n
        if len(self.registered) > registered_before:
            self._holds.extend(tensors)
        self.registered.sort()
        if refused:
            causes = [f"{_size(n)}: {cause}" if len(refused) > 1 else cause for (cause, _), n in refused.items()]
            self._note(sum(refused.values()), "; ".join(causes), "; ".join(dict.fromkeys(f for _, f in refused if f)))

    def _try(self, cudart: Any, start: int, nbytes: int, flags: int) -> int:
        with _current(self.device):
            code = int(cudart.cudaHostRegister(start, nbytes, flags))
        if code:  # every refusal, "already registered" too, sets the thread's last error
            _clear_last_error(self.device, _error_text(cudart, code))
        return code

    def release(self) -> None:
        """Unregister everything registered here (the caller has synchronised the copies reading from it), then let
        go of its tensors."""
        _release(self._cudart, self.device, self.registered, self._holds, self.unregister_failures)

    def split(self, address: int, nbytes: int) -> list[tuple[int, int]] | None:
        """Byte ranges [a, b) of the buffer at `address` that lie wholly inside or wholly outside the registered
        ranges, in order; None when the whole buffer is on one side (one copy will do)."""
        cuts, end = {0}, address + nbytes
        k = max(0, bisect.bisect_right(self.registered, (address, float("inf"))) - 1)
        for start, n in self.registered[k:]:
            if start >= end:
                break
            cuts.update(edge - address for edge in (start, start + n) if address < edge < end)
        cuts = sorted(cuts)  # adjacent ranges (chunks) share an edge: one cut, no empty part
        return None if len(cuts) == 1 else list(zip(cuts, cuts[1:] + [nbytes]))

    def copy(self, dst: torch.Tensor, src: torch.Tensor, host: torch.Tensor, non_blocking: bool) -> None:
        """dst.copy_(src) (one dtype, shape and strides) where `host`, dst or src, may lie in registered memory: in
        parts at every registration's edge, as the driver refuses a copy that spans one."""
        copy_parts(dst, src, self.split(host.data_ptr(), host.numel() * host.element_size()), non_blocking)

    @property
    def pinned_bytes(self) -> int:
        return sum(n for _, n in self.registered)

    def _note(self, nbytes: int, reason: str, fix: str = "") -> None:
        self.refused_bytes += nbytes
        what, fallback = self._words
        warnings.warn(f"tightrope: could not page-lock {_size(nbytes)} of {what} in place ({reason}); "
                      f"{fallback} (slower copies{'; ' + fix if fix else ''})",
                      RuntimeWarning, stacklevel=3)


def _current(device: torch.device):
    """`device` made the current CUDA device around a raw runtime call: registration without the portable flag is
    pinned memory for the current device's context only, and a release may run on a thread (the garbage
    collector's) whose current device is another (training on cuda:1, registered for cuda:0 the copies would be
    pageable ones)."""
    device = torch.device(device)
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _release(cudart: Any, device: torch.device, registered: list[tuple[int, int]], holds: list[torch.Tensor],
             failures: list[str]) -> None:
    """PinnedRanges.release over its lists, emptied in place (its finalizer holds them, never the object)."""
    if registered:
        cudart = cudart or torch.cuda.cudart()
        ranges = list(registered)
        registered.clear()
        failed = []
        for start, nbytes in ranges:
            with _current(device):
                code = int(cudart.cudaHostUnregister(start))
            if code:
                text = _error_text(cudart, code)
                _clear_last_error(device, text)  # else the next kernel launch anywhere raises it
                failed.append(f"{nbytes} B at {start:#x}: {text}, error {code}")
        if failed:
            failures += failed
            warnings.warn(f"tightrope: CUDA refused to unpin {len(failed)} host range(s) ({failed[0]}); "
                          "this is a bug, please report it", RuntimeWarning, stacklevel=3)
    holds.clear()  # after unregistering: only now may their memory be freed


def _release_quietly(cudart: Any, device: torch.device, registered: list[tuple[int, int]], holds: list[torch.Tensor],
                     failures: list[str]) -> None:
    """_release for a PinnedRanges collected unreleased: nothing here may raise into the garbage collector."""
    with contextlib.suppress(Exception):
        _release(cudart, device, registered, holds, failures)
    holds.clear()


def _chunks(start: int, nbytes: int, chunk: int) -> list[tuple[int, int]]:
    """[start, start + nbytes) as consecutive (start, nbytes) pieces of at most `chunk` bytes."""
    return [(a, min(chunk, start + nbytes - a)) for a in range(start, start + nbytes, chunk)]


def _cause(cudart: Any, code: int, read_only: bool) -> tuple[str, str]:
    """Why a registration whose last attempt gave `code` was refused, in words, and the user's fix ("": none).
    read_only: read-only memory, refused pinning for writes (1), then read-only registration as unsupported (801)."""
    error = f"{_error_text(cudart, code)}, error {code}"
    if read_only:
        return f"this GPU/driver cannot page-lock read-only memory: {error}", READ_ONLY_FIX
    if code == OUT_OF_MEMORY:
        return f"out of memory that can be page-locked: {error}", "free host RAM"
    if code == NOT_SUPPORTED:
        return f"this GPU/driver cannot page-lock host memory in place: {error}", ""
    return f"refused by the driver: {error}", ""


def _size(nbytes: int) -> str:
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.2f} GiB"
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


def _error_text(cudart: Any, code: int) -> str:
    return str(cudart.cudaGetErrorString(cudart.cudaError(code)))


def _clear_last_error(device: torch.device, text: str) -> None:
    """A refused cudaHostRegister leaves CUDA's per-thread last error set, and torch's check after the next kernel
    launch would raise it there. Launch a tiny kernel and swallow exactly that error, resetting the state."""
    try:
        torch.zeros(1, device=device)
    except RuntimeError as e:
        if text not in str(e):
            raise


def copy_parts(dst: torch.Tensor, src: torch.Tensor, parts: list[tuple[int, int]] | None, non_blocking: bool) -> None:
    """dst.copy_(src) for tensors of one dtype, shape and strides (dense), in the byte ranges `parts` if given."""
    if parts is None:
        dst.copy_(src, non_blocking=non_blocking)
        return
    d, s = _bytes(dst), _bytes(src)
    for a, b in parts:
        d[a:b].copy_(s[a:b], non_blocking=non_blocking)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A dense tensor's elements in memory order, as bytes."""
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8)

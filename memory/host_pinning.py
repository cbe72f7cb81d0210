"""Page-locking host memory in place (cudaHostRegister), so weights that already sit in host memory stream to the GPU
asynchronously without a second, pinned copy, and without the caching host allocator (which rounds every pinned
allocation up to a power of two and keeps it cached for the life of the process).

- Only the pages that lie wholly inside one storage are registered (`interior_ranges`). A page shared with anything
  else stays pageable: the driver pins whole pages, and a copy whose host buffer is partly inside a registered range
  and partly outside it fails with "invalid argument" (seen on the first H100 run, 2026-11-23, when ranges were
  widened to whole pages: small tensors that malloc put next to a weight, such as `grad.cpu()`'s result, could no
  longer be copied). So no other allocation ever shares a registered page, and the offloader splits each weight's
  copy where its storage's registered interior begins and ends (`split`).
- Memory someone else already pinned (ComfyUI's own pinned weights, a torch pinned tensor) is left as it is.
- A read-only mapping (ComfyUI's dynamic VRAM loads weights as a read-only mmap of the model file) cannot be pinned
  for device writes; a range the default registration refuses is registered again read-only
  (`cudaHostRegisterReadOnly`), which is all a host-to-device copy needs.
- Registration can be refused (`ulimit -l`, WSL and Windows limits, read-only registration unsupported) or be
  impossible (a CPU-only torch): the memory stays pageable, host-to-device copies from it are staged by the driver,
  and one warning line says so. Every refused call's error is cleared at once, so it cannot surface at the next
  kernel launch.
- `release()` unregisters what this object registered; the offloader calls it in `finally`.
"""
from __future__ import annotations

import bisect
import mmap
import warnings
from typing import Any, Iterable

import torch

ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered: pinned by someone else, who will unpin it
READ_ONLY = 8  # cudaHostRegisterReadOnly: the device only reads the range (every copy from a weight is host-to-device)


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


class PinnedRanges:
    """Host memory registered with CUDA for the duration of a run. `cudart` defaults to torch.cuda.cudart()."""

    def __init__(self, device: torch.device, cudart: Any = None):
        self.device = device
        self._cudart = cudart
        self.registered: list[tuple[int, int]] = []
        self.refused_bytes = 0
        self.unregister_failures: list[str] = []

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
        refused, reason = 0, ""
        for start, nbytes in interior_ranges(storage_spans(tensors)):
            code = self._try(cudart, start, nbytes, 0)
            if code not in (0, ALREADY_REGISTERED) and read_only_ok and \
                    self._try(cudart, start, nbytes, READ_ONLY) == 0:
                code = 0  # a read-only mapping: the device only reads it
            if code == 0:
                self.registered.append((start, nbytes))
            elif code != ALREADY_REGISTERED:
                refused += nbytes
                reason = f"{_error_text(cudart, code)}, error {code}"
        self.registered.sort()
        if refused:
            self._note(refused, reason)

    def _try(self, cudart: Any, start: int, nbytes: int, flags: int) -> int:
        code = int(cudart.cudaHostRegister(start, nbytes, flags))
        if code:  # every refusal, "already registered" too, sets the thread's last error
            _clear_last_error(self.device, _error_text(cudart, code))
        return code

    def release(self) -> None:
        """Unregister everything registered here (the caller has synchronised the copies reading from it)."""
        if not self.registered:
            return
        cudart = self._cudart or torch.cuda.cudart()
        ranges, self.registered = self.registered, []
        failed = []
        for start, nbytes in ranges:
            code = int(cudart.cudaHostUnregister(start))
            if code:
                text = _error_text(cudart, code)
                _clear_last_error(self.device, text)  # else the next kernel launch anywhere raises it
                failed.append(f"{nbytes} B at {start:#x}: {text}, error {code}")
        if failed:
            self.unregister_failures += failed
            warnings.warn(f"tightrope: CUDA refused to unpin {len(failed)} host range(s) ({failed[0]}); "
                          "this is a bug, please report it", RuntimeWarning, stacklevel=2)

    def split(self, address: int, nbytes: int) -> list[tuple[int, int]] | None:
        """Byte ranges [a, b) of the buffer at `address` that lie wholly inside or wholly outside the registered
        ranges, in order; None when the whole buffer is on one side (one copy will do)."""
        cuts, end = [0], address + nbytes
        k = max(0, bisect.bisect_right(self.registered, (address, float("inf"))) - 1)
        for start, n in self.registered[k:]:
            if start >= end:
                break
            for edge in (start, start + n):
                if address < edge < end:
                    cuts.append(edge - address)
        return None if len(cuts) == 1 else list(zip(cuts, cuts[1:] + [nbytes]))

    @property
    def pinned_bytes(self) -> int:
        return sum(n for _, n in self.registered)

    def _note(self, nbytes: int, reason: str) -> None:
        self.refused_bytes += nbytes
        warnings.warn(f"tightrope: could not page-lock {nbytes / 2**30:.2f} GiB of host weights in place ({reason}); "
                      "streaming them from pageable memory instead (slower copies; raise `ulimit -l` to fix)",
                      RuntimeWarning, stacklevel=3)


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

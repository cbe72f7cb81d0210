"""Page-locking host memory in place (cudaHostRegister), so weights that already sit in host memory stream to the GPU
asynchronously without a second, pinned copy, and without the caching host allocator (which rounds every pinned
allocation up to a power of two and keeps it cached for the life of the process).

- Ranges are per storage. The driver pins whole pages and refuses to register a page twice, so storages that share
  a page are merged into one range, from the page-aligned start of the first to the page-rounded end of the last:
  every page of a merged range belongs to one of the storages, so all of it is mapped.
- Memory someone else already pinned (ComfyUI's own pinned weights, a torch pinned tensor) is left as it is.
- Registration can be refused (`ulimit -l`, WSL and Windows limits, a read-only mmap) or be impossible (a CPU-only
  torch): the memory stays pageable, host-to-device copies from it are synchronous, and one warning line says so.
- `release()` unregisters what this object registered; the offloader calls it in `finally`.
"""
from __future__ import annotations

import mmap
import warnings
from typing import Any, Iterable

import torch

ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered: pinned by someone else, who will unpin it


def storage_spans(tensors: Iterable[torch.Tensor]) -> set[tuple[int, int]]:
    """(address, nbytes) of the tensors' storages, each once."""
    return {(s.data_ptr(), s.nbytes()) for s in (t.untyped_storage() for t in tensors) if s.nbytes() > 0}


def page_ranges(spans: Iterable[tuple[int, int]], page: int = mmap.PAGESIZE) -> list[tuple[int, int]]:
    """(start, nbytes) of page-aligned ranges covering the (address, nbytes) spans, merged where they share a page."""
    merged: list[list[int]] = []
    for start, end in sorted((a, a + n) for a, n in spans):
        a, b = start // page * page, -(-end // page) * page
        if merged and a < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b - a) for a, b in merged]


class PinnedRanges:
    """Host memory registered with CUDA for the duration of a run. `cudart` defaults to torch.cuda.cudart()."""

    def __init__(self, device: torch.device, cudart: Any = None):
        self.device = device
        self._cudart = cudart
        self.registered: list[tuple[int, int]] = []
        self.refused_bytes = 0

    def register(self, tensors: Iterable[torch.Tensor]) -> None:
        tensors = [t for t in tensors if not t.is_pinned()]
        if not tensors:
            return
        try:
            cudart = self._cudart or torch.cuda.cudart()
        except (AssertionError, RuntimeError) as e:  # CPU-only torch, or no driver
            self._note(sum(n for _, n in storage_spans(tensors)), f"CUDA runtime unavailable: {e}")
            return
        refused, reason = 0, ""
        for start, nbytes in page_ranges(storage_spans(tensors)):
            code = int(cudart.cudaHostRegister(start, nbytes, 0))
            if code == 0:
                self.registered.append((start, nbytes))
            elif code != ALREADY_REGISTERED:
                refused += nbytes
                text = str(cudart.cudaGetErrorString(cudart.cudaError(code)))
                reason = f"{text}, error {code}"
                _clear_last_error(self.device, text)
        if refused:
            self._note(refused, reason)

    def release(self) -> None:
        """Unregister everything registered here (the caller has synchronised the copies reading from it)."""
        if not self.registered:
            return
        cudart = self._cudart or torch.cuda.cudart()
        ranges, self.registered = self.registered, []
        for start, _ in ranges:
            cudart.cudaHostUnregister(start)

    @property
    def pinned_bytes(self) -> int:
        return sum(n for _, n in self.registered)

    def _note(self, nbytes: int, reason: str) -> None:
        self.refused_bytes += nbytes
        warnings.warn(f"tightrope: could not page-lock {nbytes / 2**30:.2f} GiB of host weights in place ({reason}); "
                      "streaming them from pageable memory instead (slower copies; raise `ulimit -l` to fix)",
                      RuntimeWarning, stacklevel=3)


def _clear_last_error(device: torch.device, text: str) -> None:
    """A refused cudaHostRegister leaves CUDA's per-thread last error set, and torch's check after the next kernel
    launch would raise it there. Launch a tiny kernel and swallow exactly that error, resetting the state."""
    try:
        torch.zeros(1, device=device)
    except RuntimeError as e:
        if text not in str(e):
            raise

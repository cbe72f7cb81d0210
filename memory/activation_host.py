"""Host memory for activation offload: one arena page-locked in place, reused step after step, given back at the end.

torch's pinned allocator (`pin_memory=True`) rounds every buffer up to a power of two and keeps each freed block
page-locked for the life of the process: by that rule 5.5 GiB of checkpointed block inputs (Flux-dev, 2048 px) take
7.1 GiB of pinned host memory, which a ComfyUI server would keep after training. Here a step's host copies are
carved, ALIGN bytes apart, out of one ordinary host allocation page-locked in place (host_pinning.PinnedRanges), the
arena:
- the first step, and a later one that needs more than the arena holds (a larger bucket), takes pageable buffers of
  exact size for what does not fit (their copies block the host: once) and records the most bytes held at once;
- between steps (`settle`), once every buffer is dead (a step's activations die with its graph), an arena smaller
  than that high-water mark is replaced by one of exactly that size: later steps copy asynchronously, into the
  largest step's bytes and no more;
- within a step the arena is handed out front to back and starts over once every buffer carved from it is dead (the
  next micro-batch reuses it);
- `release()` (at the runtime's undo) unregisters and frees it: a long-lived process gets its memory back.
PinnedRanges registers at most 1 GiB per call and a refused piece stays pageable, so a buffer's copies are made in
`parts` that lie wholly inside or outside one registration (the driver refuses a copy that straddles an edge:
host_pinning.copy_parts).
Where page-locking is refused the arena stays pageable (PinnedRanges' one-line note) and its copies block.
"""
from __future__ import annotations

import mmap
import threading
import weakref
from typing import Any

import torch

from .host_pinning import PinnedRanges, page_aligned

ALIGN = 512  # bytes between buffers in the arena: every dtype's alignment, and DMA-friendly


def aligned(nbytes: int) -> int:
    """What a buffer of `nbytes` takes in the arena."""
    return -(-nbytes // ALIGN) * ALIGN


class HostBuffer:
    """A host tensor shaped like an activation, and how to copy to and from it. `parts`: byte ranges to copy
    separately (None: one copy); `pinned`: its memory is page-locked (its copies may be asynchronous)."""
    __slots__ = ("tensor", "parts", "pinned")

    def __init__(self, tensor: torch.Tensor, parts: list[tuple[int, int]] | None, pinned: bool):
        self.tensor, self.parts, self.pinned = tensor, parts, pinned


class ActivationHost:
    def __init__(self, device: torch.device, cudart: Any = None):
        """cudart: the CUDA runtime that page-locks (default torch's); the CPU simulation passes a model of it."""
        self._pinned = PinnedRanges(device, cudart=cudart, what="host memory for offloaded activations",
                                    fallback="their copies block the host")
        self._lock = threading.RLock()  # buffers die on autograd's device thread during backward, or in a garbage
        # collection that runs while this thread holds the lock
        self._arena: torch.Tensor | None = None  # page-aligned uint8, wholly inside the registered interior
        self._locked = False  # the arena's registration was accepted whole
        self._top = 0      # the next free byte of the arena
        self._in_arena = 0  # buffers alive in the arena
        self.held = 0      # bytes of every buffer alive (arena and pageable), as they take them
        self.high_water = 0  # the most bytes held at once so far
        self.pageable_buffers = 0  # buffers that did not fit the arena (the first step's, a larger step's)

    @property
    def arena_bytes(self) -> int:
        return self._arena.numel() if self._arena is not None else 0

    @property
    def pinned(self) -> bool:
        """Whether the arena is page-locked whole: False until the first step has sized it, or where the system
        refused some of it (its copies then block)."""
        return self._arena is not None and self._locked

    def buffer_like(self, t: torch.Tensor) -> HostBuffer:
        """A host buffer with t's dtype, shape and strides (t dense), alive as long as its tensor."""
        nbytes = t.numel() * t.element_size()
        size = aligned(nbytes)
        with self._lock:
            if self._arena is not None and self._in_arena == 0:
                self._top = 0
            in_arena = self._arena is not None and self._top + size <= self._arena.numel()
            if in_arena:
                raw = self._arena[self._top: self._top + nbytes]
                self._top += size
                self._in_arena += 1
            else:
                self.pageable_buffers += 1
            self.held += size
            self.high_water = max(self.high_water, self.held)
        if not in_arena:
            raw = torch.empty(nbytes, dtype=torch.uint8)
        tensor = raw.view(t.dtype).as_strided(t.shape, t.stride())
        weakref.finalize(tensor, self._freed, size, in_arena)
        if not in_arena:
            return HostBuffer(tensor, None, False)
        return HostBuffer(tensor, self._pinned.split(raw.data_ptr(), nbytes), self.pinned)

    def _freed(self, size: int, in_arena: bool) -> None:
        with self._lock:
            self.held -= size
            self._in_arena -= in_arena

    def outgrown(self) -> bool:
        """Whether `settle` would replace the arena: no buffer is alive, and a step held more than it holds."""
        return self.held == 0 and self.high_water > self.arena_bytes

    def settle(self) -> None:
        """Between steps: an arena smaller than the most a step held is replaced by one of that size, once no buffer
        is alive (the caller has synchronised the copies)."""
        if self.outgrown():
            self._free_arena()
            arena = page_aligned(-(-self.high_water // mmap.PAGESIZE) * mmap.PAGESIZE, torch.uint8)
            refused = self._pinned.refused_bytes
            self._pinned.register([arena], read_only_ok=False)  # the device writes into it
            self._arena, self._top, self._locked = arena, 0, self._pinned.refused_bytes == refused

    def release(self) -> None:
        """Unregister and drop the arena (the caller has synchronised the copies). Buffers still alive keep their
        memory, pageable from now on."""
        self._free_arena()

    def _free_arena(self) -> None:
        self._pinned.release()
        self._arena, self._top = None, 0


"""Measuring instruments for the probe: a stream-ordered clock, a saved-tensor byte counter, captured block inputs,
and the host-to-device bandwidth."""
from __future__ import annotations

import statistics
import time
import weakref
from dataclasses import dataclass

import torch

from .tensor_kinds import inner_tensors


def measure_h2d_bandwidth(device: torch.device | str, nbytes: int | None = None, repeats: int = 5, *,
                          pinned: bool = True) -> float:
    """Bytes per second host -> device: on CUDA from pinned host memory, or pageable with pinned=False (what the
    runtime copies from when pinning is off or unavailable: slower, and synchronous for the host); on CPU the memcpy
    bandwidth, which is what the runtime's CPU simulation of a transfer costs."""
    device = torch.device(device)
    if device.type == "cuda":
        nbytes = nbytes or 256 << 20
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        with torch.cuda.device(device):
            dev.copy_(host, non_blocking=True)  # warm-up: first-touch and driver setup are not bandwidth
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                dev.copy_(host, non_blocking=True)
            end.record()
            end.synchronize()
        return nbytes * repeats / (start.elapsed_time(end) / 1000.0)
    nbytes = nbytes or 64 << 20
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return nbytes / max(statistics.median(times), 1e-9)


class Clock:
    """Timestamps in stream order on CUDA (events), wall clock elsewhere."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record(torch.cuda.current_stream(self.device))  # the probed device's stream, whichever device is current
        return e

    def seconds(self, a, b) -> float:
        if not self.cuda:
            return b - a
        b.synchronize()
        return a.elapsed_time(b) / 1000.0


class SavedBytes:
    """A pass-through saved-tensors hook that records each saved storage once, with the blocks that saved it.

    A storage is known by its address while it lives (a weak reference to it says whether it still does): once it is
    freed, the allocator may hand the same address to a later tensor, which is then another storage. Under
    activation offload every checkpointed block's inputs are freed on the device as soon as they are copied out, so
    an address-only count lost most of them (on the first H100 run, 47 of Flux-dev's 57 blocks measured 0 bytes).
    Entries of freed storages move to negative keys (`by_ptr` then holds every storage seen, the freed ones too)."""

    def __init__(self, skip: set[int]):
        self.skip = skip
        self.owner: int | None = None
        self.by_ptr: dict[int, tuple[int, set, weakref.ref]] = {}
        self._freed = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        for x in inner_tensors(t):  # a wrapper tensor (a quantized weight) by its inner tensors
            self._count(x)
        return t

    def _count(self, t: torch.Tensor) -> None:
        try:
            s = t.untyped_storage()
            ptr, n = s.data_ptr(), s.nbytes()
        except (RuntimeError, NotImplementedError):  # storage-less tensor subclasses: nothing to count
            return
        if n and ptr not in self.skip:
            entry = self.by_ptr.get(ptr)
            if entry is not None and entry[2]() is None:  # that storage was freed: this is a new one at its address
                self._freed += 1
                self.by_ptr[-self._freed] = self.by_ptr.pop(ptr)
                entry = None
            if entry is None:
                entry = self.by_ptr[ptr] = (n, set(), weakref.ref(s))
            entry[1].add(self.owner)

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    def total(self) -> int:
        return sum(n for n, *_ in self.by_ptr.values())


@dataclass
class Captured:
    data: torch.Tensor      # host copy of one block input
    requires_grad: bool
    ptr: int                # storage of the original, to recognise inputs shared between blocks


def output_tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in output_tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in output_tensors(o)]
    return []

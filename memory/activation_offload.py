"""Activation offload: the activations a checkpointed block keeps (its inputs) wait for backward in host memory.

They are packed by a saved-tensor hook (torch's non-reentrant checkpoint saves a block's inputs outside its own
hooks, so ours see exactly the checkpoint-boundary tensors), copied device-to-host on a side stream, and copied back
ahead of need: when block i starts its backward, the inputs of the blocks before it are prefetched.
Tensors shared by every block (the modulation vector, RoPE tables) are stored once per step, not once per block.

Lifetimes: a device copy brought back is owned by its consumers, not by this store. Each pack of a tensor expects
one unpack; the store keeps the copy only until the last expected unpack has handed it out, so it dies with its last
backward use (a later unexpected unpack, e.g. a second recompute, fetches it again from the host copy). The host
copy lives as long as autograd keeps the packed object. Copies back are allocated on the compute stream (its
allocator pool, where they are freed) and written on the side stream.

Host copies: page-locked on CUDA (pin_memory), carved out of one arena registered in place and reused step after
step (activation_host.py), not torch's pinned allocator (a power of two per buffer, kept for the life of the
process); pageable otherwise. `close()` (at the runtime's undo) waits for the copies and gives the arena back.
"""
from __future__ import annotations

import weakref

import torch

from .activation_host import ActivationHost
from .host_pinning import copy_parts
from .devices import normalize_device


class _Stored:
    """A host copy of one saved activation, and its device copy while it is on its way back."""

    def __init__(self, host: torch.Tensor, parts: list[tuple[int, int]] | None, pinned: bool, event):
        self.host, self.parts, self.pinned, self.d2h_event = host, parts, pinned, event
        self.back: torch.Tensor | None = None
        self.h2d_event = None
        self.pending = 1  # unpacks still expected: one per pack


class ActivationOffload:
    def __init__(self, device: torch.device, *, pin_memory: bool, min_bytes: int = 1 << 16, cudart=None):
        """cudart: the CUDA runtime that page-locks (default torch's); the CPU simulation passes a model of it, and
        then runs the page-locked path's bookkeeping and copies on the CPU."""
        self.device = normalize_device(device)
        self.cuda = self.device.type == "cuda"
        self.pin = pin_memory and (self.cuda or cudart is not None)
        self.host = ActivationHost(self.device, cudart=cudart) if self.pin else None
        self.min_bytes = min_bytes
        self.d2h_bytes = 0
        self.live_copies = 0       # device copies brought back and not yet freed
        self.peak_live_copies = 0  # the most alive at once since the last start_step
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._by_block: dict[int, list[weakref.ref]] = {}
        self._by_tensor: dict[int, tuple[weakref.ref, weakref.ref]] = {}
        self._wait_events: list = []

    def pack(self, t: torch.Tensor, block: int):
        # compiled backward graphs expect saved tensors with their exact strides: offload only dense tensors, whose
        # strides a copy keeps; views with gaps or overlaps stay on the device
        if t.device != self.device or t.numel() == 0 or t.numel() * t.element_size() < self.min_bytes \
                or not _dense(t):
            return t
        hit = self._by_tensor.get(id(t))
        stored = hit[1]() if hit is not None and hit[0]() is t else None
        if stored is not None:
            stored.pending += 1
            return stored
        if self.host is not None:
            buf = self.host.buffer_like(t)
            host, parts, pinned = buf.tensor, buf.parts, buf.pinned
        else:
            host, parts, pinned = torch.empty_like(t, device="cpu"), None, False
        event = None
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                copy_parts(host, t, parts, non_blocking=pinned)  # into pageable memory it blocks anyway: say so
                event = torch.cuda.Event()
                event.record(self.stream)
            t.record_stream(self.stream)  # the allocator must not hand t's memory out before the copy has read it
        else:
            copy_parts(host, t, parts, non_blocking=pinned)
        stored = _Stored(host, parts, pinned, event)
        self._by_tensor[id(t)] = (weakref.ref(t), weakref.ref(stored))
        self._by_block.setdefault(block, []).append(weakref.ref(stored))
        self.d2h_bytes += host.numel() * host.element_size()
        return stored

    def unpack(self, stored):
        if not isinstance(stored, _Stored):
            return stored
        if stored.back is None:
            self._bring_back(stored)
        back = stored.back
        if stored.h2d_event is not None:
            self._wait(stored.h2d_event)
            stored.h2d_event = None
        stored.pending -= 1
        if stored.pending <= 0:
            stored.back = None  # its consumers hold it now: it dies with its last use
        return back

    def prefetch(self, block: int) -> None:
        """Start copying block `block`'s saved inputs back to the device."""
        for ref in self._by_block.get(block, ()):
            stored = ref()
            if stored is not None and stored.back is None and stored.pending > 0:
                self._bring_back(stored)

    def _bring_back(self, stored: _Stored) -> None:
        if self.cuda:
            compute = torch.cuda.current_stream(self.device)
            back = torch.empty_like(stored.host, device=self.device)  # in the compute stream's pool, freed there
            self.stream.wait_stream(compute)  # its memory may have been another tensor's, still read by compute
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(stored.d2h_event)
                copy_parts(back, stored.host, stored.parts, non_blocking=stored.pinned)
                stored.h2d_event = torch.cuda.Event()
                stored.h2d_event.record(self.stream)
            back.record_stream(self.stream)  # freed unused (never waited on), it must outlive the copy into it
        else:
            back = torch.empty_like(stored.host)
            copy_parts(back, stored.host, stored.parts, non_blocking=stored.pinned)
        stored.back = back
        self.live_copies += 1
        self.peak_live_copies = max(self.peak_live_copies, self.live_copies)
        weakref.finalize(back, self._freed)

    def _freed(self) -> None:
        self.live_copies -= 1

    def _wait(self, event) -> None:
        stream = torch.cuda.current_stream(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        stream.wait_event(event)
        end.record(stream)
        self._wait_events.append((start, end))

    def collect_wait_seconds(self) -> float:
        """Time the compute stream stalled on activation copies since the last call (synchronises CUDA)."""
        events, self._wait_events = self._wait_events, []
        if not events:
            return 0.0
        torch.cuda.synchronize(self.device)
        return sum(s.elapsed_time(e) for s, e in events) / 1000.0

    @property
    def pinned(self) -> bool:
        """Whether the host copies are page-locked: from the second step on, where the system allowed it
        (activation_host.py)."""
        return self.host is not None and self.host.pinned

    def start_step(self) -> None:
        self.peak_live_copies = self.live_copies
        if self.host is not None and self.host.outgrown():
            if self.cuda:
                self.stream.synchronize()  # the last step's copies have read and written the arena it replaces
            self.host.settle()

    def close(self) -> None:
        """Wait for the copies, then give the host arena back (the runtime's undo)."""
        if self.cuda:
            self.stream.synchronize()
        if self.host is not None:
            self.host.release()

    def end_step(self) -> None:
        """Forget this step's bookkeeping (the stored copies themselves die with the autograd graph)."""
        self._by_block.clear()
        self._by_tensor.clear()


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: some permutation of t's dims is contiguous (so empty_like keeps its strides)."""
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True

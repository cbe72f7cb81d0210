"""Activation offload: the activations a checkpointed block keeps (its inputs) wait for backward in host memory.

They are packed by a saved-tensor hook (torch's non-reentrant checkpoint saves a block's inputs outside its own
hooks, so ours see exactly the checkpoint-boundary tensors), copied device-to-host on a side stream, and copied back
ahead of need: when block i starts its backward, the inputs of the blocks before it are prefetched.
Tensors shared by every block (the modulation vector, RoPE tables) are stored once per step, not once per block.
"""
from __future__ import annotations

import weakref

import torch


class _Stored:
    """A host copy of one saved activation, and its device copy once it is on its way back."""

    def __init__(self, host: torch.Tensor, device: torch.device, event):
        self.host, self.device, self.d2h_event = host, device, event
        self.back: torch.Tensor | None = None
        self.h2d_event = None


class ActivationOffload:
    def __init__(self, device: torch.device, *, pin_memory: bool, min_bytes: int = 1 << 16):
        self.device = device
        self.cuda = device.type == "cuda"
        self.pin = pin_memory and self.cuda
        self.min_bytes = min_bytes
        self.d2h_bytes = 0
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._by_block: dict[int, list[weakref.ref]] = {}
        self._by_tensor: dict[int, tuple[weakref.ref, _Stored]] = {}

    def pack(self, t: torch.Tensor, block: int):
        # compiled backward graphs expect saved tensors with their exact strides: offload only dense tensors, whose
        # strides a copy keeps; views with gaps or overlaps stay on the device
        if t.device != self.device or t.numel() * t.element_size() < self.min_bytes \
                or not _dense(t):
            return t
        hit = self._by_tensor.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1]
        host = torch.empty_like(t, device="cpu", pin_memory=self.pin)
        event = None
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                host.copy_(t, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
            t.record_stream(self.stream)  # the allocator must not hand t's memory out before the copy has read it
        else:
            host.copy_(t)
        stored = _Stored(host, t.device, event)
        self._by_tensor[id(t)] = (weakref.ref(t), stored)
        self._by_block.setdefault(block, []).append(weakref.ref(stored))
        self.d2h_bytes += host.numel() * host.element_size()
        return stored

    def unpack(self, stored):
        if not isinstance(stored, _Stored):
            return stored
        if stored.back is None:
            self._bring_back(stored)
        if stored.h2d_event is not None:
            torch.cuda.current_stream(self.device).wait_event(stored.h2d_event)
        return stored.back

    def prefetch(self, block: int) -> None:
        """Start copying block `block`'s saved inputs back to the device."""
        for ref in self._by_block.get(block, ()):
            stored = ref()
            if stored is not None and stored.back is None:
                self._bring_back(stored)

    def _bring_back(self, stored: _Stored) -> None:
        if self.cuda:
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(stored.d2h_event)
                stored.back = stored.host.to(stored.device, non_blocking=True)
                stored.h2d_event = torch.cuda.Event()
                stored.h2d_event.record(self.stream)
            stored.back.record_stream(torch.cuda.current_stream(self.device))
        else:
            stored.back = stored.host.clone()

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

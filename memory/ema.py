"""Exponential moving average of the trainable weights, kept in fp32 on the CPU so it costs no device memory.

After each optimizer step: shadow = d * shadow + (1 - d) * weight, with d = min(decay, (1 + n) / (10 + n)) at the
n-th update (diffusers' EMAModel warm-up): the average starts at the weights it is made from, and without the warm-up
a LoRA's untrained start (B = 0) would still weigh decay^n after n steps (0.74 after 300 steps at 0.999). The count
travels in the state as UPDATES_KEY, so a resumed or continued run goes on with the same decays. The weights are
gathered into one flat fp32 vector on their device and copied to the CPU at once: one device-to-host transfer per
step, not one per tensor.

On CUDA neither the copy nor the average stalls the GPU: the copy goes on a side stream, after the optimizer step,
into one flat host buffer page-locked in place (host_pinning.py), and a worker thread waits for it to land and folds
it into the average while the main thread queues the next step; the next update, and anything that reads the average
(`shadow`, `state_dict`), waits for that fold first (`_settle`). Where page-locking is refused or pin is off, the
copy blocks and is folded in at once, as on the CPU. `close()` (the trainer's `finally`) unpins the buffer.
"""
from __future__ import annotations

import contextlib
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import nn

from .host_pinning import PinnedRanges, page_aligned

UPDATES_KEY = "__updates__"  # the state's update count (a 0-d int64 tensor); not a weight
_WARM = 10 ** 9  # the count of a state saved before the count was kept: its average is taken as warmed up


def ema_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An EMA state's weights, without its update count (what a LoRA file of the EMA holds)."""
    return {k: v for k, v in state.items() if k != UPDATES_KEY}


class CpuEma:
    def __init__(self, params: dict[str, nn.Parameter], decay: float, state: dict[str, torch.Tensor] | None = None,
                 *, pin: bool = True, cudart=None):
        """state: a `state_dict()` to go on from (a resumed or continued run); default the weights as they are.
        pin: copy the weights into a page-locked host buffer (CUDA weights; or any, where `cudart`, a model of the
        CUDA runtime, is given: the CPU simulation)."""
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 < decay < 1.0:
            raise ValueError(f"ema decay={decay!r} is out of range: use a number between 0 and 1, e.g. 0.999")
        self.decay = float(decay)
        self.updates = 0
        self.params = params
        self._shadow = {k: p.detach().to("cpu", torch.float32, copy=True) for k, p in params.items()}
        self._pending: Future | None = None  # the fold of an update whose copy is in flight
        self._pinned: PinnedRanges | None = None
        self._flat: torch.Tensor | None = None  # the page-locked host buffer the weights are copied into
        self._stream: torch.cuda.Stream | None = None
        self._worker: ThreadPoolExecutor | None = None
        if state is not None:
            self.load_state_dict(state)
        device = next(iter(params.values())).device if self._shadow else None
        if pin and device is not None and (device.type == "cuda" or cudart is not None):
            self._page_lock(device, cudart)

    def _page_lock(self, device: torch.device, cudart) -> None:
        pinned = PinnedRanges(device, cudart=cudart, what="host memory for the EMA",
                              fallback="each step's copy of the LoRA weights to it waits for the GPU")
        flat = page_aligned(sum(s.numel() for s in self._shadow.values()), torch.float32)
        pinned.register([flat], read_only_ok=False)
        if pinned.refused_bytes:
            pinned.release()
            return
        self._pinned, self._flat = pinned, flat
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tightrope-ema")
        if device.type == "cuda":
            self._stream = torch.cuda.Stream(device)
            # dropped without close(): its copy lands before its PinnedRanges unpins and frees the buffer
            weakref.finalize(self, _abandoned, self._stream).atexit = False

    @property
    def shadow(self) -> dict[str, torch.Tensor]:
        """The average by name (CPU fp32), every update folded in."""
        self._settle()
        return self._shadow

    @torch.no_grad()
    def update(self) -> None:
        if not self._shadow:
            return
        self._settle()  # the previous step's copy, landed while this step ran: the buffer is free again
        flat = torch.cat([p.detach().reshape(-1).float() for p in self.params.values()])
        decay = min(self.decay, (1 + self.updates) / (10 + self.updates))
        if self._pinned is None:
            self._fold(flat.cpu(), decay)
        else:
            self._pending = self._worker.submit(self._fold_when_landed, self._copy(flat), decay)
        self.updates += 1

    def _copy(self, flat: torch.Tensor) -> torch.cuda.Event | None:
        """Queue flat's copy into the page-locked buffer after the current stream's work (the optimizer step); the
        event to wait for before reading the buffer (None: the CPU simulation copied at once)."""
        if self._stream is None:
            self._pinned.copy(self._flat, flat, self._flat, non_blocking=False)
            return None
        self._stream.wait_stream(torch.cuda.current_stream(flat.device))
        with torch.cuda.stream(self._stream):
            self._pinned.copy(self._flat, flat, self._flat, non_blocking=True)  # in parts at registrations' edges
            event = torch.cuda.Event()
            event.record(self._stream)
        flat.record_stream(self._stream)  # its device memory is reused only after the copy
        return event

    def _fold_when_landed(self, event: torch.cuda.Event | None, decay: float) -> None:
        """On the worker thread: wait for the copy (the GIL is released meanwhile), then fold it in."""
        if event is not None:
            event.synchronize()
        self._fold(self._flat, decay)

    def _settle(self) -> None:
        """Wait for the fold of the update in flight (and raise its error): every reader of the average, and the next
        update (which reuses the buffer), calls this."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def _fold(self, flat: torch.Tensor, decay: float) -> None:
        shadows = list(self._shadow.values())
        weights = [w.view_as(s) for w, s in zip(flat.split([s.numel() for s in shadows]), shadows)]
        torch._foreach_lerp_(shadows, weights, 1.0 - decay)

    def close(self) -> None:
        """Fold in the update in flight and unpin the host buffer (idempotent); later updates copy blocking."""
        with contextlib.suppress(Exception):  # an earlier CUDA error must not hide behind this one
            self._settle()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
        if self._pinned is not None:
            self._pinned.release()
        self._pinned = self._flat = self._stream = self._worker = None

    def state_dict(self) -> dict[str, torch.Tensor]:
        """CPU fp32 copies (a later update does not change what was returned), and the update count."""
        return {k: v.clone() for k, v in self.shadow.items()} | {UPDATES_KEY: torch.tensor(self.updates)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.updates = int(state[UPDATES_KEY]) if UPDATES_KEY in state else _WARM
        state = ema_weights(state)
        if state.keys() != self.shadow.keys():
            missing, extra = sorted(self.shadow.keys() - state.keys()), sorted(state.keys() - self.shadow.keys())
            raise ValueError(f"the EMA state does not match the trained weights (missing {missing[:2]}, extra "
                             f"{extra[:2]}): it belongs to another LoRA setup")
        for k, v in state.items():
            if tuple(v.shape) != tuple(self.shadow[k].shape):
                raise ValueError(f"the EMA state of {k!r} has shape {tuple(v.shape)}, the weight "
                                 f"{tuple(self.shadow[k].shape)}: it belongs to another LoRA setup")
            self.shadow[k] = v.detach().to("cpu", torch.float32, copy=True)


def _abandoned(stream: torch.cuda.Stream) -> None:
    with contextlib.suppress(Exception):
        stream.synchronize()


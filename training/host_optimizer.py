"""Optimizer offload: the LoRA's gradients and optimizer state live in host memory and the optimizer steps on the CPU.

ZeRO-Offload's split (and torchao's CPUOffloadOptimizer's) for a LoRA. The LoRA weights stay on the device, where
the forward needs them; each has a host copy that the optimizer updates. In backward, as soon as autograd completes a
weight's gradient (its post-accumulate-grad hook), the gradient is copied to the host on a side stream and its device
memory goes back to the allocator once that copy is done (`record_stream`). So at the step's peak (the backward of
the first blocks) the device holds no optimizer state and only the gradients in flight: for AdamW 12 bytes per LoRA
weight less (Flux-dev r16: 0.42 GiB). The micro-batches of one step add up on the host. The step: wait for the copies,
the optimizer's step on the CPU, then the updated weights are copied back on the compute stream (queued before the
next forward).

Host memory: the weights and the gradients in one flat buffer each (a third, for the micro-batches after the first,
only with gradient accumulation), page-locked in place on CUDA (cudaHostRegister, as the offloaded weights are:
no power-of-two rounding, released at the end), and the optimizer's state (plain memory: never copied).

The saved optimizer state has the same layout as the device optimizer's (indices in lora_parameters' order, CPU
tensors), so a session can go on with optimizer offload on or off. Schedule-free optimizers (which swap the weights
themselves between train and eval) and bitsandbytes' 8-bit AdamW (CUDA only) cannot run here: `check_offloadable`.
"""
from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Callable

import torch
from torch import nn

from ..memory.host_pinning import PinnedRanges, page_aligned
from .train_config import ConfigError

NOT_OFFLOADABLE = {"adamw_schedulefree": "it swaps the weights between train and eval itself",
                   "adamw8bit": "bitsandbytes' 8-bit AdamW steps on CUDA only"}


def offloadable(optimizer: str) -> bool:
    """Whether optimizer `optimizer` (a TrainConfig.optimizer name) can step on the CPU under optimizer offload."""
    return optimizer not in NOT_OFFLOADABLE


def check_offloadable(optimizer: str) -> None:
    if not offloadable(optimizer):
        raise ConfigError(f"optimizer={optimizer!r} does not work with optimizer_offload=True ("
                          f"{NOT_OFFLOADABLE[optimizer]}): choose optimizer='adamw' (or adafactor, prodigy), or set "
                          "optimizer_offload=False in the Memory Strategy node")


def _flat_like(tensors: list[torch.Tensor], pinned: PinnedRanges | None) -> tuple[list[torch.Tensor], bool]:
    """Host tensors shaped like `tensors`, views into one flat buffer per dtype, page-locked when `pinned` (never
    read-only: the device writes into some); and whether all of them are page-locked."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    locked = pinned is not None
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        index = [i for i, t in enumerate(tensors) if t.dtype == dtype]
        flat = page_aligned(sum(tensors[i].numel() for i in index), dtype)
        if pinned is not None:
            refused = pinned.refused_bytes
            pinned.register([flat], read_only_ok=False)
            locked = locked and pinned.refused_bytes == refused
        for i, view in zip(index, flat.split([tensors[i].numel() for i in index])):
            out[i] = view.view(tensors[i].shape)
    return out, locked


class HostOptimizer:
    """An optimizer over device weights `params` (by name) that steps on the CPU. `make` builds the inner optimizer
    over host parameters by name (make_optimizer's groups and options). `pin`: page-lock the host buffers (CUDA only).
    Use `gradients()` for the step's gradients (after backward: clipping, the non-finite check, all-reduce); `close()`
    removes the hooks and unpins (MemoryRuntime-style: the trainer calls it in `finally`)."""

    def __init__(self, params: dict[str, nn.Parameter], make: Callable[[dict], torch.optim.Optimizer],
                 device: torch.device, *, pin: bool = True, micro_batches: int = 1, cudart=None):
        """micro_batches: per step (gradient accumulation): more than 1 allocates the staging buffer now, not in
        the middle of the first backward that needs it."""
        self.params = params
        self.device = device
        cuda = device.type == "cuda"
        # cudart: the CUDA runtime that pins (default torch's); the CPU simulation passes a model of it
        self._pinned = PinnedRanges(device, cudart=cudart) if pin and (cuda or cudart is not None) else None
        self._stream = torch.cuda.Stream(device) if cuda else None
        weights = list(params.values())
        try:
            with warnings.catch_warnings(record=True) as refusals:
                warnings.simplefilter("always")
                host, self._weights_locked = _flat_like(weights, self._pinned)
                self._grads, grads_locked = _flat_like(weights, self._pinned)
                self._staging = None  # for micro-batches after the first
                if micro_batches > 1:
                    self._staging, staging_locked = _flat_like(weights, self._pinned)
                    grads_locked = grads_locked and staging_locked
            if (cuda or self._pinned is not None) and not (self._weights_locked and grads_locked):
                _warn_pageable(refusals)
            with torch.no_grad():
                for h, p in zip(host, weights):
                    self._copy_host(h, p.detach(), h, non_blocking=False)
            self.host = {name: nn.Parameter(h) for name, h in zip(params, host)}
            self.inner = make(self.host)
        except BaseException:
            if self._pinned is not None:
                self._pinned.release()  # else freed memory stays registered: a later buffer there copies wrongly
            raise
        self._host_list = list(self.host.values())
        self._index = {p: i for i, p in enumerate(weights)}
        self._count = [0] * len(weights)   # gradients of this step received per weight
        self._copied: list[torch.cuda.Event | None] = [None] * len(weights)   # its gradient's copy into _grads
        self._to_add: list[torch.cuda.Event | None] = [None] * len(weights)   # a copy into _staging not added yet
        self._copied_back: torch.cuda.Event | None = None  # the last step's weights copied to the device
        self.d2h_bytes = 0  # gradient bytes copied to the host (all steps)
        # the hooks hold this object weakly: dropped without close(), it is collected (its finalizer removes them,
        # waits for its copies, then its PinnedRanges unregisters the buffers before they are freed)
        hook = _weak_hook(weakref.WeakMethod(self._offload_gradient))
        self._hooks = [p.register_post_accumulate_grad_hook(hook) for p in weights]
        weakref.finalize(self, _abandoned, self._hooks, self._stream).atexit = False

    # -- what the trainer sees of an optimizer -----------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    @property
    def defaults(self) -> dict:
        return self.inner.defaults

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the step's gradients (host ones are always set to None: their buffers are kept for the next step)."""
        self.gradients()  # no copy may still be writing into a buffer the next step reuses
        for p in self._host_list:
            p.grad = None
        for p in self.params.values():
            p.grad = None
        self._count = [0] * len(self._count)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("HostOptimizer.step takes no closure")
        self.gradients()
        if self._copied_back is not None:
            self._copied_back.synchronize()  # the last copy back has read the host weights the step overwrites
        self.inner.step()
        non_blocking = self._weights_locked  # from page-locked memory: queued, the host goes on
        for p, h in zip(self.params.values(), self._host_list):
            self._copy_host(p, h, h, non_blocking)  # on the compute stream: before the next forward
        if self._stream is not None:
            self._copied_back = torch.cuda.Event()
            self._copied_back.record(torch.cuda.current_stream(self.device))

    # -- the gradients -------------------------------------------------------------------------------------------
    def gradients(self) -> dict[str, nn.Parameter]:
        """The host parameters by name, their .grad the step's gradients (summed over its micro-batches) once every
        copy has landed: this waits for them."""
        for i in range(len(self._count)):
            self._settle(i)
        return self.host

    def _settle(self, i: int) -> None:
        if self._copied[i] is not None:
            self._copied[i].synchronize()
            self._copied[i] = None
        if self._to_add[i] is not None:
            self._to_add[i].synchronize()
            self._to_add[i] = None
            self._grads[i].add_(self._staging[i])

    @torch.no_grad()
    def _offload_gradient(self, p: nn.Parameter) -> None:
        """Autograd completed p's gradient for this backward: copy it to the host, free it on the device."""
        i, g = self._index[p], p.grad
        if g is None:
            return
        if self._count[i]:  # a later micro-batch: into the staging buffer, added once it has landed
            self._settle(i)  # the previous micro-batch's copy (long done: a whole forward ran since)
            if self._staging is None:  # not told of micro-batches (HostOptimizer(micro_batches=...))
                self._staging = _flat_like(list(self.params.values()), self._pinned)[0]
            target = self._staging[i]
        else:
            target = self._grads[i]
        event = self._copy(target, g)
        if self._count[i]:
            self._to_add[i] = event or _DONE
        else:
            self._copied[i] = event
            self._host_list[i].grad = self._grads[i]
        self._count[i] += 1
        self.d2h_bytes += g.numel() * g.element_size()
        p.grad = None

    def _copy(self, target: torch.Tensor, g: torch.Tensor):
        if self._stream is None:  # CPU: a synchronous copy
            self._copy_host(target, g, target, non_blocking=False)
            return None
        self._stream.wait_stream(torch.cuda.current_stream(self.device))  # after the kernels that made g
        with torch.cuda.stream(self._stream):
            self._copy_host(target, g, target, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        g.record_stream(self._stream)  # its memory is reused only after the copy
        return event

    def _copy_host(self, dst: torch.Tensor, src: torch.Tensor, host: torch.Tensor, non_blocking: bool) -> None:
        """A copy to or from `host`, one of the buffers: in parts where it spans registrations (host_pinning)."""
        if self._pinned is None:
            dst.copy_(src, non_blocking=non_blocking)
        else:
            self._pinned.copy(dst, src, host, non_blocking)

    def close(self) -> None:
        """Remove the hooks, wait for the copies and unpin the host buffers (idempotent)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        with contextlib.suppress(Exception):  # an earlier CUDA error must not hide behind this one
            self.gradients()
            if self._copied_back is not None:
                self._copied_back.synchronize()
        if self._pinned is not None:
            self._pinned.release()


def _weak_hook(method: weakref.WeakMethod) -> Callable[[nn.Parameter], None]:
    def hook(p: nn.Parameter) -> None:
        offload = method()
        if offload is not None:
            offload(p)
    return hook


def _abandoned(hooks: list, stream: torch.cuda.Stream | None) -> None:
    """A HostOptimizer collected without close(): its hooks go, and its copies land before its buffers are freed."""
    for h in hooks:
        h.remove()
    hooks.clear()
    if stream is not None:
        with contextlib.suppress(Exception):
            stream.synchronize()


def _warn_pageable(refusals: list) -> None:
    reason = next((str(w.message) for w in refusals if "page-lock" in str(w.message)), "pin_memory=False")
    warnings.warn(f"tightrope: optimizer offload's host buffers are not page-locked ({reason}): each LoRA "
                  "gradient's copy to the host then waits for the GPU, which stalls backward; set pin_memory=True "
                  "if it is off, else optimizer_offload=False", RuntimeWarning, stacklevel=3)


class _Done:
    """A copy that ran synchronously (CPU): nothing to wait for."""

    @staticmethod
    def synchronize() -> None:
        pass


_DONE = _Done()


def optimizer_for(params: dict[str, nn.Parameter], config, strategy, device: torch.device, make_optimizer: Callable):
    """The run's optimizer over `params`: make_optimizer's (training/optimizer.py) on the device, or a HostOptimizer
    over its host one under strategy.optimizer (offload)."""
    if not strategy.optimizer.enabled:
        return make_optimizer(params, config, device)
    check_offloadable(config.optimizer)
    return HostOptimizer(params, lambda host: make_optimizer(host, config, torch.device("cpu"), on_host=True), device,
                         pin=strategy.offload.pin_memory, micro_batches=config.grad_accumulation)


def grad_scaler(optimizer, device_type: str, enabled: bool):
    """The fp16 loss scaler for `optimizer`: torch's, or under optimizer offload one that unscales host gradients
    with a scale read back from the device before the CPU reads it (HostGradScaler)."""
    if isinstance(optimizer, HostOptimizer) and enabled:
        return HostGradScaler(device_type, enabled=True)
    return torch.amp.GradScaler(device_type, enabled=enabled)


class HostGradScaler(torch.amp.GradScaler):
    """GradScaler for gradients in host memory. torch's copies its device scale (and its inf flag) to each gradient's
    device with `non_blocking=True` (`_MultiDeviceReplicator`): to the CPU that returns before the copy lands, and
    the CPU unscale kernel then reads a stale scale and its found-inf flag can be overwritten by the late copy (the
    bug pytorch PR #176429 fixed for FSDP's CPU offload). Here both are copied to the CPU first, blocking; the saved
    state is torch's."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        return super()._unscale_grads_(optimizer, inv_scale.cpu(), found_inf.cpu(), allow_fp16)


def updated_weights(optimizer, params: dict[str, nn.Parameter]) -> dict[str, nn.Parameter]:
    """The weights `optimizer` updates, by name: `params`, or their host copies under optimizer offload."""
    return optimizer.host if isinstance(optimizer, HostOptimizer) else params


def gradient_holders(optimizer, params: dict[str, nn.Parameter]) -> dict[str, nn.Parameter]:
    """updated_weights, with the step's gradients in their .grad (under optimizer offload: once they have landed)."""
    return optimizer.gradients() if isinstance(optimizer, HostOptimizer) else params

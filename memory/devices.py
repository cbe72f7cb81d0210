"""Device identity and host buffers.

`torch.device("cuda") != torch.device("cuda:0")`, yet every CUDA tensor reports its index; and a tensor made on
"cpu:0" reports "cpu". A tensor's device compared with a device as the caller spelled it can silently miss, so the
runtime normalises each device once, at its boundary, to the spelling its tensors report.

Page-locked (pinned) host memory makes host<->device copies asynchronous, but the system may refuse it (limits on
locked memory, WSL). Then a `non_blocking` copy from pageable memory blocks the host anyway, so the copies are made
blocking, honestly, and the runtime says that its host memory is not pinned.
"""
from __future__ import annotations

from typing import Callable

import torch


def normalize_device(device: torch.device | str) -> torch.device:
    """The device exactly as tensors on it report theirs: 'cuda' -> 'cuda:<current>', 'cpu:0' -> 'cpu'."""
    device = torch.device(device)
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def host_buffer(make: Callable[[bool], torch.Tensor], pin: bool) -> torch.Tensor:
    """`make(pin_memory)` pinned when asked and granted, else pageable; callers read `.is_pinned()`."""
    if pin:
        try:
            return make(True)
        except RuntimeError:  # pinned memory refused (or no pinned allocator): fall back to pageable memory
            pass
    return make(False)

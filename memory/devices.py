"""Device identity.

`torch.device("cuda") != torch.device("cuda:0")`, yet every CUDA tensor reports its index; and a tensor made on
"cpu:0" reports "cpu". A tensor's device compared with a device as the caller spelled it can silently miss, so the
runtime normalises each device once, at its boundary, to the spelling its tensors report.
"""
from __future__ import annotations

import torch


def normalize_device(device: torch.device | str) -> torch.device:
    """The device exactly as tensors on it report theirs: 'cuda' -> 'cuda:<current>', 'cpu:0' -> 'cpu'."""
    device = torch.device(device)
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


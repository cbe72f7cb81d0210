"""Device identity.

`torch.device("cuda") != torch.device("cuda:0")`, yet every CUDA tensor reports its index; and a tensor made on
"cpu:0" reports "cpu". A tensor's device compared with a device as the caller spelled it can silently miss, so the
runtime normalises each device once, at its boundary, to the spelling its tensors report.
"""
from __future__ import annotations

import torch


def normalize_device(device: torch.device | str) -> torch.device:
    """The device exactly as tensors on it report theirs: 'cuda' -> 'cuda:<current>', 'cpu:0' -> 'cpu', 'mps' ->
    'mps:0' (likewise 'xpu' -> 'xpu:<current>', 'privateuseone' -> 'privateuseone:0')."""
    device = torch.device(device)
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if device.index is None and device.type != "meta":  # 'mps', 'xpu', 'privateuseone' (DirectML): tensors say ':0'
        xpu = getattr(torch, "xpu", None)
        current = xpu.current_device() if device.type == "xpu" and xpu is not None and xpu.is_available() else 0
        return torch.device(device.type, current)
    return device


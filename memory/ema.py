"""Exponential moving average of the trainable weights, kept in fp32 on the CPU so it costs no device memory."""
from __future__ import annotations

import torch
from torch import nn


class CpuEma:
    def __init__(self, params: dict[str, nn.Parameter], decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"ema decay={decay!r} is out of range: use a number between 0 and 1, e.g. 0.999")
        self.decay = decay
        self.params = params
        self.shadow = {k: p.detach().to("cpu", torch.float32, copy=True) for k, p in params.items()}

    @torch.no_grad()
    def update(self) -> None:
        for k, p in self.params.items():
            self.shadow[k].lerp_(p.detach().to("cpu", torch.float32), 1.0 - self.decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.shadow)

"""Timestep sampling for flow-matching training (t in (0, 1): 0 = clean latent, 1 = pure noise)."""
from __future__ import annotations

import torch

SAMPLINGS = ("uniform", "logit_normal")


def sample_timesteps(n: int, generator: torch.Generator, *, kind: str = "logit_normal", shift: float = 1.0,
                     logit_mean: float = 0.0, logit_std: float = 1.0) -> torch.Tensor:
    """`kind` draws t; `shift` > 1 then moves it towards noise (SD3/Flux resolution shift: s*t / (1 + (s-1)*t))."""
    if kind == "uniform":
        t = torch.rand(n, generator=generator)
    elif kind == "logit_normal":  # SD3's choice: most samples in the middle, where the loss is informative
        t = torch.sigmoid(torch.randn(n, generator=generator) * logit_std + logit_mean)
    else:
        raise ValueError(f"timestep_sampling={kind!r} is not supported: choose one of {', '.join(SAMPLINGS)}")
    if shift != 1.0:
        t = shift * t / (1 + (shift - 1) * t)
    return t.clamp(1e-5, 1 - 1e-5)

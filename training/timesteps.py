"""Timestep sampling for flow-matching training (t in (0, 1): 0 = clean latent, 1 = pure noise)."""
from __future__ import annotations

import math
from typing import Callable

import torch

SAMPLINGS = ("uniform", "logit_normal")
MODEL_SHIFT = 0.0  # TrainConfig.timestep_shift: the shift the model samples with (TrainConfig.resolved)


def sample_timesteps(n: int, generator: torch.Generator, *, kind: str = "logit_normal", shift: float = 1.0,
                     logit_mean: float = 0.0, logit_std: float = 1.0) -> torch.Tensor:
    """`kind` draws t; `shift` > 1 then moves it towards noise (SD3/Flux resolution shift: s*t / (1 + (s-1)*t)).
    A shift of 0 (MODEL_SHIFT) must be resolved to the model's own first (TrainConfig.resolved)."""
    if not shift > 0:
        raise ValueError(f"timestep shift {shift!r} is not resolved: pass TrainConfig.resolved(...)'s shift")
    if kind == "uniform":
        t = torch.rand(n, generator=generator)
    elif kind == "logit_normal":  # SD3's choice: most samples in the middle, where the loss is informative
        t = torch.sigmoid(torch.randn(n, generator=generator) * logit_std + logit_mean)
    else:
        raise ValueError(f"timestep_sampling={kind!r} is not supported: choose one of {', '.join(SAMPLINGS)}")
    if shift != 1.0:
        t = shifted(t, shift)
    return t.clamp(1e-5, 1 - 1e-5)


def shifted(t: float, shift: float) -> float:
    return shift * t / (1 + (shift - 1) * t)


def shift_of_schedule(sigma_at: Callable[[float], float], what: str) -> float:
    """The shift s of a sampling schedule `sigma_at(t)` (t: 0 clean .. 1 noise) of the shift family
    sigma = s*t / (1 + (s-1)*t), read at t = 0.5 (sigma = s/(1+s)) and checked at t = 0.1 and 0.9 (Flux's
    e^mu / (e^mu + 1/t - 1) is that family with s = e^mu). `what` names the schedule in the refusal of another form
    (the shift then has to be set by hand)."""
    mid = float(sigma_at(0.5))
    shift = mid / (1 - mid) if 0 < mid < 1 else math.nan
    for t in (0.1, 0.9):
        sigma = float(sigma_at(t))
        if not (shift > 0 and math.isclose(sigma, shifted(t, shift), rel_tol=1e-4, abs_tol=1e-6)):
            raise ValueError(f"{what} is not a timestep shift schedule (sigma {sigma:.4g} at t={t}, {mid:.4g} at "
                             f"t=0.5): set timestep_shift to a number (1.0: no shift; 3.0 is common at 1024 px)")
    return shift

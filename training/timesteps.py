"""Timestep sampling for flow-matching training (t in (0, 1): 0 = clean latent, 1 = pure noise)."""
from __future__ import annotations

import math
from typing import Callable

import torch

SAMPLINGS = ("uniform", "logit_normal")
FULL_RANGE = (0.0, 1.0)  # TrainConfig.timestep_min/max's defaults: t is not mapped
MODEL_SHIFT = 0.0  # TrainConfig.timestep_shift: the shift the model samples with (TrainConfig.resolved)


def sample_timesteps(n: int, generator: torch.Generator, *, kind: str = "logit_normal", shift: float = 1.0,
                     logit_mean: float = 0.0, logit_std: float = 1.0,
                     t_range: tuple[float, float] = FULL_RANGE) -> torch.Tensor:
    """`kind` draws t; `shift` > 1 then moves it towards noise (SD3/Flux resolution shift: s*t / (1 + (s-1)*t)).
    A shift of 0 (MODEL_SHIFT) must be resolved to the model's own first (TrainConfig.resolved).

    `t_range` (lo, hi) (TrainConfig.timestep_min/max, e.g. Wan 2.2 A14B's high-noise expert (0.875, 1)) then maps
    each t linearly into it: lo + (hi - lo) * t, as musubi-tuner's --min_timestep/--max_timestep do by default.
    Not rejection (draw again until t falls in the range) nor truncation (clamping into it): the map keeps the
    drawn distribution's shape, stretched over the range (a logit-normal's peak stays in the range's middle, not
    cut off at its edge, and uniform stays uniform), where truncation piles the outside mass onto the ends and
    rejection keeps only the part that falls in, at the cost of retries (of a logit-normal's draws, 0.875..1 holds
    55% at shift 8 but 2.6% at shift 1: about 39 draws per timestep kept). Above all the map takes exactly the
    draws of the full range, n per call from the same generator: a micro-batch's noise and timesteps stay a pure
    function of (seed, step, micro-batch), so a resumed or continued run draws what an uninterrupted one would
    (rejection would take a data-dependent number of draws from the stream). The full range (0, 1) maps nothing:
    the same tensor, bit for bit, as before ranges existed. t stays inside the range: the map follows the clamp."""
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
    t = t.clamp(1e-5, 1 - 1e-5)
    lo, hi = t_range
    if (lo, hi) != FULL_RANGE:
        if not 0 <= lo < hi <= 1:
            raise ValueError(f"timestep range ({lo!r}, {hi!r}) is not 0 <= min < max <= 1: check TrainConfig")
        t = lo + (hi - lo) * t
    return t


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

"""Timestep sampling for flow-matching training (t in (0, 1): 0 = clean latent, 1 = pure noise)."""
from __future__ import annotations

import math
from typing import Callable

import torch

SAMPLINGS = ("uniform", "logit_normal")
FULL_RANGE = (0.0, 1.0)  # TrainConfig.timestep_min/max's defaults: every t
MODEL_SHIFT = 0.0  # TrainConfig.timestep_shift: the shift the model samples with (TrainConfig.resolved)
T_EDGE = 1e-5  # every t drawn is clamped to [T_EDGE, 1 - T_EDGE]


def sample_timesteps(n: int, generator: torch.Generator, *, kind: str = "logit_normal", shift: float = 1.0,
                     logit_mean: float = 0.0, logit_std: float = 1.0,
                     t_range: tuple[float, float] = FULL_RANGE) -> torch.Tensor:
    """`kind` draws t; `shift` > 1 then moves it towards noise (SD3/Flux resolution shift: s*t / (1 + (s-1)*t)).
    A shift of 0 (MODEL_SHIFT) must be resolved to the model's own first (TrainConfig.resolved).

    `t_range` (lo, hi) (TrainConfig.timestep_min/max, e.g. Wan 2.2 A14B's high-noise expert (0.875, 1)) draws from
    that distribution restricted to the range: t keeps the density it had there, renormalised (in_range). So an
    expert's LoRA weighs its noise levels as training the whole model would: at Wan's shift 8 the high-noise
    expert's median t is 0.93. Not a linear map of the whole draw into the range (musubi-tuner's default), which
    squeezes the shifted distribution into it (at shift 8 it put most of the high-noise expert's draws at t > 0.98,
    near pure noise); nor rejection (the same distribution, with retries). One float64 uniform per t through the
    inverse of the distribution's CDF: n draws from the generator for any range (t is drawn after the noise, from a
    generator seeded per micro-batch or image). The full range (0, 1) takes the draw above, bit for bit as before."""
    if not shift > 0:
        raise ValueError(f"timestep shift {shift!r} is not resolved: pass TrainConfig.resolved(...)'s shift")
    if kind not in SAMPLINGS:
        raise ValueError(f"timestep_sampling={kind!r} is not supported: choose one of {', '.join(SAMPLINGS)}")
    lo, hi = t_range
    if (lo, hi) != FULL_RANGE:
        return in_range(n, generator, kind, shift, logit_mean, logit_std, lo, hi)
    if kind == "uniform":
        t = torch.rand(n, generator=generator)
    else:  # logit_normal, SD3's choice: most samples in the middle, where the loss is informative
        t = torch.sigmoid(torch.randn(n, generator=generator) * logit_std + logit_mean)
    if shift != 1.0:
        t = shifted(t, shift)
    return t.clamp(T_EDGE, 1 - T_EDGE)


def in_range(n: int, generator: torch.Generator, kind: str, shift: float, logit_mean: float, logit_std: float,
             lo: float, hi: float) -> torch.Tensor:
    """n draws of sample_timesteps' distribution conditioned on lo <= t <= hi: its CDF F is monotone in the unshifted
    draw u (u -> shifted(u) is increasing), so t = shifted(G^-1(p)) with p uniform on [G(u(lo)), G(u(hi))], G the
    CDF of u (the identity for uniform; the normal CDF of (logit(u) - mean) / std for logit-normal). In float64."""
    if not 0 <= lo < hi <= 1:
        raise ValueError(f"timestep range ({lo!r}, {hi!r}) is not 0 <= min < max <= 1: check TrainConfig")
    u = torch.tensor([lo, hi], dtype=torch.float64)
    u = u / (shift - (shift - 1) * u)  # the inverse of shifted()
    # A range in a tail of the logit-normal (e.g. 0.9999..1, or 0..1e-4 at shift 3) has a CDF of 1 - (tiny) or of a
    # tiny number: float64 rounds the first to 1, and ndtr returns 0 below z = -8.3, so every draw was the same t (the
    # clamp's end of the range, or its wrong end). The range's CDF is taken from the tail it lies in (the upper one
    # mirrored), from log_ndtr, exact down to 1e-308: the same t up to rounding elsewhere, increasing in the uniform.
    upper = False
    if kind == "logit_normal":
        z = (torch.logit(u) - logit_mean) / logit_std  # logit(0) = -inf -> 0, logit(1) -> 1
        upper = bool(z[0] > 0)  # the whole range above the median
        u = torch.special.log_ndtr(-z if upper else z).exp()
    p = u[0] + (u[1] - u[0]) * torch.rand(n, generator=generator, dtype=torch.float64)
    if kind == "logit_normal":
        x = torch.special.ndtri(p)
        p = torch.sigmoid((-x if upper else x) * logit_std + logit_mean)
    t = shifted(p, shift) if shift != 1.0 else p
    return t.clamp(max(lo, T_EDGE), min(hi, 1 - T_EDGE)).float()  # TrainConfig: a range reaching into that


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

"""A plain reference for a timestep range's draw (training/timesteps.in_range): the training distribution restricted
to [lo, hi], drawn by the inverse of its CDF from one float64 uniform per t, written out here from the definitions
(u: the unshifted draw; t = s*u / (1 + (s-1)*u) increasing in u; logit-normal u: Phi((logit(u) - 0) / 1))."""
import math

import torch


def restricted_draw(n: int, gen: torch.Generator, kind: str, shift: float, lo: float, hi: float) -> torch.Tensor:
    def unshift(t: float) -> float:
        return t / (shift - (shift - 1) * t)

    def cdf(u: float) -> float:  # of the unshifted draw
        if kind == "uniform" or u in (0.0, 1.0):
            return u
        return 0.5 * (1 + math.erf(math.log(u / (1 - u)) / math.sqrt(2)))
    p_lo, p_hi = cdf(unshift(lo)), cdf(unshift(hi))
    p = p_lo + (p_hi - p_lo) * torch.rand(n, generator=gen, dtype=torch.float64)
    u = p if kind == "uniform" else torch.sigmoid(math.sqrt(2) * torch.special.erfinv(2 * p - 1))
    t = shift * u / (1 + (shift - 1) * u)
    return t.clamp(max(lo, 1e-5), min(hi, 1 - 1e-5)).float()

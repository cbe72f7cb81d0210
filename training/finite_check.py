"""NaN/inf checks where data enters training (a LoRA file, a training state file, a cached latent) and where it
leaves it (a file about to be written), plus the per-step check of the trainable weights and their gradients.

A NaN that gets in unchecked shows up steps later as a NaN loss, blamed on the learning rate; one that gets out is
saved into a LoRA or overwrites a good training state. So every loader calls `check_finite` (the error names the
file and the fix), and every writer calls it on what it is about to write.
"""
from __future__ import annotations

from typing import Iterable, Mapping

import torch
from torch import Tensor


class NonFiniteDataError(ValueError):
    """Tensors read from (or about to be written to) a file hold NaN or infinite values; the message names the file
    and the fix."""


def nonfinite_keys(tensors: Mapping[str, Tensor]) -> list[str]:
    """Names of the floating-point tensors that hold a NaN or an infinity (integer tensors cannot)."""
    names = [k for k, t in tensors.items() if t.is_floating_point()]
    return [k for k, ok in zip(names, _finite_flags([tensors[k] for k in names])) if not ok]


def check_finite(tensors: Mapping[str, Tensor], what: str, fix: str) -> None:
    """Raise NonFiniteDataError "<what> holds NaN or infinite values in N of M tensors (e.g. ...): <fix>"."""
    bad = nonfinite_keys(tensors)
    if bad:
        raise NonFiniteDataError(f"{what} holds NaN or infinite values in {len(bad)} of {len(tensors)} tensors "
                                 f"(e.g. {', '.join(bad[:3])}): {fix}")


def all_finite(tensors: Iterable[Tensor]) -> bool:
    """True if every value of every (floating-point) tensor is finite: one fused max-abs per device and one sync,
    cheap enough to run on the LoRA weights and gradients every step (they are a small fraction of the model)."""
    return all(_finite_flags(list(tensors)))


def _finite_flags(tensors: list[Tensor]) -> list[bool]:
    """Per tensor: all values finite? The max-abs norm is NaN if a value is NaN, inf if one is infinite, and never
    overflows otherwise (unlike a sum or the 2-norm)."""
    flags: dict[int, bool] = {}
    for device in dict.fromkeys(t.device for t in tensors):  # one _foreach call per device
        group = [(i, t) for i, t in enumerate(tensors) if t.device == device and t.numel()]
        if group:
            maxabs = torch.stack([n.float() for n in torch._foreach_norm([t for _, t in group], float("inf"))])
            flags.update(zip((i for i, _ in group), torch.isfinite(maxabs).tolist()))
    return [flags.get(i, True) for i in range(len(tensors))]  # an empty tensor has no bad value

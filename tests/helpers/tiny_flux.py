"""The tiny reference Flux and fixed inputs for it, shared by the LoRA tests."""
import copy

import torch

from tightrope.training.models.reference_flux import Flux, FluxParams
from tightrope.demo.tiny_checkpoint import init_tiny_weights_

_TINY = {}


def tiny_flux(seed=0):
    """A fresh copy of the tiny reference Flux (built once per seed: copying is faster than building)."""
    if seed not in _TINY:
        _TINY[seed] = init_tiny_weights_(Flux(FluxParams.tiny()), seed)
    return copy.deepcopy(_TINY[seed])


def flux_inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 16, 4, 6, generator=g), torch.tensor([0.4]), torch.randn(1, 3, 64, generator=g),
            torch.randn(1, 32, generator=g), torch.tensor([3.5]))

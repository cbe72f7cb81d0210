"""The embedded default: a tiny random Flux, the demo's stand-in encoders and a generated dataset (no download)."""
from __future__ import annotations

import torch

from .encoders import DemoCaptionEmbedder, DemoLatentCodec
from ..training.models.adapter import ReferenceFluxModel
from ..training.models.reference_flux import Flux, FluxParams
from .tiny_checkpoint import init_tiny_weights_


def demo_model(seed: int = 0) -> ReferenceFluxModel:
    """A tiny Flux (hidden 128, 2 double + 2 single blocks) with deterministic random weights."""
    with torch.inference_mode(False):  # ordinary tensors even when built inside a ComfyUI node
        flux = init_tiny_weights_(Flux(FluxParams.tiny()), seed)
    flux.requires_grad_(False)
    return ReferenceFluxModel(flux, base_name=f"tightrope-tiny-flux-seed{seed}")


def demo_encoders(seed: int = 0) -> tuple[DemoLatentCodec, DemoCaptionEmbedder]:
    """Stand-ins for a VAE and the text encoders, sized for the tiny Flux: not real models."""
    p = FluxParams.tiny()
    return DemoLatentCodec(seed=seed), DemoCaptionEmbedder(context_dim=p.context_in_dim, pooled_dim=p.vec_in_dim,
                                                           seed=seed)

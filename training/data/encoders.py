"""The encoder interface the training dataset talks to.

Anything with these attributes works: the demo stand-ins, or ComfyUI's own VAE and CLIP/T5 wrapped
by the ComfyUI adapter. The dataset hands the encoders CPU tensors; an encoder that runs elsewhere
moves them itself and may return tensors on any device (the dataset moves results to the CPU).
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import Tensor


@runtime_checkable
class ImageEncoder(Protocol):
    """Pixels to latents (a VAE's encoder side)."""

    # Names the encoder and every setting that changes its output; it is part of the cache key,
    # so two encoders that give different latents must never share a cache_id.
    cache_id: str
    # Pixels per latent cell along each side (8 for SD/Flux VAEs).
    downscale: int

    def encode(self, images: Tensor) -> Tensor:
        """(B, 3, H, W) float in [-1, 1] -> (B, C, H // downscale, W // downscale)."""
        ...


@runtime_checkable
class TextEncoder(Protocol):
    """Captions to the conditioning a diffusion transformer reads."""

    cache_id: str
    # Optional: `captions_per_call` (int), the most captions one encode() is given. An encoder whose captions encode
    # to different token counts sets it to 1; the dataset then batches captions of one length together.

    def encode(self, captions: list[str]) -> tuple[Tensor, Tensor]:
        """captions -> (context (B, T, D), pooled (B, P)); T is the same for every caption of one call."""
        ...

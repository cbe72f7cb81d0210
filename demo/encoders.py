"""The demo's stand-ins for a VAE and text encoders: tiny, deterministic, no weights to download.

Not real models. They let the whole training pipeline run on a CPU in seconds, with shapes that match
the tiny reference Flux model (16 latent channels, context_in_dim 64, vec_in_dim 32, patch 2).
"""
from __future__ import annotations

import hashlib
import re

import torch
import torch.nn.functional as F
from torch import Tensor

from ..training.models.training_only import TrainingOnly


def _seed_from(text: str) -> int:
    """A stable 63-bit seed (Python's hash() is salted per process, so it can't be used)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little") >> 1


class DemoLatentCodec(TrainingOnly):
    """The demo's stand-in for a VAE; not a real model (ComfyUI's VAE nodes cannot use it: TrainingOnly).

    encode: pixel-unshuffle by 2 (3 -> 12 channels at half resolution), append 4 zero channels, then mix
    the 16 channels with a fixed seeded orthogonal matrix so every latent channel carries signal.
    decode inverts it exactly (the transpose undoes the mix), so a trained LoRA's samples can be viewed.
    """

    downscale = 2
    latent_channels = 16
    WHAT, REAL_ONE = "VAE", "a real VAE (Load VAE)"

    def __init__(self, seed: int = 0):
        self.seed = seed
        g = torch.Generator().manual_seed(seed)
        q, r = torch.linalg.qr(torch.randn(16, 16, generator=g, dtype=torch.float64))
        # Fix QR's sign ambiguity so the matrix depends only on the seed, not on the LAPACK build.
        self._mix = q * torch.sign(torch.diagonal(r))

    @property
    def cache_id(self) -> str:
        return f"demo-latent-codec-v1(seed={self.seed})"

    def encode(self, images: Tensor) -> Tensor:
        if images.ndim != 4 or images.shape[1] != 3 or images.shape[2] % 2 or images.shape[3] % 2:
            raise ValueError(f"DemoLatentCodec.encode wants (B, 3, H, W) with even H and W, got {tuple(images.shape)}")
        x = F.pixel_unshuffle(images.double(), 2)
        x = torch.cat([x, x.new_zeros(x.shape[0], 4, *x.shape[2:])], dim=1)
        # float64 inside keeps decode(encode(x)) == x to ~1e-15 before the cast back.
        return torch.einsum("ij,bjhw->bihw", self._mix, x).to(images.dtype)

    def decode(self, latents: Tensor) -> Tensor:
        if latents.ndim != 4 or latents.shape[1] != 16:
            raise ValueError(f"DemoLatentCodec.decode wants (B, 16, h, w), got {tuple(latents.shape)}")
        x = torch.einsum("ji,bjhw->bihw", self._mix, latents.double())
        return F.pixel_shuffle(x[:, :12], 2).to(latents.dtype)


class DemoCaptionEmbedder(TrainingOnly):
    """The demo's stand-in for text encoders (Flux's T5 + CLIP); not a real model (ComfyUI's text nodes cannot use it:
    TrainingOnly).

    Each lower-cased word maps to a fixed random vector seeded by its blake2b digest, so the same
    caption gives the same embedding in every process. context: one row per word (truncated or padded
    to max_tokens with a fixed padding row); pooled: the mean of the words' pooled parts. The empty
    caption (caption dropout's "unconditional") gets its own fixed embedding.
    """

    WHAT, REAL_ONE = "text encoder", "real text encoders (DualCLIPLoader) to encode prompts"

    def __init__(self, context_dim: int = 64, pooled_dim: int = 32, max_tokens: int = 16, seed: int = 0):
        self.context_dim, self.pooled_dim, self.max_tokens, self.seed = context_dim, pooled_dim, max_tokens, seed
        self._vectors: dict[str, Tensor] = {}

    @property
    def cache_id(self) -> str:
        return (f"demo-caption-embedder-v1(context_dim={self.context_dim},pooled_dim={self.pooled_dim},"
                f"max_tokens={self.max_tokens},seed={self.seed})")

    @staticmethod
    def tokens(caption: str) -> list[str]:
        return re.findall(r"[a-z0-9']+", caption.lower())

    def _vector(self, token: str) -> Tensor:
        # "<pad>" and "<empty>" can't collide with words: the tokenizer never emits "<".
        if token not in self._vectors:
            g = torch.Generator().manual_seed(_seed_from(f"{self.seed}\0{token}"))
            self._vectors[token] = torch.randn(self.context_dim + self.pooled_dim, generator=g)
        return self._vectors[token]

    def encode(self, captions: list[str]) -> tuple[Tensor, Tensor]:
        if isinstance(captions, str):
            raise TypeError("DemoCaptionEmbedder.encode wants a list of captions, not a single string")
        d = self.context_dim
        pad = self._vector("<pad>")[:d]
        context = pad.repeat(len(captions), self.max_tokens, 1)
        pooled = torch.empty(len(captions), self.pooled_dim)
        for i, caption in enumerate(captions):
            words = self.tokens(caption) or ["<empty>"]
            vectors = torch.stack([self._vector(w) for w in words])
            n = min(len(words), self.max_tokens)
            context[i, :n] = vectors[:n, :d]
            pooled[i] = vectors[:, d:].mean(dim=0)
        return context, pooled

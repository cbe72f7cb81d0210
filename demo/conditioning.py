"""Stand-in text conditioning for any model Tightrope trains: ComfyUI CONDITIONING from the demo caption embedder
(demo/encoders.py: DemoCaptionEmbedder), sized for the connected model. Not a text encoder: it lets a workflow train and
sample a model without downloading its text encoders (smoke tests, the integration tests)."""
from __future__ import annotations

from typing import Any

from .encoders import DemoCaptionEmbedder
from ..training.models import adapter_for


def demo_conditioning(model: Any, text: str, tokens: int, seed: int) -> list:
    """[[context (1, tokens, D), {"pooled_output": (1, P), or None for models without one}]]."""
    context_dim, pooled_dim = adapter_for(model).conditioning_dims()
    context, pooled = DemoCaptionEmbedder(context_dim, pooled_dim, max_tokens=tokens, seed=seed).encode([text])
    return [[context, {"pooled_output": pooled if pooled_dim else None}]]

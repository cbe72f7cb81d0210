"""Model adapters: what the trainer needs from a model (adapter.py: the protocol and the reference Flux's adapter),
ComfyUI's MODEL (comfy.py), the reference Flux itself (reference_flux.py), and the MODEL a training node outputs."""
from __future__ import annotations

from typing import Any

from . import reference_flux_chunks  # noqa: F401  registers the reference Flux blocks' token-chunked forwards
from .adapter import ModelAdapter


def adapter_for(model: Any) -> ModelAdapter:
    """The adapter for whatever arrives on a MODEL input: an adapter as it is, ComfyUI's ModelPatcher wrapped."""
    if isinstance(model, ModelAdapter):
        return model
    if hasattr(model, "model") and hasattr(model, "clone") and hasattr(model, "model_options"):
        from .comfy import ComfyModelAdapter  # ComfyUI imports live there only
        return ComfyModelAdapter(model)
    raise TypeError(f"the MODEL input is a {type(model).__name__}, which Tightrope cannot train: connect a "
                    "diffusion model loader (ComfyUI's Load Diffusion Model, or Tightrope's demo model)")

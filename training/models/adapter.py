"""What the trainer needs from a model, whatever loaded it: the module to put LoRA in, and a prediction.

Two implementations: the embedded reference Flux (`ReferenceFluxModel`, here) and ComfyUI's MODEL (the ComfyUI
adapter, the only module that imports ComfyUI). `adapter_for` picks one for whatever arrives on a MODEL input.
"""
from __future__ import annotations

import contextlib
import copy
import itertools
from typing import Any, Iterator, Protocol, runtime_checkable

import torch
from torch import nn

from .reference_flux import Flux


@runtime_checkable
class ModelAdapter(Protocol):
    """Optional, outside the protocol: `process_latents(latents) -> latents` maps the dataset's (VAE) latents into
    the model's latent space before noising (ComfyUI models: the latent format's shift and scale); without it the
    latents are used as they are."""
    family: str      # LoRA target presets and block discovery key on this ("flux", "sd3", ...)
    base_name: str   # recorded in the LoRA file's metadata

    def training_module(self) -> contextlib.AbstractContextManager[nn.Module]:
        """The diffusion transformer to train; it is given back unchanged when the context exits."""

    def predict(self, module: nn.Module, x_t: torch.Tensor, t: torch.Tensor, context: torch.Tensor,
                pooled: torch.Tensor, guidance: float) -> torch.Tensor:
        """The model's flow-matching velocity prediction for noisy latents x_t at times t in (0, 1)."""


class ReferenceFluxModel:
    """The embedded default's MODEL: our plain-PyTorch Flux (see reference_flux.py)."""
    family = "flux"

    def __init__(self, flux: Flux, base_name: str = "tightrope-reference-flux"):
        self.flux = flux
        self.base_name = base_name

    @contextlib.contextmanager
    def training_module(self) -> Iterator[nn.Module]:
        tensors = list(itertools.chain(self.flux.parameters(), self.flux.buffers()))
        if any(t.is_inference() for t in tensors):
            # built under ComfyUI's inference_mode: autograd cannot save inference tensors, so train on new module
            # objects whose tensors are ordinary aliases of the same storage (no copy of the weights)
            with torch.inference_mode(False):
                memo = {id(t): ordinary_alias(t) for t in tensors}
                flux = copy.deepcopy(self.flux, memo).requires_grad_(False)
            yield flux
        else:
            yield self.flux

    def predict(self, module, x_t, t, context, pooled, guidance):
        g = torch.full((x_t.shape[0],), float(guidance), device=x_t.device) if module.params.guidance_embed else None
        return module.forward_latent(x_t, t.to(x_t.device), context, pooled, g)

    def with_lora(self, path: str, strength: float = 1.0) -> "ReferenceFluxModel":
        """A copy with a saved LoRA merged in (this object is left as it is)."""
        from ..lora.files import merge_lora_into
        flux = copy.deepcopy(self.flux)
        merge_lora_into(flux, path, strength)
        return ReferenceFluxModel(flux, self.base_name)


def ordinary_alias(t: torch.Tensor) -> torch.Tensor:
    """An ordinary (non-inference) tensor sharing `t`'s storage, a Parameter if `t` is one. Made outside inference
    mode, it can be saved for backward; it costs no memory. Tensor subclasses (ComfyUI's quantized weights) and meta
    tensors cannot be aliased that way and are copied."""
    data = t.data
    if type(data) is torch.Tensor and data.device.type != "meta":
        out = torch.empty(0, dtype=data.dtype, device=data.device)
        out.set_(data.untyped_storage(), data.storage_offset(), data.shape, data.stride())
    else:
        out = data.clone()
    return nn.Parameter(out, requires_grad=False) if isinstance(t, nn.Parameter) else out


def adapter_for(model: Any) -> ModelAdapter:
    if isinstance(model, ModelAdapter):
        return model
    if hasattr(model, "model") and hasattr(model, "clone") and hasattr(model, "model_options"):
        from .comfy import ComfyModelAdapter  # ComfyUI imports live there only
        return ComfyModelAdapter(model)
    raise TypeError(f"the MODEL input is a {type(model).__name__}, which Tightrope cannot train: connect a "
                    "diffusion model loader (ComfyUI's Load Diffusion Model, or Tightrope's demo model)")

"""What the trainer needs from a model, whatever loaded it: the module to put LoRA in, and a prediction.

Two implementations: the embedded reference Flux (`ReferenceFluxModel`, here) and ComfyUI's MODEL (comfy.py, the
only module that imports ComfyUI); `adapter_for` (the package's __init__) picks one for whatever arrives on a MODEL
input. A model loaded some other way is one more class with these members; the trainer asks nothing else of a model.
"""
from __future__ import annotations

import contextlib
import copy
import itertools
import math
from typing import Any, Iterator, Protocol, runtime_checkable

import torch
from torch import nn

from ...memory.tensor_kinds import PackedWrapper, alias_like, keeps_bytes
from ..lora.layers import LoraSpec, inject_lora, load_lora_state, merge_and_remove_lora
from .reference_flux import PATCH, Flux
from .training_only import TrainingOnly

# ComfyUI samples Flux with sigma = e^mu / (e^mu + 1/t - 1), mu = 1.15 (ModelSamplingFlux's default, and its value at
# 1024 px): the shift family with s = e^mu
FLUX_SAMPLING_SHIFT = math.exp(1.15)


@runtime_checkable
class ModelAdapter(Protocol):
    family: str      # LoRA target presets and block discovery key on this ("flux", "sd3", ...)
    base_name: str   # recorded in the LoRA file's metadata

    def conditioning_dims(self) -> tuple[int, int]:
        """(width of the text context, width of the pooled text embedding; 0 if the model takes none)."""

    def latent_channels(self) -> int | None:
        """The channels of the (VAE) latents the model takes, before patching; None if it does not say."""

    def training_module(self) -> contextlib.AbstractContextManager[nn.Module]:
        """The diffusion transformer to train; it is given back unchanged when the context exits."""

    def predict(self, module: nn.Module, x_t: torch.Tensor, t: torch.Tensor, context: torch.Tensor,
                pooled: torch.Tensor, guidance: float, to_device=None) -> torch.Tensor:
        """The model's flow-matching velocity prediction for noisy latents x_t at times t in (0, 1). to_device: how
        host tensors the prediction makes reach x_t's device (the runtime's InputCopies: the host does not wait for
        the GPU); None: `.to`."""

    def process_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """The dataset's (VAE) latents in the model's latent space, before noising (ComfyUI models: the latent
        format's shift and scale)."""

    def sampling_shift(self) -> float:
        """The timestep shift s the model is sampled with (sigma = s*t / (1 + (s-1)*t)): what training uses for
        timestep_shift 0 (TrainConfig.resolved)."""

    def with_lora_state(self, spec: LoraSpec, state: dict[str, torch.Tensor], strength: float = 1.0) -> Any:
        """The MODEL with a trained LoRA applied at `strength`, as a new object: this one is left as it is."""


class ReferenceFluxModel(TrainingOnly):
    """The embedded default's MODEL: our plain-PyTorch Flux (see reference_flux.py)."""
    family = "flux"
    WHAT, REAL_ONE = "model", "a real model (Load Diffusion Model) to sample"

    def __init__(self, flux: Flux, base_name: str = "tightrope-reference-flux", *,
                 lora: tuple[LoraSpec, dict[str, torch.Tensor], float] | None = None):
        """lora: (spec, state, strength) merged into a copy of `flux` the first time the module is asked for."""
        self._flux, self._lora = flux, lora
        self.base_name = base_name

    @property
    def flux(self) -> Flux:
        if self._lora is not None:  # the merge of with_lora_state, made when used (at most once)
            spec, state, strength = self._lora
            flux = copy.deepcopy(self._flux)
            inject_lora(flux, spec, self.family)
            load_lora_state(flux, state)
            merge_and_remove_lora(flux, strength)
            self._flux, self._lora = flux, None
        return self._flux

    @flux.setter
    def flux(self, flux: Flux) -> None:
        self._flux, self._lora = flux, None

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

    def conditioning_dims(self) -> tuple[int, int]:
        return self._flux.params.context_in_dim, self._flux.params.vec_in_dim  # the same with the LoRA merged

    def latent_channels(self) -> int:
        return self._flux.params.in_channels // (PATCH * PATCH)

    def predict(self, module, x_t, t, context, pooled, guidance, to_device=None):
        g = torch.full((x_t.shape[0],), float(guidance), device=x_t.device) if module.params.guidance_embed else None
        return module.forward_latent(x_t, t.to(x_t.device), context, pooled, g)

    def process_latents(self, latents: torch.Tensor) -> torch.Tensor:
        return latents  # the demo's latents are already the model's

    def sampling_shift(self) -> float:
        return FLUX_SAMPLING_SHIFT

    def with_lora_state(self, spec: LoraSpec, state: dict[str, torch.Tensor],
                        strength: float = 1.0) -> "ReferenceFluxModel":
        """A copy with the LoRA merged into its weights, made when it is first used (e.g. by another Train node): a
        Train node's MODEL output that nothing uses holds no second copy of the weights (ComfyUI caches it)."""
        return ReferenceFluxModel(self.flux, self.base_name, lora=(spec, state, strength))


def ordinary_alias(t: torch.Tensor) -> torch.Tensor:
    """An ordinary (non-inference) tensor sharing `t`'s storage, a Parameter if `t` is one. Made outside inference
    mode, it can be saved for backward; it costs no memory. A storage subclass (ComfyUI-GGUF's GGMLTensor) keeps its
    class and attributes (memory/tensor_kinds.py); wrapper subclasses and meta tensors cannot be aliased that way and
    are copied, except a traceable wrapper (ComfyUI's QuantizedTensor), rebuilt over aliases of its inner tensors."""
    data = t.data
    if PackedWrapper.packs(data):
        out = PackedWrapper.of(data, ordinary_alias).unpack(lambda x: x)
    elif keeps_bytes(data) and data.device.type != "meta":
        out = torch.empty(0, dtype=data.dtype, device=data.device)
        out.set_(data.untyped_storage(), data.storage_offset(), data.size(), data.stride())
        out = alias_like(t, out)
    else:
        out = data.clone()
    return nn.Parameter(out, requires_grad=False) if isinstance(t, nn.Parameter) else out

"""The adapter algorithms a LoRA setup can train, all through peft: `lora` (LoraConfig), `dora` (LoraConfig with
use_dora), `loha` (LoHaConfig) and `lokr` (LoKrConfig). This module holds what differs between them: the settings
each accepts, its peft config, and merging it into the base weights; lycoris.py maps them to file keys.

Scales: every algorithm applies alpha/rank (alpha/sqrt(rank) with rsLoRA) to its update. peft's LoRA/DoRA take
rsLoRA as a flag; LoHa/LoKr have none, so they get alpha*sqrt(rank) as their alpha, which gives the same scale.
"""
from __future__ import annotations

import math

import torch
from peft import LoHaConfig, LoKrConfig, LoraConfig
from peft.tuners.lora import LoraLayer
from peft.tuners.loha import LoHaLayer
from peft.tuners.lokr import LoKrLayer
from torch import nn

from .targets import LoraError

ALGORITHMS = ("lora", "dora", "loha", "lokr")
ADAPTER = "default"  # peft's adapter name; one adapter per model
PEFT_LAYERS = (LoraLayer, LoHaLayer, LoKrLayer)
NAMES = {"lora": "LoRA", "dora": "DoRA", "loha": "LoHa", "lokr": "LoKr"}


def check_algorithm(algorithm, dropout: float, init: str) -> None:
    """The settings `algorithm` accepts: LoHa and LoKr have no input dropout and no gaussian init in peft."""
    if algorithm not in ALGORITHMS:
        raise LoraError(f"LoRA algorithm={algorithm!r} is not supported: choose one of {', '.join(ALGORITHMS)}")
    if algorithm in ("loha", "lokr"):
        if dropout:
            raise LoraError(f"LoRA dropout={dropout!r} does not apply to algorithm={algorithm!r} ({NAMES[algorithm]} "
                            "has no input dropout): set dropout=0, or use algorithm 'lora' or 'dora'")
        if init != "default":
            raise LoraError(f"LoRA init={init!r} does not apply to algorithm={algorithm!r}: {NAMES[algorithm]} "
                            "starts as a no-op with its own init; set init='default'")


def check_base_weights(module: nn.Module, names: list[str], algorithm: str) -> None:
    """DoRA reads each trained layer's base weight itself (for its row norms), outside the layer's own forward, so
    that weight must be a float type torch computes with: an fp8-stored weight (a model loaded as fp8) or a quantized
    GGUF weight (its raw bytes are uint8) is refused."""
    if algorithm != "dora":
        return
    for name in names:
        dtype = module.get_submodule(name).weight.dtype
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise LoraError(f"algorithm='dora' reads the base weight of each layer it trains, but {name!r} is stored "
                            f"as {dtype}: load the model in bf16/fp16 (Load Diffusion Model with weight_dtype "
                            "'default', not fp8 or GGUF), or use algorithm 'lora', 'loha' or 'lokr', which leave the "
                            "base weight to the model's layers")


def peft_config(spec, target_modules: str):
    """The peft config that injects `spec` (a LoraSpec) into the layers `target_modules` fully matches."""
    if spec.algorithm in ("lora", "dora"):
        return LoraConfig(r=spec.rank, lora_alpha=spec.alpha, use_rslora=spec.rslora, lora_dropout=spec.dropout,
                          init_lora_weights=True if spec.init == "default" else "gaussian", bias="none",
                          use_dora=spec.algorithm == "dora", target_modules=target_modules)
    alpha = spec.alpha * math.sqrt(spec.rank) if spec.rslora else spec.alpha  # peft scales by alpha/r
    if spec.algorithm == "loha":
        return LoHaConfig(r=spec.rank, alpha=alpha, init_weights=True, target_modules=target_modules)
    # decompose_both=False: w1 is a full (small) matrix, w2 is factorised only where the rank is low enough (peft's
    # and LyCORIS's defaults)
    return LoKrConfig(r=spec.rank, alpha=alpha, init_weights=True, decompose_both=False, decompose_factor=-1,
                      target_modules=target_modules)


def layer_algorithm(layer: nn.Module) -> str:
    """The algorithm of one injected peft layer."""
    if isinstance(layer, LoHaLayer):
        return "loha"
    if isinstance(layer, LoKrLayer):
        return "lokr"
    if isinstance(layer, LoraLayer):
        return "dora" if layer.use_dora.get(ADAPTER) else "lora"
    raise LoraError(f"{type(layer).__name__} is not a peft layer Tightrope trains (LoRA, DoRA, LoHa or LoKr)")


def adapter_parameters(layer: nn.Module) -> dict[str, nn.Parameter]:
    """A peft layer's adapter weights by their name inside the layer ('lora_A.default.weight', 'hada_w1_a.default',
    'lora_magnitude_vector.default.weight'), in registration order; the base layer's weights are not included."""
    return {n: p for n, p in layer.named_parameters() if not n.startswith("base_layer.")}


@torch.no_grad()
def merged_weight(layer: nn.Module, strength: float = 1.0) -> torch.Tensor:
    """The base weight with the layer's adapter applied at `strength`, in fp32: W + strength * (W' - W), where W' is
    the weight the adapter's forward computes with (ComfyUI's rule for DoRA strengths; W + strength * delta for the
    others)."""
    weight = layer.get_base_layer().weight.float()
    algorithm = layer_algorithm(layer)
    if algorithm in ("loha", "lokr"):
        return weight + strength * layer.get_delta_weight(ADAPTER).to(weight.device, torch.float32)
    a, b = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight
    update = layer.scaling[ADAPTER] * (b.to(weight.device, torch.float32) @ a.to(weight.device, torch.float32))
    if algorithm == "lora":
        return weight + strength * update
    # DoRA (peft's DoraLinearLayer): each output row of W + update rescaled to the trained magnitude
    adapted = weight + update
    magnitude = layer.lora_magnitude_vector[ADAPTER].weight.to(weight.device, torch.float32)
    adapted *= (magnitude / torch.linalg.norm(adapted, dim=1)).unsqueeze(1)
    return weight + strength * (adapted - weight)

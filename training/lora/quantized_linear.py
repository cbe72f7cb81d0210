"""Linear layers that are no torch `nn.Linear` but that a model adapter declares trainable: ComfyUI's quantized
(mixed-precision) Linear, whose weight is a quantized tensor class (fp8 with a per-tensor scale) that only the
layer's own forward reads (training/models/comfy.py marks them with targets.mark_quantized_linear; this module
imports no ComfyUI).

LoRA goes on such a layer through peft's custom-module dispatch (LoraConfig._register_custom_module), with peft's own
`lora.Linear`: its forward is the base layer's own forward (the quantized weight as ComfyUI computes with it, no
weight gradient, the input's gradient through it) plus the fp32 LoRA branch scale * B(A(x)) (layers.py keeps the
input in the compute dtype under autocast, as on any layer). Only plain LoRA: DoRA reads the base weight itself
(its row norms) outside the layer's forward, and peft's LoHa/LoKr have no custom-module dispatch; both are refused.
"""
from __future__ import annotations

from peft.tuners.lora.layer import Linear as LoraLinear
from torch import nn

from .targets import LoraError, quantized_kind


def check_quantized_targets(module: nn.Module, names: list[str], algorithm: str) -> None:
    """Refuse an adapter algorithm other than plain LoRA on the quantized layers among `names`."""
    if algorithm == "lora":
        return
    for name in names:
        kind = quantized_kind(module.get_submodule(name))
        if kind is None:
            continue
        why = "reads the base weight of each layer it trains (its row norms)" if algorithm == "dora" else \
            "has no peft layer for a layer that is not a torch Linear"
        raise LoraError(f"algorithm={algorithm!r} {why}, but {name!r} is a layer of a quantized model ({kind}, a "
                        "'scaled fp8' / fp8-mixed model file) whose weight only its own forward reads: use algorithm "
                        "'lora', or load the bf16/fp16 file of this model (weight_dtype fp8_e4m3fn in Load "
                        "Diffusion Model holds it in 8 bits)")


def register_quantized_targets(config, module: nn.Module, names: list[str]) -> None:
    """Make peft put its LoRA Linear on the quantized layers among `names` (a LoraConfig's custom modules)."""
    classes = {type(module.get_submodule(n)) for n in names if quantized_kind(module.get_submodule(n))}
    if classes:
        config._register_custom_module({cls: LoraLinear for cls in classes})

"""Some output columns of a Linear layer, `layer(x)[..., cols]`, computed from those rows of its weight only.

The token-chunked Flux single blocks (training/models/reference_flux_chunks.py, comfy_flux_chunks.py) use it to
compute their fused linear1 once per pass by columns (q, k, v in one pass, the MLP input in the other) instead of in
full twice. It lives here, beside the other peft-facing code, because it must know peft's LoRA forward; `memory/`
never imports it, and ComfyUI's cast Linear is handled by comfy_flux_chunks.py through the `base` argument.

Layers computed by rows (the same ops as their own forward on fewer weight rows, so the same values up to the
rounding of a matmul with fewer output columns):
  - a plain `nn.Linear` (or a subclass that keeps its forward): F.linear with the rows of weight and bias;
  - a peft LoRA `Linear` with plain LoRA adapters (any scaling, rsLoRA included, and dropout): peft's own forward
    (`lora.layer.Linear.forward`, as read in peft 0.21) per column: the base layer's columns, then per active
    adapter the input cast by peft's `_cast_input_dtype`, `lora_A(dropout(x))` in full (rank r: small), lora_B's
    rows, times the scaling, and the sum cast back to the base result's dtype. Dropout sees the whole input, so it
    draws the same mask from the same RNG state as the full forward of this call (two calls for two column groups
    draw two masks, where the layer's one forward would share one: see reference_flux_chunks.py).
Anything else runs the whole layer and takes the columns (`full_columns`), so a result never changes silently: a
DoRA or any other peft lora_variant, disabled or merged adapters, fan_in_fan_out, another peft layer type, a weight
that is a tensor subclass (quantized, DTensor; FakeTensor, the planner's shape-only stand-in, is a plain tensor
here), a layer with a forward of its own (set on the instance, or overridden by its class) or with hooks of its own.
Global module hooks (register_module_forward_hook: FlopCounterMode's module tracker, for one) are not consulted: a
layer computed by rows is not called as a module, so they do not see it.
"""
from __future__ import annotations

from typing import Callable

import torch.nn.functional as F
from peft.tuners.lora.layer import Linear as LoraLinear
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor

BaseColumns = Callable[[nn.Module, Tensor, slice], "Tensor | None"]
"""base(layer, x, cols) -> layer(x)[..., cols] computed by rows, or None when it cannot be (then nothing ran)."""

_PLAIN_TYPES = (Tensor, nn.Parameter, FakeTensor)


def linear_columns(layer: nn.Module, x: Tensor, cols: slice, base: BaseColumns | None = None) -> Tensor:
    """`layer(x)[..., cols]`, from the rows `cols` of the weights when the layer allows it (see the module
    docstring); `base` computes the columns of a non-LoRA layer (default: plain_columns)."""
    base = base or plain_columns
    out = _lora_columns(layer, x, cols, base) if type(layer) is LoraLinear else base(layer, x, cols)
    return full_columns(layer, x, cols) if out is None else out


def full_columns(layer: nn.Module, x: Tensor, cols: slice) -> Tensor:
    """The fallback: the whole layer, then the columns."""
    return layer(x)[..., cols]


def plain_columns(layer: nn.Module, x: Tensor, cols: slice) -> Tensor | None:
    """The columns of a plain nn.Linear (one that runs nn.Linear.forward, unhooked), or None for any other layer."""
    if not runs_own_forward(layer, nn.Linear.forward) or not plain_tensors(layer.weight, layer.bias):
        return None
    return rows_linear(x, layer.weight, layer.bias, cols)


def rows_linear(x: Tensor, weight: Tensor, bias: Tensor | None, cols: slice) -> Tensor:
    """F.linear(x, weight, bias)[..., cols] from weight rows `cols` (views: a row slice of an offloaded weight's slot
    is packed for backward by its offset like the whole weight, see memory/layer_offload.py)."""
    return F.linear(x, weight[cols], None if bias is None else bias[cols])


def runs_own_forward(module: nn.Module, forward: Callable) -> bool:
    """Whether calling `module` would run exactly `forward`: its class's, not replaced on the instance, no hooks."""
    return type(module).forward is forward and "forward" not in module.__dict__ and not (
        module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks)


def plain_tensors(*tensors: Tensor | None) -> bool:
    """None or plain (or fake) tensors: slicing their rows slices their values."""
    return all(t is None or type(t) in _PLAIN_TYPES for t in tensors)


def _lora_columns(layer: LoraLinear, x: Tensor, cols: slice, base: BaseColumns) -> Tensor | None:
    variants = getattr(layer, "lora_variant", None)  # peft before 0.16 has no lora_variant (does DoRA otherwise)
    if variants is None or layer.disable_adapters or layer.merged or layer.fan_in_fan_out or \
            not runs_own_forward(layer, LoraLinear.forward):
        return None
    active = [a for a in layer.active_adapters if a in layer.lora_A.keys()]
    if any(a in variants or layer.use_dora.get(a) or not runs_own_forward(layer.lora_B[a], nn.Linear.forward) or
           not plain_tensors(layer.lora_B[a].weight, layer.lora_B[a].bias) for a in active):
        return None
    result = base(layer.base_layer, x, cols)
    if result is None:
        return None
    result_dtype = result.dtype
    for a in active:  # peft's loop, lora_B by rows
        lora_a, lora_b = layer.lora_A[a], layer.lora_B[a]
        x = layer._cast_input_dtype(x, lora_a.weight.dtype)
        result = result + rows_linear(lora_a(layer.lora_dropout[a](x)), lora_b.weight, lora_b.bias, cols) * \
            layer.scaling[a]
    return result.to(result_dtype)

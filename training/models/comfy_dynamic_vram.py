"""A training copy of a model that ComfyUI loaded for dynamic VRAM (comfy-aimdo: ComfyUI's default on NVIDIA GPUs),
made from the weights ComfyUI already holds: no second host copy.

Under dynamic VRAM ComfyUI maps the model file read-only and assigns its tensors to the modules as they are, in the
file's dtype (comfy.utils.load_safetensors; load_state_dict(assign=True)); each module records the dtype the model
runs in (`<name>_comfy_model_dtype`), and loading the model for sampling leaves per-module state on it for ComfyUI's
own cast path: a virtual-VRAM allocation and staged device weights, pin bookkeeping, LoRA hooks, and
`comfy_cast_weights` forced on (ModelPatcherDynamic.load, comfy.ops.cast_bias_weight). ComfyUI's own trainer
reloads the whole file into a second, ordinary model instead (`clone(force_deepcopy=True)`): +1 W of host RAM.

The adapter's copy shares the mapped weights (a LoRA never writes its base weights, and the memory runtime streams
them page-locked read-only where the GPU/driver supports it, see memory/host_pinning.py), leaves that state out, so
the copy's modules run their plain forward, and casts only the weights whose file dtype differs from the model's dtype, as a non-dynamic load would.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

# Per-module attributes of ComfyUI's dynamic-VRAM path (ComfyUI 0.3x with comfy-aimdo 0.4; comfy/model_prefetch.py's
# `_v_block_faulted` and `_comfy_graph`, a captured CUDA graph that no copy may share or deep-copy), plus every
# `<param>_lowvram_function` (LoRA patches applied at cast time).
_STATE = frozenset({"_v", "_v_signature", "_v_weight", "_v_bias", "_v_block", "_v_block_faulted", "_comfy_graph",
                    "_prefetch", "_pin_state", "_pins", "seed_key", "comfy_cast_weights", "weight_function",
                    "bias_function"})


def dynamic_vram_state(module: nn.Module) -> list[tuple[str, Any]]:
    """(name, value) of the dynamic-VRAM attributes set on this module object (not its class defaults)."""
    return [(k, v) for k, v in module.__dict__.items() if k in _STATE or k.endswith("_lowvram_function")]


def share_dynamic_vram_state(source: nn.Module, memo: dict) -> None:
    """Put the state's values into a deep copy's memo: the copy shares them (device buffers, driver handles, aimdo
    HostBuffers a copy would double-free) instead of copying them, until drop_dynamic_vram_state removes them."""
    for m in source.modules():
        for _, value in dynamic_vram_state(m):
            memo.setdefault(id(value), value)


def drop_dynamic_vram_state(module: nn.Module) -> None:
    """Remove the state from every module of a copy: its modules then run their plain forward (or, with a class
    that casts, ComfyUI's ordinary cast path)."""
    for m in module.modules():
        for name, _ in dynamic_vram_state(m):
            del m.__dict__[name]


def cast_to_model_dtypes(module: nn.Module) -> None:
    """Weights and buffers still in the file's dtype -> the dtype the model runs in (new tensors; the rest stay
    shared with ComfyUI's mapped file)."""
    for m in module.modules():
        for table in (m._parameters, m._buffers):
            for name, t in list(table.items()):
                want = getattr(m, f"{name}_comfy_model_dtype", None)
                if t is None or want is None or t.dtype == want or type(t.data) is not torch.Tensor:
                    continue  # absent, in its dtype already, or a quantized tensor (ComfyUI casts those itself)
                cast = t.detach().to(want)
                table[name] = nn.Parameter(cast, requires_grad=False) if isinstance(t, nn.Parameter) else cast

"""The `.dora_scale` a DoRA file holds, in the convention of the tool that will apply it.

peft trains a magnitude m per output row and computes with W'_i = (W_i + dW_i) * m_i / |W_i + dW_i| (dW = scale * B
@ A; the norm is detached, taken in the compute dtype). Applying a file, ComfyUI (0.33 and master as of 2026-11,
comfy/weight_adapter/base.py `weight_decompose`) instead divides an output-axis dora_scale by the norm of the BASE
row: W'_i = (W_i + dW_i) * dora_scale_i / (|W_i| + eps), all in fp32 (eps = fp32's, as its intermediate weight is
fp32). Comfy-Org/ComfyUI#15458 would make it normalise by |W_i + dW_i|, as LyCORIS and peft do. So:
    'comfyui'  (metadata tightrope.dora_scale = 'comfyui-base-norm'): dora_scale_i = m_i * (|W_i| + eps) /
               |W_i + dW_i|, which ComfyUI as released applies exactly (to fp32 rounding).
    'standard' (tightrope.dora_scale = 'standard'): dora_scale = m, right in tools that normalise by |W + dW| (and in
               ComfyUI once #15458 lands); ComfyUI 0.33 is then off by |W_i + dW_i| / |W_i| on row i.
Continuing from a 'comfyui' file reads m back with the inverse, so save -> continue gives the same model.

The base weight W is read where it lives at save time: the model's own tensor, or, while layer offload has replaced
an offloaded block's weights by placeholders or slot views, the host tensor it streams from (MemoryRuntime
.host_weight): no copy. Norms are computed in fp32, a block of rows at a time, one layer at a time. Under bf16
autocast peft rounds its norm to bf16 (relative 2^-9), the same order as the bf16 rounding ComfyUI's patched weight
gets; the file holds the exact fp32 value that rounding approximates.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from .algorithms import PEFT_LAYERS
from .targets import LoraError

DORA_FOR = {"comfyui": "comfyui-base-norm", "standard": "standard"}  # Save LoRA's dora_for -> metadata value
META_KEY = "tightrope.dora_scale"
_EPS = torch.finfo(torch.float32).eps  # ComfyUI adds finfo(weight.dtype).eps; its weight is fp32 there
_CHUNK = 1 << 22  # elements of W (and of dW) held in fp32 at once

BaseWeight = Callable[[str], Tensor]  # layer name -> its base weight (out, in), any device and float dtype


def check_dora_for(dora_for) -> str:
    if dora_for not in DORA_FOR:
        raise LoraError(f"dora_for={dora_for!r} is not supported: choose 'comfyui' (exact in ComfyUI as released) "
                        "or 'standard' (LyCORIS/peft semantics, for tools that normalise DoRA by |W + update|)")
    return dora_for


def base_weight_of(module: nn.Module, host_weight: Callable[[nn.Parameter], Tensor] | None = None) -> BaseWeight:
    """Layer name -> the base weight of that Linear layer in `module` (with or without a peft layer on it);
    `host_weight` maps a parameter to where its value lives now (MemoryRuntime.host_weight under layer offload)."""
    def weight(name: str) -> Tensor:
        layer = module.get_submodule(name)
        p = (layer.get_base_layer() if isinstance(layer, PEFT_LAYERS) else layer).weight
        return host_weight(p) if host_weight is not None else p.detach()
    return weight


@torch.no_grad()
def base_norm_ratio(weight: Tensor, a: Tensor, b: Tensor, scale: float) -> Tensor:
    """(|W_i| + eps) / |W_i + scale * (B @ A)_i| per output row, fp32 on the CPU, computed on `weight`'s device a
    block of rows at a time (never the whole layer's update in fp32 at once)."""
    if weight.ndim != 2 or weight.shape != (b.shape[0], a.shape[1]):
        raise LoraError(f"the DoRA factors A {tuple(a.shape)}, B {tuple(b.shape)} do not fit the base weight "
                        f"{tuple(weight.shape)}: the LoRA was trained for another model size")
    dev = weight.device
    a = a.to(dev, torch.float32)
    b = b.to(dev, torch.float32)
    rows = max(1, _CHUNK // max(1, weight.shape[1]))
    out = []
    for r in range(0, weight.shape[0], rows):
        w = weight[r: r + rows].to(torch.float32)
        adapted = w + scale * (b[r: r + rows] @ a)
        out.append((torch.linalg.vector_norm(w, dim=1) + _EPS) / torch.linalg.vector_norm(adapted, dim=1))
    return torch.cat(out).cpu()


def to_file(layers: dict[str, dict[str, Tensor]], scale: float, dora_for: str,
            base_weight: BaseWeight | None) -> None:
    """Per layer {suffix: fp32 tensor} with the trained magnitude as 'dora_scale' -> its file value (in place)."""
    if check_dora_for(dora_for) == "standard":
        return
    if base_weight is None:
        raise LoraError("a DoRA file for ComfyUI (dora_for='comfyui') needs the base model's weights to write its "
                        "dora_scale: save it from the model (save_lora), or use dora_for='standard'")
    for name, p in layers.items():
        ratio = base_norm_ratio(base_weight(name), p["lora_A.weight"], p["lora_B.weight"], scale)
        p["dora_scale"] = p["dora_scale"].reshape(-1) * ratio


def magnitude_from_file(scale_in_file: Tensor, meta: dict[str, str], weight: Tensor, a: Tensor, b: Tensor,
                        scale: float) -> Tensor:
    """The magnitude m (fp32, (out,)) that a file's dora_scale stands for: the inverse of to_file for a 'comfyui'
    file, the value itself for a 'standard' one or another trainer's (no tightrope.dora_scale)."""
    m = scale_in_file.reshape(-1).to(torch.float32)
    convention = meta.get(META_KEY, DORA_FOR["standard"])
    if convention == DORA_FOR["standard"]:
        return m
    if convention != DORA_FOR["comfyui"]:
        raise LoraError(f"the DoRA file's {META_KEY}={convention!r} is not a convention Tightrope knows "
                        f"({', '.join(DORA_FOR.values())}): it was written by a newer Tightrope; update Tightrope")
    return m / base_norm_ratio(weight, a, b, scale)

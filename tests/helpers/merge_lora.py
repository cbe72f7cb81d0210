"""A small LoraLoader for a plain model, as the tests' stand-in for ComfyUI applying a saved LoRA file."""
from __future__ import annotations

import copy
import os
import warnings

import torch
from torch import Tensor, nn

from tightrope.training.lora.files import lora_modules_in_file, read_lora_file
from tightrope.training.lora.lycoris import file_algorithm, file_layers, file_update, merge_into_weight
from tightrope.training.lora.layers import LoraError, lora_layers
from tightrope.training.models.adapter import ReferenceFluxModel


@torch.no_grad()
def merge_lora_into(model: nn.Module, path: str | os.PathLike, strength: float = 1.0) -> int:
    """A small LoraLoader for a plain model (no peft layers): W += strength * (alpha/rank) * B @ A per layer, in
    ComfyUI's order of operations (fp32 product, cast to the weight's dtype). Returns the number of patched layers."""
    if lora_layers(model):
        raise LoraError(f"{type(model).__name__} has peft LoRA layers: merge a file into a plain model "
                        "(remove_lora first, or use merge_and_remove_lora)")
    linear = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    tensors, _ = read_lora_file(path)
    algorithm = file_algorithm(tensors)
    entries = lora_modules_in_file(tensors, linear) if algorithm == "lora" else file_layers(tensors, algorithm)
    matched = [n for n in linear if n in entries]  # model order
    if not matched:
        raise LoraError(f"none of the {len(entries)} LoRA layers in {path} matches a Linear layer of "
                        f"{type(model).__name__} (e.g. {', '.join(list(entries)[:3])}): this LoRA was trained for "
                        "another model architecture; pick a LoRA made for this model")
    skipped = [n for n in entries if n not in linear]
    if skipped:  # ComfyUI also applies the rest and logs these
        warnings.warn(f"{path}: {len(skipped)} LoRA layers match no layer of the model and were skipped "
                      f"(e.g. {', '.join(skipped[:3])})", stacklevel=2)
    if algorithm != "lora":
        return _merge_other(path, entries, {n: linear[n].weight for n in matched}, algorithm, strength)
    for name in matched:
        w, weight = entries[name], linear[name].weight
        if (w.B.shape[0], w.A.shape[1]) != tuple(weight.shape):
            raise LoraError(f"{path}: layer {name!r} is {w.A.shape[1]} -> {w.B.shape[0]} in the LoRA but "
                            f"{weight.shape[1]} -> {weight.shape[0]} in the model: this LoRA was trained for "
                            "another model size; pick a LoRA made for this model")
    for name in matched:
        w, weight = entries[name], linear[name].weight
        diff = w.B.to(weight.device, torch.float32) @ w.A.to(weight.device, torch.float32)
        weight += ((strength * w.scale) * diff).to(weight.dtype)
    return len(matched)


def _merge_other(path, entries, weights: dict[str, Tensor], algorithm: str, strength: float) -> int:
    """merge_lora_into for a DoRA / LoHa / LoKr file (ComfyUI 0.33's math, see lycoris_file)."""
    updates = {}
    for name, weight in weights.items():  # every shape checked before any weight changes
        try:
            update = file_update(entries[name], algorithm, weight.device)
        except RuntimeError as e:  # factors that do not multiply
            raise LoraError(f"{path}: the {algorithm} weights of layer {name!r} do not fit together ({e}): the file "
                            "is damaged; save it again") from None
        scale = entries[name].get("dora_scale")
        if update.shape != weight.shape or (scale is not None and scale.numel() != weight.shape[0]):
            raise LoraError(f"{path}: layer {name!r} has a {tuple(update.shape)} update in the LoRA but a "
                            f"{tuple(weight.shape)} weight in the model: this LoRA was trained for another model "
                            "size; pick a LoRA made for this model")
        updates[name] = update
    for name, weight in weights.items():
        merge_into_weight(weight, updates[name], entries[name].get("dora_scale"), strength)
    return len(weights)


def with_lora_file(model: ReferenceFluxModel, path: str | os.PathLike, strength: float = 1.0) -> ReferenceFluxModel:
    """A copy of `model` with the LoRA file merged in (`model` is left as it is)."""
    flux = copy.deepcopy(model.flux)
    merge_lora_into(flux, path, strength)
    return ReferenceFluxModel(flux, model.base_name)

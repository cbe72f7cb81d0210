"""Which Linear layers get a LoRA: target presets per model family, in ComfyUI's (= the original checkpoints')
module names, and matching them against a model.

A preset is a regex matched with `re.fullmatch` against full module names from the transformer's root (peft's
semantics for a string `target_modules`). Every preset stays inside the family's block list(s), and names only
Linear layers: embedders, final layers and norms are never trained. A model adapter may mark layers that are no torch
Linear as Linear targets (ComfyUI's quantized layers: mark_quantized_linear, quantized_linear.py).
"""
from __future__ import annotations

import re

from torch import nn

from ..train_config import ConfigError


class LoraError(ConfigError):
    """A LoRA setting, model or file does not fit; the message names the input and the fix."""

PRESETS = ("attention", "attention_mlp", "all_linear")
_PRESET_GROUPS = {"attention": ("attention",), "attention_mlp": ("attention", "mlp"),
                  "all_linear": ("attention", "mlp", "modulation")}

# family -> [(block list, {group: layer names inside one block})]. A name the model lacks simply matches nothing
# (SD3.5-large has no attn2, Wan text-to-video has no k_img/v_img, SD3's last context block has no proj/mlp).
_BLOCK_LAYERS: dict[str, list[tuple[str, dict[str, tuple[str, ...]]]]] = {
    "flux": [  # comfy/ldm/flux (= BFL checkpoints)
        ("double_blocks", {"attention": ("img_attn.qkv", "img_attn.proj", "txt_attn.qkv", "txt_attn.proj"),
                           "mlp": ("img_mlp.0", "img_mlp.2", "txt_mlp.0", "txt_mlp.2"),
                           "modulation": ("img_mod.lin", "txt_mod.lin")}),
        # linear1/linear2 fuse attention and MLP projections, so they belong to every preset
        ("single_blocks", {"attention": ("linear1", "linear2"), "modulation": ("modulation.lin",)}),
    ],
    "sd3": [  # comfy/ldm/modules/diffusionmodules/mmdit.py (SD3 / SD3.5 MMDiT)
        ("joint_blocks", {"attention": ("x_block.attn.qkv", "x_block.attn.proj", "x_block.attn2.qkv",
                                        "x_block.attn2.proj", "context_block.attn.qkv", "context_block.attn.proj"),
                          "mlp": ("x_block.mlp.fc1", "x_block.mlp.fc2", "context_block.mlp.fc1",
                                  "context_block.mlp.fc2"),
                          "modulation": ("x_block.adaLN_modulation.1", "context_block.adaLN_modulation.1")}),
    ],
    "lumina2": [  # comfy/ldm/lumina/model.py (NextDiT); the refiner blocks are not in the block list
        ("layers", {"attention": ("attention.qkv", "attention.out"),
                    "mlp": ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3"),
                    "modulation": ("adaLN_modulation.1",)}),
    ],
    "wan": [  # comfy/ldm/wan/model.py; modulation is a Parameter there, not a Linear
        ("blocks", {"attention": ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o", "cross_attn.q",
                                  "cross_attn.k", "cross_attn.v", "cross_attn.o", "cross_attn.k_img",
                                  "cross_attn.v_img"),
                    "mlp": ("ffn.0", "ffn.2")}),
    ],
    "qwen_image": [  # comfy/ldm/qwen_image/model.py
        ("transformer_blocks", {"attention": ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                                              "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj",
                                              "attn.to_add_out"),
                                "mlp": ("img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj",
                                        "txt_mlp.net.2"),
                                "modulation": ("img_mod.1", "txt_mod.1")}),
    ],
}


def _preset_regex(family: str, preset: str) -> str:
    alternatives = []
    for block_list, groups in _BLOCK_LAYERS[family]:
        layers = [name for g in _PRESET_GROUPS[preset] for name in groups.get(g, ())]
        if layers:
            alternatives.append(rf"{re.escape(block_list)}\.\d+\.(?:{'|'.join(map(re.escape, layers))})")
    return "|".join(alternatives)  # fullmatch applies to each alternative as a whole


TARGET_PRESETS: dict[str, dict[str, str]] = {f: {p: _preset_regex(f, p) for p in PRESETS} for f in _BLOCK_LAYERS}
FAMILIES = tuple(TARGET_PRESETS)


def target_regex_for(family: str, preset: str, target_regex: str | None = None) -> str:
    """The regex to match: `target_regex` when given, else the family's preset."""
    if target_regex:
        return target_regex
    if family not in TARGET_PRESETS:
        raise LoraError(f"model family {family!r} has no LoRA target presets (known: {', '.join(FAMILIES)}): "
                         "set target_regex to the layers to train, e.g. r'blocks\\.\\d+\\.attn\\.(q|k|v|o)'")
    if preset not in PRESETS:
        raise LoraError(f"LoRA targets={preset!r} is not a preset: choose one of {', '.join(PRESETS)}")
    return TARGET_PRESETS[family][preset]


QUANTIZED_MARK = "_tightrope_quantized_linear"  # on a layer instance: its weight format, for messages


def mark_quantized_linear(layer: nn.Module, kind: str) -> None:
    """Declare `layer` (in_features, out_features, a forward computing the linear map) a LoRA target although it is
    no torch Linear: a quantized layer whose weight only its own forward reads (quantized_linear.py); `kind` names
    its weight format in messages."""
    setattr(layer, QUANTIZED_MARK, kind)


def quantized_kind(layer: nn.Module) -> str | None:
    """The weight format of a layer marked by mark_quantized_linear, or None for any other module."""
    return getattr(layer, QUANTIZED_MARK, None)


def is_linear(layer: nn.Module) -> bool:
    """A torch Linear, or a layer a model adapter marked as a quantized Linear."""
    return isinstance(layer, nn.Linear) or quantized_kind(layer) is not None


def matching_linear_layers(module: nn.Module, regex: str) -> list[str]:
    """Names of the modules that `regex` fully matches, in model order; every one must be a Linear layer."""
    names = []
    for name, m in module.named_modules():
        if name and re.fullmatch(regex, name):
            if not is_linear(m):
                raise LoraError(f"LoRA target regex {regex!r} matches {name!r}, a {type(m).__name__}: LoRA goes on "
                                 "Linear layers only; make target_regex match the Linear layers inside it "
                                 f"(e.g. {name + '.0'!r} or {name + '.qkv'!r})")
            names.append(name)
    return names


def linear_layer_names(module: nn.Module, limit: int | None = None) -> list[str]:
    """The model's Linear layer names (for error messages), those inside blocks first."""
    names = [n for n, m in module.named_modules() if is_linear(m)]
    names.sort(key=lambda n: not re.search(r"\.\d+\.", n))  # stable: model order within each group
    return names[:limit] if limit else names

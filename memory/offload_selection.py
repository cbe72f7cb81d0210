"""Choose which blocks to offload for a strategy, and refuse blocks whose weights cannot stream.

Why "spread": a transfer hides behind compute only if there is compute to hide behind. Offloading the smallest
blocks first moves the fewest bytes per offloaded block, and spacing them out leaves resident blocks in between
whose compute covers the next offloaded block's copy.
"""
from __future__ import annotations

import math

from torch import nn

from .strategy import LayerOffloadConfig, StrategyError
from .tensor_kinds import keeps_bytes


def select_offloaded(block_bytes: list[int], config: LayerOffloadConfig) -> list[int]:
    """Indices (model order) of the blocks whose frozen weights live in host memory."""
    n = len(block_bytes)
    if config.blocks is not None:
        bad = [i for i in config.blocks if i >= n]
        if bad:
            raise StrategyError(f"Strategy.offload_blocks has indices {bad} but the model has {n} blocks "
                                f"(0..{n - 1}): use indices in that range")
        return list(config.blocks)
    target = config.fraction * sum(block_bytes)
    if target <= 0:
        return []
    if config.policy in ("first", "last"):
        order = list(range(n)) if config.policy == "first" else list(reversed(range(n)))
        chosen, total = [], 0
        for i in order:
            if total >= target * (1 - 1e-9):
                break
            chosen.append(i)
            total += block_bytes[i]
        return sorted(chosen)
    return _spread(block_bytes, target)


def _spread(block_bytes: list[int], target: float) -> list[int]:
    groups: dict[int, list[int]] = {}
    for i, b in enumerate(block_bytes):
        groups.setdefault(b, []).append(i)
    chosen: list[int] = []
    remaining = target * (1 - 1e-9)
    for size in sorted(groups):
        if remaining <= 0:
            break
        members = groups[size]
        k = len(members) if size == 0 else max(1, min(len(members), math.ceil(remaining / size)))
        chosen += [members[int((j + 0.5) * len(members) / k)] for j in range(k)]
        remaining -= k * size
    return sorted(chosen)


class UnstreamableWeightError(StrategyError):
    """An offloaded block holds a frozen weight without bytes of its own to stream: a wrapper tensor subclass (its
    data in inner tensors, e.g. torchao's quantized tensors). Storage subclasses such as ComfyUI-GGUF's GGMLTensor
    stream as bytes (tensor_kinds.py). A user error: the message names the weights and the fix."""


def check_streamable(blocks: list[tuple[str, nn.Module]], offloaded: list[int]) -> None:
    """Refuse, before anything is moved, offloaded blocks (name, module) holding frozen weights that layer offload
    cannot stream (UnstreamableWeightError)."""
    odd: dict[str, list[str]] = {}
    for i in offloaded:
        name, module = blocks[i]
        for param_name, p in module.named_parameters():
            if not p.requires_grad and not keeps_bytes(p.data):
                odd.setdefault(type(p.data).__name__, []).append(f"{name}.{param_name}")
    if odd:
        n, first = sum(map(len, odd.values())), next(iter(odd.values()))[0]
        raise UnstreamableWeightError(
            f"layer offload streams a weight's own bytes, but {n} frozen weight(s) of the blocks to offload are "
            f"{' / '.join(odd)} tensors (e.g. {first}), which keep no bytes of their own to stream. Keep those blocks "
            "resident (offload_fraction 0, or offload_blocks without them), or load the model as plain weights: "
            "its safetensors with Load Diffusion Model (weight_dtype fp8_e4m3fn halves its memory) or a GGUF file "
            "with ComfyUI-GGUF's Unet Loader (GGUF)")

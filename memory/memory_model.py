"""A model of device memory for weights: what the strategy keeps resident, predicted from sizes alone.

Used by the planner, and checked in tests against the bytes the runtime really puts on the device.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .layer_offload import _aligned
from .tensor_kinds import keeps_own_dtype


@dataclass(frozen=True)
class WeightSizes:
    block_frozen: list[int]   # per block, frozen weight bytes in the stored (weight) dtype
    block_packed: list[int]   # the same, as laid out in an offload slot (each tensor aligned)
    block_trainable: list[int]
    other: int                # everything outside the blocks (embedders, final layer), trainable or not


def measure_weight_sizes(model: nn.Module, blocks: list[nn.Module], weight_itemsize: int | None) -> WeightSizes:
    """Sizes as the runtime will store them (weight_itemsize overrides frozen params' dtype size)."""
    in_blocks, frozen, packed, trainable = set(), [], [], []
    for b in blocks:
        f = k = t = 0
        for p in b.parameters():
            in_blocks.add(id(p))
            if p.requires_grad:
                t += p.numel() * p.element_size()
            else:  # the parts of a wrapped weight keep their dtype (tensor_kinds.keep_own_dtype)
                size = p.element_size() if keeps_own_dtype(p) else weight_itemsize or p.element_size()
                f += p.numel() * size
                k += _aligned(p.numel() * size)
        frozen.append(f)
        packed.append(k)
        trainable.append(t)
    other = sum(p.numel() * (p.element_size() if p.requires_grad or not weight_itemsize or keeps_own_dtype(p)
                             else weight_itemsize)
                for p in model.parameters() if id(p) not in in_blocks)
    other += sum(b.numel() * b.element_size() for b in model.buffers())
    return WeightSizes(frozen, packed, trainable, other)


def predict_slot_bytes(sizes: WeightSizes, offloaded: list[int], prefetch_depth: int) -> int:
    """The layer offload's slot area: depth+1 cells (at most one per offloaded block), each the largest offloaded
    block as packed; smaller blocks share cells (layer_offload), so they add nothing."""
    off = set(offloaded)
    return min(prefetch_depth + 1, len(off)) * max((sizes.block_packed[i] for i in off), default=0)


def predict_resident_weight_bytes(sizes: WeightSizes, offloaded: list[int], prefetch_depth: int) -> int:
    """Device bytes for weights: resident blocks in full, offloaded blocks through the slot area."""
    off = set(offloaded)
    resident = sum(b for i, b in enumerate(sizes.block_frozen) if i not in off)
    return sizes.other + sum(sizes.block_trainable) + resident + predict_slot_bytes(sizes, offloaded, prefetch_depth)

"""Find a model's sequential transformer blocks, in execution order.

Block lists are discovered by the names the model families use, or passed in (Strategy.block_lists); nothing else in
the runtime knows an attribute name.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .strategy import StrategyError

# Groups of block lists, in execution order, per model family. The first group found wins.
KNOWN_BLOCK_LISTS: tuple[tuple[str, ...], ...] = (
    ("double_blocks", "single_blocks"),                   # Flux (BFL / ComfyUI layout)
    ("transformer_blocks", "single_transformer_blocks"),  # Flux (diffusers layout)
    ("joint_blocks",),                                    # SD3 / SD3.5 MMDiT
    ("transformer_blocks",),                              # Qwen-Image
    ("layers",),                                          # Lumina 2 / NextDiT
    ("blocks",),                                          # Wan 2.x
)


# A block module with this attribute set True adds to its input tensors in place (ComfyUI's: `x += ...`); its adapter
# sets it. Per-block compile then lets the graph work on copies of the inputs (memory/mutating_blocks.py).
MUTATES_INPUTS = "tightrope_mutates_inputs"


@dataclass(frozen=True)
class Block:
    name: str         # dotted name from the model root, e.g. "double_blocks.3"
    module: nn.Module


def discover_blocks(model: nn.Module, block_lists: tuple[str, ...] | None = None) -> list[Block]:
    """The model's transformer blocks in execution order (all lists of a group, concatenated)."""
    lists = _explicit(model, block_lists) if block_lists else _by_known_names(model) or _largest_uniform_list(model)
    if not lists:
        raise StrategyError(
            f"found no transformer block list in {type(model).__name__} (looked for "
            f"{', '.join('/'.join(g) for g in KNOWN_BLOCK_LISTS)} and for a ModuleList of like blocks): set "
            "Strategy.block_lists to the dotted names of its block lists, e.g. ['blocks']")
    return [Block(f"{name}.{i}", m) for name, lst in lists for i, m in enumerate(lst)]


def _explicit(model: nn.Module, names: tuple[str, ...]) -> list[tuple[str, nn.ModuleList]]:
    out = []
    for name in names:
        try:
            lst = model.get_submodule(name)
        except AttributeError:
            raise StrategyError(f"Strategy.block_lists names '{name}', which {type(model).__name__} does not have: "
                                "give the dotted path of a ModuleList of its transformer blocks") from None
        if not isinstance(lst, (nn.ModuleList, nn.Sequential)) or len(lst) == 0:
            raise StrategyError(f"Strategy.block_lists names '{name}', which is a {type(lst).__name__}, not a "
                                "non-empty ModuleList of blocks: give the block list itself")
        out.append((name, lst))
    return out


def _by_known_names(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    lists = {name: m for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 0}
    for group in KNOWN_BLOCK_LISTS:
        # the group must sit under one parent (e.g. "diffusion_model." or peft's "base_model.model.")
        for parent in sorted({n[: -len(group[0])] for n in lists if n == group[0] or n.endswith("." + group[0])},
                             key=len):
            found = [(parent + g, lists[parent + g]) for g in group if parent + g in lists]
            if found and found[0][0] == parent + group[0]:
                return found
    return []


def _largest_uniform_list(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    best = None
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) >= 2 and len({type(c) for c in m}) == 1:
            size = sum(p.numel() for p in m.parameters())
            if best is None or size > best[0]:
                best = (size, name, m)
    return [(best[1], best[2])] if best else []

"""Checks of a whole workflow that no single node can make, made before any node runs.

ComfyUI gives a node's VALIDATE_INPUTS its own widgets only (a linked input arrives as None), so a Train node that
continues another's session cannot see how that one trains: there these are found when the node runs (ComfyUI keeps
the nodes before it cached). `tightrope run` has the whole graph: it calls `train_chain_problems` after the graph's
own validation, so a chain is refused before its first node trains instead of after it (found by a helper checking
the docs: a second Train node in another optimizer failed after the first had trained)."""
from __future__ import annotations

from typing import Any

from ..headless.graph import Link
from ..training.host_optimizer import check_offloadable
from ..training.train_config import ConfigError

TRAIN, STRATEGY = "TightropeTrain", "TightropeMemoryStrategy"


def train_chain_problems(graph: dict) -> list[str]:
    """One line per problem (the node, the input and the fix): a Train node continuing another's session in another
    optimizer (its state cannot go on), or with optimizer offload (its own Memory Strategy or the one its session
    trained with, manual mode) and an optimizer that cannot step on the host, or with an auto strategy planning for
    the free memory of a device that cannot say it (the CPU). Values linked from other nodes are not known yet: those
    are checked when the node runs."""
    problems = []
    for node_id, node in graph.items():
        optimizer = node.inputs.get("optimizer")
        if node.class_type != TRAIN or not isinstance(optimizer, str):
            continue
        upstream = _linked(graph, node.inputs.get("session"), TRAIN)
        was = graph[upstream].inputs.get("optimizer") if upstream is not None else None
        if isinstance(was, str) and was != optimizer:
            problems.append(f"Train node {node_id} sets optimizer={optimizer!r}, but continues the session of Train "
                            f"node {upstream}, trained with {was!r}, whose state cannot go on in another optimizer: "
                            f"set optimizer to {was!r} in node {node_id}, or give it model, dataset and lora inputs "
                            "instead of the session to start a new LoRA")
        strategy = _strategy_of(graph, node_id)
        if strategy is not None and strategy.inputs.get("mode") == "manual" \
                and strategy.inputs.get("optimizer_offload") is True:
            try:
                check_offloadable(optimizer)
            except ConfigError as e:
                problems.append(f"Train node {node_id}: {e}")
        device = node.inputs.get("device")
        own = _linked(graph, node.inputs.get("strategy"), STRATEGY)  # a continued session keeps its plan
        auto_free = own is not None and graph[own].inputs.get("mode") == "auto" \
            and graph[own].inputs.get("vram_budget_gb") == 0
        if auto_free and isinstance(device, str) and not _reads_free_memory(device):
            problems.append(f"Train node {node_id} trains on device {device!r} with an auto Memory Strategy whose "
                            "vram_budget_gb=0 plans for the free GPU memory, which that device cannot say: set "
                            "vram_budget_gb to the memory to plan for, or set the strategy yourself (mode manual)")
    return problems


def _reads_free_memory(device: str) -> bool:
    """Whether an auto strategy's budget 0 (the free memory) can be read on the Train node's `device` (a device that
    is not available is the Train node's own check to report)."""
    from ..memory.planner import reads_free_memory
    from ..training.distributed import resolve_device
    try:
        return reads_free_memory(resolve_device(device))
    except ValueError:
        return True


def _linked(graph: dict, value: Any, class_type: str) -> str | None:
    """The id of the node of `class_type` that `value` links from, or None."""
    if isinstance(value, Link) and value.from_id in graph and graph[value.from_id].class_type == class_type:
        return value.from_id
    return None


def _strategy_of(graph: dict, node_id: str, seen: frozenset = frozenset()) -> Any:
    """The Memory Strategy node a Train node trains with: its own strategy input, else (continuing a session) the
    one the session was trained with."""
    node = graph[node_id]
    own = _linked(graph, node.inputs.get("strategy"), STRATEGY)
    if own is not None:
        return graph[own]
    upstream = _linked(graph, node.inputs.get("session"), TRAIN)
    if upstream is None or upstream in seen or "strategy" in node.inputs and node.inputs["strategy"] is not None:
        return None
    return _strategy_of(graph, upstream, seen | {node_id})

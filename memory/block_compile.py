"""Per-block torch.compile with an activation-memory budget.

Each block is compiled on its own (one graph per block type, reused by every block of that type: compile time is
seconds, not minutes). The budget is read by AOTAutograd's partitioner while the graph is compiled, and dynamo's
guards do not look at it, so a graph compiled under one budget would be reused under another. Hence one backend
callable per (backend, budget, mode): the budget is applied while *that* backend compiles (and restored after), and
dynamo keys its cache on the backend, so each budget gets its own graphs. Inductor options of the compile mode reach
both the forward and the lazily compiled backward graph (inductor's own config_patches).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch._functorch.config as functorch_config

from .strategy import CompileConfig

_BACKENDS: dict[tuple[str, float, str], Callable] = {}


def _backend(name: str, budget: float, mode: str) -> Callable:
    key = (name, budget, mode)
    if key not in _BACKENDS:
        if name == "inductor":
            from torch._inductor.compile_fx import compile_fx
            options = {} if mode == "default" else torch._inductor.list_mode_options(mode)

            def inner(gm, example_inputs):
                # config_patches, unlike a patch around this call, also covers the backward graph, which
                # AOTAutograd compiles lazily at the first backward, long after this call has returned
                return compile_fx(gm, example_inputs, config_patches=options)
        else:
            inner = torch._dynamo.lookup_backend(name)

        def backend(gm, example_inputs):
            # the partitioner reads the budget while it splits the joint graph, inside this call (forward time)
            with functorch_config.patch(activation_memory_budget=budget):
                return inner(gm, example_inputs)

        backend.__name__ = f"tightrope_{name}_budget{budget}_{mode}"
        _BACKENDS[key] = backend
    return _BACKENDS[key]


def compile_block(forward: Callable, config: CompileConfig) -> Callable:
    return torch.compile(forward, backend=_backend(config.backend, config.activation_memory_budget, config.mode))


def compiled_graph_count() -> int:
    """Graphs compiled in this process so far (recompiles show up as growth between steps)."""
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])

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

from .strategy import CompileConfig, StrategyError

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


RECOMPILE_LIMIT = 64  # per code object while a runtime compiles (dynamo's default: 8)


class CompileCaches:
    """Dynamo's caches for one runtime's compiled blocks (open from apply to undo).

    Dynamo keeps compiled graphs on the code objects it compiled: the blocks' forwards, and functions of peft's
    adapters where a graph breaks (LoHa's, LoKr's). A long-lived process (a ComfyUI server) that trains one LoRA
    setup after another piled entries up on those code objects (adapter types x grad modes x block types), and past
    dynamo's recompile limit (8) the blocks ran eagerly without a word: slower, and holding the activations the
    memory budget was meant to drop. So while the runtime runs the limit is RECOMPILE_LIMIT (one LoKr run alone can
    pass 8), and at undo every code object that gained cache entries in the meantime has its cache dropped (ComfyUI
    runs one prompt at a time, so those entries are this run's; an entry another compile had there is compiled
    again when next needed). A chain of Train nodes compiles again at each node (inductor's graph cache makes that
    quicker than the first time)."""

    def __init__(self):
        self._before = _entry_counts()
        self._limit = torch._dynamo.config.patch(recompile_limit=max(RECOMPILE_LIMIT,
                                                                     torch._dynamo.config.recompile_limit))
        self._limit.__enter__()

    def close(self) -> None:
        try:
            from torch._C._dynamo.eval_frame import reset_code
            for code, n in _entry_counts().items():
                if n > self._before.get(code, 0):
                    reset_code(code)
        finally:
            self._limit.__exit__(None, None, None)


def _entry_counts() -> dict:
    """code object -> how many compiled entries dynamo holds on it, for every code object dynamo has seen."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.convert_frame import input_codes
    codes = (ref() for ref in list(input_codes.seen))
    return {code: len(_debug_get_cache_entry_list(code)) for code in codes if code is not None}


def compile_block(forward: Callable, config: CompileConfig) -> Callable:
    return torch.compile(forward, backend=_backend(config.backend, config.activation_memory_budget, config.mode))


def compiled_graph_count() -> int:
    """Graphs compiled in this process so far (recompiles show up as growth between steps)."""
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def _triton_installed() -> bool:
    try:
        from torch.utils._triton import has_triton
    except ImportError:  # a torch without the helper: let inductor say it
        return True
    return has_triton()


def check_compiler(compiler: CompileConfig, device: torch.device) -> None:
    """compile=per_block on a CUDA GPU builds its kernels with Triton, which PyTorch for Windows does not ship:
    without it the first step failed deep in inductor (TritonMissing, a traceback), after the model and data had
    loaded. Refused here in one line, before anything is placed."""
    if not (compiler.per_block and compiler.backend == "inductor" and device.type == "cuda"):
        return
    if not _triton_installed():
        raise StrategyError("compile=per_block builds the blocks' GPU kernels with Triton, which is not installed "
                            "(PyTorch for Windows does not ship it): set the Memory Strategy's compile to off, or "
                            "install Triton (on Windows: pip install triton-windows)")
    props = torch.cuda.get_device_properties(device)
    if props.major < 7:  # inductor's GPUTooOldForTriton, at the first step
        raise StrategyError(f"compile=per_block builds the blocks' GPU kernels with Triton, which needs a GPU of CUDA "
                            f"capability 7.0 or newer; {device} ({props.name}) has {props.major}.{props.minor}: set "
                            "the Memory Strategy's compile to off")

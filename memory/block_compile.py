"""Per-block torch.compile with an activation-memory budget.

Each block is compiled on its own (one graph per block type, reused by every block of that type: compile time is
seconds, not minutes). The budget is read by AOTAutograd's partitioner while the graph is compiled, and dynamo's
guards do not look at it, so a graph compiled under one budget would be reused under another. Hence one backend
callable per (backend, budget, mode): the budget is applied while *that* backend compiles (and restored after), and
dynamo keys its cache on the backend, so each budget gets its own graphs. Inductor options of the compile mode reach
both the forward and the lazily compiled backward graph (inductor's own config_patches).
"""
from __future__ import annotations

import sys
import types
import weakref
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
KEEP_LIMIT = RECOMPILE_LIMIT // 2  # entries a code object we compiled on may keep between runs


class CompileCaches:
    """Dynamo's caches for the runtimes' compiled blocks, kept from one runtime to the next (bounded).

    Dynamo keeps compiled graphs on the code objects it compiled. Each block forward is compiled as a function with a
    code object of Tightrope's own (`_own_code`: a copy of the block class's forward), so Tightrope's graphs never
    sit with, count against the recompile limit of, or get dropped with, the graphs of a compile of the same class
    elsewhere in the process (a ComfyUI user's compiled model). Those graphs are kept at undo: the next runtime of
    the same setup (a chained Train node, the next prompt, another model of the same architecture) runs them without
    compiling again (dynamo's guards check the blocks' structure, tensors' shapes, dtypes, devices and grad mode, not
    the module objects, so a kept graph holds no reference to a model: a model the user drops is freed).

    A long-lived process (a ComfyUI server) that trains one LoRA setup after another piles entries up (adapter
    types x grad modes x block types x budgets), and past dynamo's recompile limit (8) the blocks ran eagerly without
    a word: slower, and holding the activations the memory budget was meant to drop. So while a runtime runs the
    limit is RECOMPILE_LIMIT (one LoKr run alone can pass 8), and when a runtime is applied every code object that a
    runtime compiled on and that holds KEEP_LIMIT entries or more is dropped first (its graphs are compiled again
    when next needed): a run always starts with room for RECOMPILE_LIMIT - KEEP_LIMIT new graphs per code object.
    Code objects not Tightrope's own gain entries only where a graph breaks (functions of peft's LoHa and LoKr)."""

    def __init__(self):
        _drop_piled_up()
        self._before = _entry_counts()
        # skip_nnmodule_hook_guards=False: graphs kept for later runtimes must not bake in the hooks (or their
        # absence) of the modules inside the blocks they were compiled on (dynamo's default skips those guards)
        self._limit = torch._dynamo.config.patch(recompile_limit=max(RECOMPILE_LIMIT,
                                                                     torch._dynamo.config.recompile_limit),
                                                 skip_nnmodule_hook_guards=False)
        self._limit.__enter__()

    def close(self) -> None:
        try:
            for key, (code, n) in _entry_counts().items():
                if n > self._before.get(key, (None, 0))[1]:
                    _COMPILED_ON[key] = weakref.ref(code)
        finally:
            self._limit.__exit__(None, None, None)


# id(code) -> code object runtimes gained entries on (by identity: equal code objects are distinct caches)
_COMPILED_ON: dict[int, "weakref.ref[types.CodeType]"] = {}


def _drop_piled_up() -> None:
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list, reset_code
    for key, ref in list(_COMPILED_ON.items()):
        code = ref()
        if code is None or len(_debug_get_cache_entry_list(code)) >= KEEP_LIMIT:
            if code is not None:
                reset_code(code)
            del _COMPILED_ON[key]


def _entry_counts() -> dict:
    """id(code) -> (code object, how many compiled entries dynamo holds on it), for every code object dynamo has
    seen. Keyed by identity: code objects compare equal by value, and a copy is another cache (`_own_code`)."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.convert_frame import input_codes
    codes = (ref() for ref in list(input_codes.seen))
    return {id(code): (code, len(_debug_get_cache_entry_list(code))) for code in codes if code is not None}


_MARK = "tightrope: per-block compile"
# id(a function's code object) -> (that code object, Tightrope's copy of it), while the function's code is alive
_OWN_CODE: dict[int, tuple["weakref.ref[types.CodeType]", types.CodeType]] = {}


def _own_code(fn: Callable) -> Callable:
    """fn (a function or a bound method) running a copy of its code object made once per code object: the same
    bytecode, so the same graphs, but dynamo's cache for it is Tightrope's alone (dynamo keys its cache on the code
    object). Anything else is returned as it is."""
    if isinstance(fn, types.MethodType):
        func = _own_code(fn.__func__)
        return fn if func is fn.__func__ else types.MethodType(func, fn.__self__)
    if not isinstance(fn, types.FunctionType):
        return fn
    key = id(fn.__code__)
    known = _OWN_CODE.get(key)
    if known is not None and known[0]() is fn.__code__:
        code = known[1]
    else:
        # one constant more, never loaded: the copy runs as the original but does not compare equal to it (code
        # objects compare by value, and dynamo keys some of its tables, its resume functions', on that)
        code = fn.__code__.replace(co_consts=fn.__code__.co_consts + (_MARK,))
        _OWN_CODE[key] = (weakref.ref(fn.__code__, lambda _, key=key: _OWN_CODE.pop(key, None)), code)
    own = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    own.__kwdefaults__, own.__qualname__, own.__module__ = fn.__kwdefaults__, fn.__qualname__, fn.__module__
    own.__dict__.update(fn.__dict__)
    return own


def compile_block(forward: Callable, config: CompileConfig, fullgraph: bool = False) -> Callable:
    return torch.compile(_own_code(forward), fullgraph=fullgraph,
                         backend=_backend(config.backend, config.activation_memory_budget, config.mode))


def compiled_graph_count() -> int:
    """Graphs compiled in this process so far (recompiles show up as growth between steps)."""
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def _check_cpp_compiler() -> None:
    """Inductor's own search for a C++ compiler (cached by it), the one its first CPU kernel build would run."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
        from torch._inductor.exc import InvalidCxxCompiler
    except ImportError:  # a torch without these: let inductor say it
        return
    try:
        get_cpp_compiler()
    except RuntimeError as e:  # InvalidCxxCompiler; on Windows torch <= 2.11 a RuntimeError from the missing cl
        if not isinstance(e, InvalidCxxCompiler) and not isinstance(e.__cause__, FileNotFoundError):
            raise  # not a missing compiler (e.g. MSVC without its English language pack): inductor's own words
        if sys.platform == "win32":
            what = "MSVC's cl: run ComfyUI from a Developer Command Prompt of Visual Studio Build Tools"
        else:  # what inductor looked for: CXX, else g++ (clang++ on macOS)
            from torch._inductor import config
            cxx = config.cpp.cxx if isinstance(config.cpp.cxx, (list, tuple)) else (config.cpp.cxx,)
            what = f"{' or '.join(str(c) for c in cxx if c) or 'g++'}: install it, or set CXX to another"
        raise StrategyError(f"compile=per_block builds the blocks' CPU kernels with a C++ compiler, and inductor found "
                            f"none ({what}): set the Memory Strategy's compile to off, or install one") from None


def _triton_installed() -> bool:
    """Whether the Triton package imports. Not torch's has_triton(): that also asks for a GPU of capability 7.0 (on
    the current device), so an older GPU with Triton installed read as Triton missing (the advice: install it)."""
    try:
        from torch.utils._triton import has_triton_package
    except ImportError:  # a torch without the helper: let inductor say it
        return True
    return has_triton_package()


def check_compiler(compiler: CompileConfig, device: torch.device) -> None:
    """compile=per_block on a CUDA GPU builds its kernels with Triton, which PyTorch for Windows does not ship:
    without it the first step failed deep in inductor (TritonMissing, a traceback), after the model and data had
    loaded. Refused here in one line, before anything is placed. The same for the CPU's kernels, which inductor builds
    with a C++ compiler: none on the path (Windows without MSVC's cl, a Linux image without g++) failed so too."""
    if not (compiler.per_block and compiler.backend == "inductor" and device.type in ("cuda", "cpu")):
        return
    if device.type == "cpu":
        _check_cpp_compiler()
        return
    props = torch.cuda.get_device_properties(device)
    if props.major < 7:  # inductor's GPUTooOldForTriton, at the first step
        raise StrategyError(f"compile=per_block builds the blocks' GPU kernels with Triton, which needs a GPU of CUDA "
                            f"capability 7.0 or newer; {device} ({props.name}) has {props.major}.{props.minor}: set "
                            "the Memory Strategy's compile to off")
    if not _triton_installed():
        raise StrategyError("compile=per_block builds the blocks' GPU kernels with Triton, which is not installed "
                            "(PyTorch for Windows does not ship it): set the Memory Strategy's compile to off, or "
                            "install Triton (on Windows: pip install triton-windows)")

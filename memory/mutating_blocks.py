"""Compiled forwards of blocks that change their inputs in place (marked MUTATES_INPUTS: ComfyUI's add residuals with
`x += ...`).

The partitioner saves a graph input rather than a copy of it (it costs no memory), so a compiled block that adds a
residual in place to its input changed a tensor saved for backward (autograd: "modified by an inplace operation").
Such a block runs on copies of its tensor arguments made inside its compiled graph: the in-place add then changes a
tensor of the graph's own, and the partitioner still saves the caller's input, not a copy.

That holds only while the block is one graph. A graph break inside it (ComfyUI's sub-quadratic attention asks psutil
for free memory: its attention on the CPU, or with --use-quad-cross-attention / --use-split-cross-attention on a GPU)
splits it: dynamo runs the copying wrapper eagerly and compiles the block's own frames apart, so the copies are the
inputs of the graphs on both sides of the break. The graph before it saved a copy (an input, free) and the graph after
it added the residual to that same tensor (copied back into its input in place): autograd refused, or, under saved-
tensor hooks (layer offload), which skip autograd's version check, the graph before the break ran its backward on the
changed tensor: wrong gradients without a word.

So each block type is first compiled whole (fullgraph): one that breaks is known at its first trace, before anything
ran, and from then on runs compiled in pieces on copies made eagerly, of which any tensor saved for backward is saved
as a copy taken when it was saved (what eager pays: the adapter's norms save a copy of their input).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

import torch

from .block_compile import compile_block
from .strategy import CompileConfig

# the saved-tensor hooks in force (private, in torch 2.11-2.15; checked, not assumed, for older ones)
_TOP_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
# block types (the classes) whose compiled forward breaks its graph
_BREAKING: "weakref.WeakSet[type]" = weakref.WeakSet()


def _copies(args: tuple, kwargs: dict) -> tuple[list, dict]:
    """The arguments with each tensor among them copied."""
    return ([a.clone() if isinstance(a, torch.Tensor) else a for a in args],
            {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})


def cloning_inputs(fn: Callable) -> Callable:
    """fn on copies of its tensor arguments (inside the graph when compiled with it). Only for blocks marked
    MUTATES_INPUTS: a copy changes what the partitioner saves under a memory budget. Also the fallback of a
    checkpointed token-chunked block to its own forward (the checkpoint itself clones nothing there)."""
    def cloned(*args, **kwargs):
        args, kwargs = _copies(args, kwargs)
        return fn(*args, **kwargs)
    return cloned


class MutatingBlock:
    """The compiled forward of a block marked MUTATES_INPUTS (module docstring)."""

    def __init__(self, forward: Callable, config: CompileConfig, kind: type):
        self.kind = kind
        self._eager = cloning_inputs(forward)
        self._whole = compile_block(self._eager, config, fullgraph=True)
        self._pieces = compile_block(forward, config)

    def __call__(self, *args, **kwargs):
        if self.kind not in _BREAKING:
            try:
                return self._whole(*args, **kwargs)
            except torch._dynamo.exc.Unsupported:  # a graph break, raised while tracing, before the block ran
                _BREAKING.add(self.kind)
            except torch._dynamo.exc.FailOnRecompileLimitHit:  # fullgraph's error where dynamo would run it eagerly
                return self._eager(*args, **kwargs)
        if _TOP_HOOKS is None:  # a torch that cannot say which hooks are in force: eager on copies, correct
            return self._eager(*args, **kwargs)
        args, kwargs = _copies(args, kwargs)
        copies = {_storage(a) for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)} - {None}
        with torch.autograd.graph.saved_tensors_hooks(*_saving_copies_of(copies)):
            return self._pieces(*args, **kwargs)


def _saving_copies_of(storages: set[int]) -> tuple[Callable, Callable]:
    """Saved-tensor hooks that save a copy of any tensor in `storages`, around the hooks in force (the runtime's
    layer and activation offload: only the innermost hooks run)."""
    outer = _TOP_HOOKS(False)
    outer_pack, outer_unpack = outer if outer is not None else (None, None)

    # never traced: autograd calls pack from the block's eager parts too (a frame dynamo does not compile), where
    # dynamo compiled it (breaking at the storage query), and its closure (these copies' storages) is new at each
    # call: recompiled at every block call, every step, until the recompile limit (test_compile_steps.py)
    @torch.compiler.disable
    def pack(t: torch.Tensor) -> Any:
        if _storage(t) in storages:
            t = t.clone()
        return t if outer_pack is None else outer_pack(t)

    @torch.compiler.disable
    def unpack(x: Any) -> torch.Tensor:
        return x if outer_unpack is None else outer_unpack(x)
    return pack, unpack


def _storage(t: torch.Tensor) -> int | None:
    """Where t's bytes are; None for a tensor without storage of its own (a wrapper subclass: fp8-mixed weights)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None

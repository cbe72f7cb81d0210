"""Non-reentrant activation checkpointing of one block call.

Tensor keyword arguments are passed to torch's checkpoint positionally, so that they too are saved through
saved-tensor hooks (where activation offload can move them) rather than captured by a closure. A block that adds
residuals in place to its inputs (ComfyUI's Flux: `img += ...`) would change the tensors the recompute starts from,
so those are cloned inside the checkpointed region; other inputs are not (each clone is a whole-sequence tensor, and
the recompute's lives through the block's backward). Which ones, a block's InPlaceInputs learns from autograd's
version counters: its first forward clones all, every later run (the recompute of that first call included, which
makes the step's backward peak) those the block changed; an input changed uncloned is an error. A recompute that
clones fewer inputs than its forward did computes the same values: what it leaves uncloned the block never changes.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint


class InPlaceInputs:
    """The inputs (position, or keyword name) one block changes in place, learnt from its checkpointed calls."""

    def __init__(self) -> None:
        self.changed: frozenset[int | str] | None = None  # None: no call has returned yet

    def to_clone(self, names: list[int | str]) -> frozenset[int | str]:
        return frozenset(names) if self.changed is None else self.changed

    def check(self, names: list[int | str], inputs: list[torch.Tensor], before: list[int],
              cloned: frozenset[int | str]) -> None:
        """After a call: note the inputs whose version moved; one that was not cloned was changed in place."""
        moved = {n for n, t, v in zip(names, inputs, before) if t._version != v}
        self.changed = frozenset(moved | (self.changed or set()))
        hit = sorted(map(_describe, moved - cloned))
        if hit:
            raise RuntimeError(f"a checkpointed block changed {', '.join(hit)} in place, which its earlier calls left "
                               "unchanged: it changes its inputs only on some calls, and the tensor the checkpoint "
                               "recomputes from (the caller's) was changed with it. Later calls copy that input "
                               "first; this call's results cannot be trusted")


def checkpointed_call(fn: Callable, args: tuple, kwargs: dict[str, Any], *,
                      clone_inputs: bool | InPlaceInputs = True) -> Any:
    """fn(*args, **kwargs) checkpointed. clone_inputs: True clones every tensor input, False none (a block that never
    changes them), an InPlaceInputs those its block was seen to change."""
    tensor_keys = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    static = {k: v for k, v in kwargs.items() if k not in tensor_keys}
    n_args = len(args)
    keys = [*range(n_args), *tensor_keys]  # each input's name: its position, or its keyword
    inputs = (*args, *(kwargs[k] for k in tensor_keys))
    names = [n for n, t in zip(keys, inputs) if isinstance(t, torch.Tensor)]
    learnt = clone_inputs if isinstance(clone_inputs, InPlaceInputs) else None
    fixed = None if learnt else frozenset(names if clone_inputs else ())

    def run(*flat):  # the forward, then (in backward) the recompute
        cloned = fixed if fixed is not None else learnt.to_clone(names)
        flat = tuple(t.clone() if n in cloned else t for n, t in zip(keys, flat))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        before = [t._version for t in tensors] if learnt else []
        out = fn(*flat[:n_args], **dict(zip(tensor_keys, flat[n_args:])), **static)
        if learnt:
            learnt.check(names, tensors, before, cloned)
        return out

    return checkpoint(run, *inputs, use_reentrant=False)


def _describe(name: int | str) -> str:
    return f"its argument {name}" if isinstance(name, int) else f"its keyword argument '{name}'"


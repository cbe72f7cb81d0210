"""Non-reentrant activation checkpointing of one block call.

Tensor keyword arguments are passed to torch's checkpoint positionally, so that they too are saved through
saved-tensor hooks (where activation offload can move them) rather than captured by a closure. Inputs are cloned
inside the checkpointed region, so blocks that add residuals in place (ComfyUI's Flux does) cannot change the
tensors the recompute will start from; `clone_inputs=False` where they are never changed (token-chunked forwards):
the recompute's copy would otherwise live through the block's backward.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint


def checkpointed_call(fn: Callable, args: tuple, kwargs: dict[str, Any], *, clone_inputs: bool = True) -> Any:
    tensor_keys = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    static = {k: v for k, v in kwargs.items() if k not in tensor_keys}
    n_args = len(args)

    def run(*flat):
        if clone_inputs:
            flat = tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in flat)
        return fn(*flat[:n_args], **dict(zip(tensor_keys, flat[n_args:])), **static)

    return checkpoint(run, *args, *(kwargs[k] for k in tensor_keys), use_reentrant=False)

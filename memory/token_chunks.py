"""Token-chunked block forwards: the per-block working set of forward + backward, cut by computing every token-wise
part of a transformer block (norms, modulation, the qkv / MLP / output projections) in token chunks, each chunk one
recomputed region; only attention sees the whole sequence.

A model family registers, per block class, a function computing that block's forward in chunks (the reference Flux
in training/models/reference_flux.py, ComfyUI's Flux in training/models/comfy_flux_chunks.py). `memory/` never
knows the block's maths: the runtime looks the function up by the block's type and calls it with a `ChunkContext`,
whose `run` is how one chunk is recomputed (the runtime's own, which also makes sure the block's weights are on the
device when a chunk is recomputed in backward).

The contract of a chunked forward `fn(block, ctx, *args, **kwargs)`:
  - returns what `block`'s own forward returns for the same arguments (same structure, same values up to the
    rounding of a different summation order: none here, chunks split tokens, never a reduction); random ops
    (LoRA dropout) draw per region, so with dropout their values match the plain forward's in distribution, not
    draw for draw (a block's recompute redraws exactly: each region restores the RNG state it started with);
  - runs every token-wise part through `ctx.run(f, *tensors)` in `ctx.chunks` chunks over the token axis (streams
    with separate weights side by side: `stream_slices`), and
    through `ctx.run_output(f, *tensors)` a part whose result goes only into the block's output (nothing the block
    computes after it is saved for backward) and has the shape, dtype and device of its first argument: the last
    pass of a block (output projection, MLP, gates, residual);
  - calls `ctx.plain(*args, **kwargs)` (the block's own forward) for any argument it does not support (masks,
    patches, variants), rather than computing something different;
  - never mutates its inputs.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def recompute_region(f: Callable[..., Any], *args: Any) -> Any:
    """The default `ChunkContext.run`: `f(*args)` as one non-reentrant checkpoint (keeps only its inputs)."""
    if not torch.is_grad_enabled():
        return f(*args)
    return checkpoint(f, *args, use_reentrant=False)


@dataclass(frozen=True)
class ChunkContext:
    chunks: int
    """How many chunks the token axis is cut into (>= 1; a chunk may be shorter when tokens do not divide)."""
    run: Callable[..., Any] = recompute_region
    """run(f, *args) -> f(*args), as one region recomputed in backward."""
    plain: Callable[..., Any] | None = None
    """The block's own forward, for arguments the chunked form does not support."""
    output_region: Callable[..., Any] | None = None
    """How `run_output` runs a region (None: as `run`). The runtime, which checkpoints each block on its own, skips
    such a region's work while the block's checkpoint recomputes the block in backward: that recompute only
    rebuilds what the block saved, and nothing saved comes from the block's output. Each region still saves its
    inputs there, as in forward (the checkpoint matches them one to one), and is recomputed in full for its own
    backward."""

    def run_output(self, f: Callable[..., Any], *args: Any) -> Any:
        """f(*args) as one recomputed region whose result goes only into the block's output."""
        return (self.output_region or self.run)(f, *args)

    def rerun(self) -> "ChunkContext":
        """This context as a block's own checkpoint reruns the block in backward: each output region saves its
        inputs but is not computed (`stand_in`). The probe and the shape profile measure that rerun with it."""
        return dataclasses.replace(self, output_region=lambda f, *args: self.run(stand_in, *args))


def stand_in(first: Any, *rest: Any) -> Any:
    """An output region's result where nothing needs it (its block's checkpoint rerunning the block): its first
    argument, which has the result's shape."""
    return first


ChunkedForward = Callable[..., Any]  # fn(block, ctx, *args, **kwargs)

_CHUNKED: dict[type, ChunkedForward] = {}


def register_chunked_forward(block_type: type, fn: ChunkedForward) -> None:
    """Register `fn` as the token-chunked forward of blocks of exactly `block_type` (idempotent)."""
    _CHUNKED[block_type] = fn


def chunked_forward_for(module: nn.Module) -> ChunkedForward | None:
    """The token-chunked forward registered for `module`'s exact type, or None."""
    return _CHUNKED.get(type(module))


def token_slices(n_tokens: int, chunks: int) -> list[slice]:
    """`chunks` contiguous slices covering range(n_tokens), sizes differing by at most one (fewer when
    n_tokens < chunks; none empty)."""
    chunks = max(1, min(chunks, n_tokens))
    base, extra = divmod(n_tokens, chunks)
    out, start = [], 0
    for i in range(chunks):
        stop = start + base + (1 if i < extra else 0)
        out.append(slice(start, stop))
        start = stop
    return out


def stream_slices(lengths: Sequence[int], chunks: int) -> list[list[slice]]:
    """Token slices for streams chunked side by side (Flux's double block: its text and its image tokens, by separate
    weights): the longest stream in `chunks` chunks, every other in as few chunks as keep each no longer than those.
    A block's working set follows its longest chunk, so cutting a short stream finer saves no memory, only adds
    regions: at 2048 px and 8 chunks the 512 text tokens are 1 chunk beside 8 image chunks of 2048, not 8 of 64 (a
    region per chunk and pass, each a handful of kernels on 64 rows)."""
    longest = max(lengths, default=0)
    size = max(1, -(-longest // max(1, min(chunks, longest))))  # the longest stream's longest chunk
    return [token_slices(n, chunks if n == longest else -(-n // size)) for n in lengths]


def pieces(t: torch.Tensor, slices: list[slice], dim: int) -> tuple[torch.Tensor, ...]:
    """`t` cut along `dim` into consecutive pieces of the sizes of `slices` (which cover it, in order), by one split:
    views, as `t[..., s, ...]` per slice would be, but whose gradients autograd sums at their size and concatenates
    once (each slice's backward zero-fills a gradient of t's whole size and adds it in). Autograd holds the gradients
    of the pieces until the last one arrives, so a piece's gradient must not be a view into a larger buffer: see
    `own_grad`."""
    return t.split([s.stop - s.start for s in slices], dim)


class _OwnGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: torch.Tensor) -> torch.Tensor:
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.clone() if grad.untyped_storage().nbytes() > grad.numel() * grad.element_size() else grad


def own_grad(t: torch.Tensor) -> torch.Tensor:
    """A view of `t` whose gradient goes back to `t` in a buffer of its own: copied (same values) when it arrives as a
    view into a larger one. Flux's single blocks concatenate a chunk of attention's output with the MLP activation, so
    the concatenation's backward hands that chunk a view of the (chunk x 5 hidden) gradient; held by the split of
    attention's output until the last chunk's arrives, those views would keep 5 x tokens x hidden of gradient alive
    over the output regions' backward: the block's peak rose from 12.5 to 15.5 H (fp32, 1024 tokens of width 128,
    8 chunks; H = tokens x hidden x 4 bytes)."""
    return _OwnGrad.apply(t)

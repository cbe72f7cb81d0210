"""Token-chunked forwards of ComfyUI's Flux blocks (comfy.ldm.flux.layers DoubleStreamBlock and SingleStreamBlock),
registered with memory.token_chunks by `register_comfy_flux_chunks()`, which the ComfyUI adapter calls when it wraps a
Flux MODEL. ComfyUI is imported lazily, inside the functions.

The maths is ComfyUI's own: the block's norms, Modulation, Linear layers, QKNorm and MLP modules and ComfyUI's
`apply_mod`, `apply_rope` and `attention`, called in the order of the block's forward; only the token axis is cut, so
the result differs from the block's own forward by at most the rounding of a matmul over fewer rows (or, in the
single block's linear1, fewer columns); with LoRA dropout, by the masks, drawn per chunk and per column group (the same
in distribution: reference_flux_chunks.py). Each forward:

  1. modulation (vec -> shift, scale, gate): one region; not token-wise, but it reads the block's weights, so it is
     recomputed in backward like every other part that does;
  2. per chunk, one region: norm, modulation, qkv projection, QK norm and RoPE -> q, k, v (the single block's fused
     linear1 also gives the MLP input: pass 4 recomputes it on its chunk, as the reference Flux does
     (reference_flux_chunks.py). Kept from pass 2 instead, the MLP activation and its gradient would span the whole
     sequence until the block's backward ends, ~0.78 GiB for Flux-dev at 2048 px in bf16, which alone puts the 4 GB
     headline plan over budget. Each pass computes only its own columns of linear1, from those weight rows
     (training/lora/linear_columns.py, with ComfyUI's Linear handled here: the weight and bias its own forward uses,
     cast by ComfyUI's CastBiasWeightContext when it casts): pass 2 the qkv columns, pass 4 the MLP columns,
     so the single block's forward does the matmul work of the block's own (plus a LoRA's small A factor once
     more); a layer it cannot compute by rows runs whole and is sliced);
  3. ComfyUI's `attention` over the whole sequence, with the caller's transformer_options and pe=None;
  4. per chunk, one output region (ctx.run_output: its result goes only into the block's output, so the memory
     runtime's recompute of a checkpointed block skips it): output projection, gate, residual (the double block: then
     norm, modulation, MLP, gate, residual; fp16 outputs clamped with nan_to_num, as the block does), out of place:
     the inputs are never changed.

Each whole-sequence tensor read in chunks (the block's input, read by passes 2 and 4; pe; attention's output) is cut
into its chunks by one split (memory/token_chunks.py: pieces), not a slice per chunk and pass: autograd sums a chunk's
gradients at its size and concatenates them once, where each slice's backward would zero-fill a whole-sequence
gradient and add it into the tensor's (3 per chunk per block backward, growing with the count).
The double block cuts its text no finer than its image tokens (memory/token_chunks.py: stream_slices): at 2048 px
the 512 text tokens are one chunk, not 8 regions of 64 rows per pass.

RoPE is applied per chunk in pass 2 rather than inside `attention` as the block does: it is elementwise per token
(same values either way), and ComfyUI computes it in fp32, so for a bf16 model its transients (an fp32 copy of q or k
and the fp32 rotated result, 4x q's bytes: ~0.4 GB for Flux-dev at 2048 px) exist a chunk at a time, in forward and
in the recompute, instead of over the whole sequence; nor do unrotated and rotated q, k ever coexist whole.

Anything else goes to the block's own forward (ctx.plain): an attention mask, modulation_dims (per-token
modulation), attn1_patch / attn1_output_patch patches, a yak_mlp single block, a pe that does not cover exactly the
sequence, transformer_options that are not a dict, and any argument ComfyUI's forward takes that this file does not
know (the call is bound against the block class's own forward signature).
"""
from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import nn

from ...memory.token_chunks import (ChunkContext, own_grad, pieces, register_chunked_forward, stream_slices,
                                    token_slices)
from ..lora.linear_columns import linear_columns, plain_columns, plain_tensors, rows_linear, runs_own_forward

_PATCHES = ("attn1_patch", "attn1_output_patch")  # read by the blocks' forwards: a patched call runs plain
_DOUBLE_ARGS = {"img", "txt", "vec", "pe", "attn_mask", "modulation_dims_img", "modulation_dims_txt",
                "transformer_options"}
_SINGLE_ARGS = {"x", "vec", "pe", "attn_mask", "modulation_dims", "transformer_options"}


def register_comfy_flux_chunks() -> None:
    """Register the chunked forwards of ComfyUI's Flux DoubleStreamBlock and SingleStreamBlock (idempotent)."""
    from comfy.ldm.flux.layers import DoubleStreamBlock, SingleStreamBlock
    register_chunked_forward(DoubleStreamBlock, chunked_double_stream)
    register_chunked_forward(SingleStreamBlock, chunked_single_stream)


# ------------------------------------------------------------------------------------------------ the two blocks
def chunked_double_stream(block: nn.Module, ctx: ChunkContext, *args: Any, **kwargs: Any):
    """DoubleStreamBlock.forward(img, txt, vec, pe, attn_mask=None, modulation_dims_img=None,
    modulation_dims_txt=None, transformer_options={}) -> (img, txt), in token chunks."""
    a = _arguments(block, args, kwargs, _DOUBLE_ARGS)
    if a is None or a["modulation_dims_img"] is not None or a["modulation_dims_txt"] is not None or \
            not _supported(a, a["txt"].shape[1] + a["img"].shape[1]):
        return ctx.plain(*args, **kwargs)
    from comfy.ldm.flux.math import attention
    img, txt, pe = a["img"], a["txt"], a["pe"]
    if block.modulation:
        def modulation(vec):
            return tuple(t for mod in (*block.img_mod(vec), *block.txt_mod(vec)) for t in _fields(mod))
        mods = ctx.run(modulation, a["vec"])
    else:  # a block of a globally modulated Flux: vec is ((img_mod1, img_mod2), (txt_mod1, txt_mod2))
        (img_mod1, img_mod2), (txt_mod1, txt_mod2) = a["vec"]
        mods = tuple(t for mod in (img_mod1, img_mod2, txt_mod1, txt_mod2) for t in _fields(mod))
    img_mods, txt_mods = mods[:6], mods[6:]
    txt_slices, img_slices = stream_slices((txt.shape[1], img.shape[1]), ctx.chunks)
    n = len(txt_slices)  # the joint sequence's chunks: the text ones, then the image ones
    txt_xs, img_xs = pieces(txt, txt_slices, 1), pieces(img, img_slices, 1)  # read by passes 2 and 4
    pes = _pe_pieces(pe, txt_slices + img_slices)
    txt_qkv = _qkv_chunks(ctx, txt_xs, pes[:n], txt_mods[:2], block.txt_norm1, block.txt_attn, block.num_heads)
    img_qkv = _qkv_chunks(ctx, img_xs, pes[n:], img_mods[:2], block.img_norm1, block.img_attn, block.num_heads)
    q, k, v = (torch.cat([c[i] for c in txt_qkv + img_qkv], dim=2) for i in range(3))
    del txt_qkv, img_qkv  # the chunks: q, k, v hold the same values
    attn = attention(q, k, v, pe=None, mask=None, transformer_options=a["transformer_options"])
    del q, k, v
    attns = pieces(attn, txt_slices + img_slices, 1)
    img = _output_chunks(ctx, img_xs, attns[n:], img_mods[2:], block.img_attn.proj, block.img_norm2,
                         block.img_mlp, clamp_fp16=False)
    txt = _output_chunks(ctx, txt_xs, attns[:n], txt_mods[2:], block.txt_attn.proj, block.txt_norm2,
                         block.txt_mlp, clamp_fp16=True)
    return img, txt


def chunked_single_stream(block: nn.Module, ctx: ChunkContext, *args: Any, **kwargs: Any):
    """SingleStreamBlock.forward(x, vec, pe, attn_mask=None, modulation_dims=None, transformer_options={}) -> x,
    in token chunks."""
    a = _arguments(block, args, kwargs, _SINGLE_ARGS)
    if a is None or a["modulation_dims"] is not None or block.yak_mlp or not _supported(a, a["x"].shape[1]):
        return ctx.plain(*args, **kwargs)
    from comfy.ldm.flux.layers import apply_mod
    from comfy.ldm.flux.math import attention
    x, pe = a["x"], a["pe"]
    if block.modulation:
        shift, scale, gate = ctx.run(lambda vec: _fields(block.modulation(vec)[0]), a["vec"])
    else:  # a block of a globally modulated Flux: vec is the ModulationOut itself
        shift, scale, gate = _fields(a["vec"])
    hidden, heads = block.hidden_size, block.num_heads

    qkv_cols, mlp_cols = slice(0, 3 * hidden), slice(3 * hidden, 3 * hidden + block.mlp_hidden_dim_first)

    def linear1(xc, shift, scale, cols):  # columns of the fused input projection
        return linear_columns(block.linear1, apply_mod(block.pre_norm(xc), 1 + scale, shift), cols, _comfy_columns)

    def qkv(xc, shift, scale, *pe_chunk):
        return _heads(block.norm, linear1(xc, shift, scale, qkv_cols), heads, pe_chunk)

    slices = token_slices(x.shape[1], ctx.chunks)
    xs = pieces(x, slices, 1)  # read by passes 2 and 4
    parts = [ctx.run(qkv, xc, shift, scale, *pc) for xc, pc in zip(xs, _pe_pieces(pe, slices))]
    q, k, v = (torch.cat([p[i] for p in parts], dim=2) for i in range(3))
    del parts
    attn = attention(q, k, v, pe=None, mask=None, transformer_options=a["transformer_options"])
    del q, k, v

    def out(xc, attn_c, shift, scale, gate):
        mlp = block.mlp_act(linear1(xc, shift, scale, mlp_cols))  # recomputed, not kept: see the module docstring
        # own_grad: attn_c's gradient, a view of the concatenation's, goes back to its split in a buffer of its own
        return _clamp_fp16(_residual(xc, apply_mod(block.linear2(torch.cat((own_grad(attn_c), mlp), 2)), gate)))

    return torch.cat([ctx.run_output(out, xc, ac, shift, scale, gate) for xc, ac in zip(xs, pieces(attn, slices, 1))],
                     dim=1)


# ------------------------------------------------------------------------------------------------ the passes
def _qkv_chunks(ctx: ChunkContext, xs: tuple, pes: list, mod1, norm1, attn_module, heads: int) -> list:
    """Pass 2 over one stream of a double block, its chunks `xs` and their pe pieces `pes`: [(q, k, v) per chunk],
    q/k/v as (B, heads, chunk, head_dim)."""
    from comfy.ldm.flux.layers import apply_mod

    def qkv(xc, shift, scale, *pe_chunk):
        return _heads(attn_module.norm, attn_module.qkv(apply_mod(norm1(xc), 1 + scale, shift)), heads, pe_chunk)

    return [ctx.run(qkv, xc, *mod1, *pc) for xc, pc in zip(xs, pes)]


def _heads(qk_norm: nn.Module, qkv: torch.Tensor, heads: int, pe_chunk: tuple) -> tuple:
    """(B, L, 3*H*D) -> q, k, v as (B, H, L, D): QK norm, then RoPE when the block has a pe (the block's own view)."""
    from comfy.ldm.flux.math import apply_rope
    q, k, v = qkv.view(qkv.shape[0], qkv.shape[1], 3, heads, -1).permute(2, 0, 3, 1, 4)
    q, k = qk_norm(q, k, v)
    if pe_chunk:
        q, k = apply_rope(q, k, pe_chunk[0])
    return q, k, v


def _output_chunks(ctx: ChunkContext, xs: tuple, attns: tuple, mods, proj: nn.Module, norm2: nn.Module,
                   mlp: nn.Module, *, clamp_fp16: bool) -> torch.Tensor:
    """Pass 4 over one stream of a double block, its chunks `xs` and their pieces of attention's output `attns`:
    x + gate1 * proj(attn), then + gate2 * mlp(modulated norm2), concatenated."""
    from comfy.ldm.flux.layers import apply_mod

    def out(xc, attn_c, gate1, shift2, scale2, gate2):
        xc = _residual(xc, apply_mod(proj(attn_c), gate1))
        xc = _residual(xc, apply_mod(mlp(apply_mod(norm2(xc), 1 + scale2, shift2)), gate2))
        return _clamp_fp16(xc) if clamp_fp16 else xc

    return torch.cat([ctx.run_output(out, xc, ac, *mods) for xc, ac in zip(xs, attns)], dim=1)


# ------------------------------------------------------------------------------------------------ helpers
@functools.lru_cache(maxsize=None)
def _signature(block_type: type) -> inspect.Signature:
    return inspect.signature(block_type.forward)


def _arguments(block: nn.Module, args: tuple, kwargs: dict, known: set[str]) -> dict[str, Any] | None:
    """The call's arguments by name, defaults filled in, bound against the block class's own forward; None when they
    do not bind (the plain forward then raises ComfyUI's own error) or name a parameter outside `known`."""
    try:
        bound = _signature(type(block)).bind(block, *args, **kwargs)
    except TypeError:
        return None
    self_name = next(iter(bound.signature.parameters))
    if set(bound.arguments) - known - {self_name}:
        return None
    bound.apply_defaults()
    named = dict(bound.arguments)
    del named[self_name]
    return named if known <= named.keys() else None


def _supported(a: dict[str, Any], n_tokens: int) -> bool:
    """No mask, no attention patch, a pe over exactly the sequence's tokens (or none)."""
    options, pe = a["transformer_options"], a["pe"]
    if a["attn_mask"] is not None or not isinstance(options, dict):
        return False
    if any(p in options.get("patches", {}) for p in _PATCHES):
        return False
    return pe is None or (isinstance(pe, torch.Tensor) and pe.ndim >= 3 and pe.shape[2] == n_tokens)


def _comfy_columns(layer: nn.Module, x: torch.Tensor, cols: slice) -> torch.Tensor | None:
    """linear_columns' `base` for ComfyUI's Linear (comfy.ops, unchanged forward): F.linear on rows `cols` of the
    weight and bias its forward would use, ComfyUI's cast ones when it casts (comfy_cast_weights, weight or bias
    functions); a plain nn.Linear as linear_columns does it; None for any other layer (it then runs whole)."""
    from comfy import ops
    linear = ops.disable_weight_init.Linear
    if not isinstance(layer, linear):
        return plain_columns(layer, x, cols)
    context = getattr(ops, "CastBiasWeightContext", None)  # the cast as the layer's own forward makes it
    if context is None or not runs_own_forward(layer, linear.forward) or \
            type(layer).forward_comfy_cast_weights is not linear.forward_comfy_cast_weights or \
            not plain_tensors(layer.weight, layer.bias):
        return None
    if not (layer.comfy_cast_weights or layer.weight_function or layer.bias_function):
        return rows_linear(x, layer.weight, layer.bias, cols)
    with context(layer, x, offloadable=True) as (weight, bias):
        return rows_linear(x, weight, bias, cols)


def _pe_pieces(pe: torch.Tensor | None, slices: list[slice]) -> list[tuple]:
    """Per slice of the sequence, its RoPE rows ((B, 1, L, D/2, 2, 2) cut along L) as a 0- or 1-tuple of region
    args."""
    return [()] * len(slices) if pe is None else [(p,) for p in pieces(pe, slices, 2)]


def _fields(mod) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A ComfyUI ModulationOut as plain tensors (region outputs): (shift, scale, gate)."""
    return mod.shift, mod.scale, mod.gate


def _residual(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The block's in-place `x += y` out of place: same value, same dtype (x's)."""
    return (x + y).to(x.dtype)


def _clamp_fp16(x: torch.Tensor) -> torch.Tensor:
    """The block's fp16 guard on its output (token-wise)."""
    if x.dtype == torch.float16:
        return torch.nan_to_num(x, nan=0.0, posinf=65504, neginf=-65504)
    return x

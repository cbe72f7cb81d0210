"""Token-chunked forwards of the reference Flux blocks (the contract: memory/token_chunks.py).

Each block runs in two passes over token chunks around one whole-sequence attention:
  pass 1, per chunk: layer norm, modulation, the qkv projection, QK norm and RoPE (the chunk's slice of `pe`, so
    no fp32 copy of the whole q and k is ever made) -> the chunk's q, k, v;
  attention on the concatenated q, k, v (the double block: text tokens first, as `pe` is built);
  pass 2, per chunk: the output projection, the MLP, the gates and the residual -> the chunk's output.
Each pass-1 call is one `ctx.run` region and each pass-2 call one `ctx.run_output` region (its result goes only into
the block's output), each recomputed for its own backward: the whole-sequence tensors a block holds are its input,
q, k, v, attention's output and its own output (and their gradients in backward); everything else lives one chunk at
a time. The double block chunks its text and image tokens separately (separate weights), the text in chunks no
longer than the image's (`stream_slices`).
Each whole-sequence tensor read in chunks (the block's input, by both passes; pe; attention's output) is cut into its
chunks by one split, the pieces shared by both passes (`pieces`), not by a slice per chunk and pass: autograd then
sums a chunk's gradients at its size and concatenates them once, where each slice's backward would zero-fill a
whole-sequence gradient and add it into the tensor's (3 to 4 per chunk per block backward, growing with the count).

The single block's MLP input comes out of the same fused `linear1` as q, k, v. Pass 2 recomputes it on its chunk
instead of keeping it from pass 1: kept, it would be 4 x hidden per token whole-sequence plus as much again of
gradient (the pass-1 regions only run backward after attention's backward), 0.78 GiB at 2048 px, a fifth of a 4 GB
budget. Each pass computes only its own columns of linear1, from those rows of the weight (training/lora/
linear_columns.py: a plain Linear or a plain peft LoRA on one; anything else runs the whole layer and slices): pass 1
the 3 x hidden qkv columns, pass 2 the 4 x hidden MLP columns, so a chunked single block's forward does the
matmul work of the plain one (per token 6h^2 + 8h^2 + 10h^2 = 24h^2 with hidden h), plus one more product with a
LoRA's small A factor (2rh per token at rank r). Checkpointed by the memory runtime, the block's recompute in
backward runs pass 1 and attention again but not pass 2 (nothing the block saved depends on it), so a step does
pass 1 three times and pass 2 twice, against twice everything for a plain checkpointed block.

Values equal the plain forward up to the rounding of matrix products on fewer rows or columns (the same sums,
possibly blocked differently by the BLAS); every op is per token except attention, which is not chunked. With LoRA
dropout, masks are drawn per chunk, and the single block's linear1 draws one for its qkv columns and another for
its MLP columns where the plain forward shares one: each column still sees its input dropped at rate p, so the
training is the same in distribution, not draw for draw.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...memory.token_chunks import (ChunkContext, own_grad, pieces, register_chunked_forward, stream_slices,
                                    token_slices)
from ..lora.linear_columns import linear_columns
from .reference_flux import DoubleStreamBlock, SelfAttention, SingleStreamBlock, apply_rope, split_qkv


def _modulated(norm: nn.Module, x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    return (1 + scale) * norm(x) + shift


def _heads(o: Tensor) -> Tensor:
    """(B, H, L, D) attention output -> (B, L, H*D)."""
    return o.permute(0, 2, 1, 3).reshape(o.shape[0], o.shape[2], -1)


def _attention(qkv: list[tuple[Tensor, Tensor, Tensor]]) -> Tensor:
    q, k, v = (torch.cat([c[j] for c in qkv], dim=2) for j in range(3))
    return F.scaled_dot_product_attention(q, k, v)


# -- the double block ------------------------------------------------------------------------------------------------
def _double_qkv(block: DoubleStreamBlock, norm: nn.Module, attn: SelfAttention):
    def f(x, shift, scale, pe):
        q, k, v = split_qkv(attn.qkv(_modulated(norm, x, shift, scale)), block.num_heads)
        q, k = attn.norm(q, k, v)
        q, k = apply_rope(q, k, pe)
        return q, k, v
    return f


def _double_out(attn: SelfAttention, norm2: nn.Module, mlp: nn.Module):
    def f(x, o, gate1, shift2, scale2, gate2):
        x = x + gate1 * attn.proj(_heads(o))
        return x + gate2 * mlp(_modulated(norm2, x, shift2, scale2))
    return f


def double_block_chunked(block: DoubleStreamBlock, ctx: ChunkContext, img: Tensor, txt: Tensor, vec: Tensor,
                         pe: Tensor) -> tuple[Tensor, Tensor]:
    img_mod1, img_mod2 = block.img_mod(vec)
    txt_mod1, txt_mod2 = block.txt_mod(vec)
    # (norm1, attention, mod1, norm2, mlp, mod2), text first as pe is built
    streams = [(block.txt_norm1, block.txt_attn, txt_mod1, block.txt_norm2, block.txt_mlp, txt_mod2),
               (block.img_norm1, block.img_attn, img_mod1, block.img_norm2, block.img_mlp, img_mod2)]
    txt_slices, img_slices = stream_slices((txt.shape[1], img.shape[1]), ctx.chunks)
    n = len(txt_slices)  # the joint sequence's chunks: the text ones, then the image ones
    xs = (pieces(txt, txt_slices, 1), pieces(img, img_slices, 1))  # read by both passes
    pes = pieces(pe, txt_slices + img_slices, 2)
    qkv = [ctx.run(_double_qkv(block, norm1, attn), xc, mod1.shift, mod1.scale, pc)
           for (norm1, attn, mod1, *_), x_chunks, pe_chunks in zip(streams, xs, (pes[:n], pes[n:]))
           for xc, pc in zip(x_chunks, pe_chunks)]
    o = _attention(qkv)
    del qkv  # the chunks: attention's whole q, k, v hold the same values (else alive through pass 2)
    os_ = pieces(o, txt_slices + img_slices, 2)
    out = []
    for (_, attn, mod1, norm2, mlp, mod2), x_chunks, o_chunks in zip(streams, xs, (os_[:n], os_[n:])):
        f = _double_out(attn, norm2, mlp)
        out.append(torch.cat([ctx.run_output(f, xc, oc, mod1.gate, mod2.shift, mod2.scale, mod2.gate)
                              for xc, oc in zip(x_chunks, o_chunks)], dim=1))
    txt_out, img_out = out
    return img_out, txt_out


# -- the single block ------------------------------------------------------------------------------------------------
def _single_in(block: SingleStreamBlock, x: Tensor, shift: Tensor, scale: Tensor, cols: slice) -> Tensor:
    """Columns `cols` of linear1 on the modulated chunk: the qkv or the MLP input."""
    return linear_columns(block.linear1, _modulated(block.pre_norm, x, shift, scale), cols)


def _single_qkv(block: SingleStreamBlock):
    def f(x, shift, scale, pe):
        q, k, v = split_qkv(_single_in(block, x, shift, scale, slice(0, 3 * block.hidden_size)), block.num_heads)
        q, k = block.norm(q, k, v)
        q, k = apply_rope(q, k, pe)
        return q, k, v
    return f


def _single_out(block: SingleStreamBlock):
    def f(x, o, shift, scale, gate):
        h = block.hidden_size  # the MLP columns, recomputed, not kept: see the module docstring
        mlp = _single_in(block, x, shift, scale, slice(3 * h, 3 * h + block.mlp_hidden_dim))
        return x + gate * block.linear2(torch.cat((own_grad(_heads(o)), block.mlp_act(mlp)), dim=2))
    return f


def single_block_chunked(block: SingleStreamBlock, ctx: ChunkContext, x: Tensor, vec: Tensor, pe: Tensor) -> Tensor:
    mod, _ = block.modulation(vec)
    slices = token_slices(x.shape[1], ctx.chunks)
    xs = pieces(x, slices, 1)  # read by both passes
    f_in = _single_qkv(block)
    o = _attention([ctx.run(f_in, xc, mod.shift, mod.scale, pc) for xc, pc in zip(xs, pieces(pe, slices, 2))])
    f_out = _single_out(block)
    return torch.cat([ctx.run_output(f_out, xc, oc, mod.shift, mod.scale, mod.gate)
                      for xc, oc in zip(xs, pieces(o, slices, 2))], dim=1)


register_chunked_forward(DoubleStreamBlock, double_block_chunked)
register_chunked_forward(SingleStreamBlock, single_block_chunked)

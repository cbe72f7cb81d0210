"""Layer norm without weight/bias that keeps its low-precision input for backward, not the fp32 copy autocast makes.

DiT blocks (Flux, SD3, Wan, Qwen-Image) normalise with a non-affine LayerNorm. Under CUDA autocast `layer_norm` runs
in fp32 (ATen's AT_FORALL_FP32 list): a bf16 activation is cast to fp32 and the native op saves that cast for
backward, twice the activation's bytes, through the checkpointed block's backward (~192 MiB per image-stream norm of
Flux-dev at 2048 px). The gradient needs only x, mean and rstd:
    x_hat = (x - mean) * rstd,   dx = rstd * (dy - mean(dy) - x_hat * mean(dy * x_hat))   (means over the normalised
dims, in fp32), so saving the bf16 x itself halves those bytes. The forward is the native op on the fp32 cast, as
autocast runs it (outputs bitwise the native ones, fp32); the backward recomputes x_hat in fp32 as the native kernel
does. Where layer_norm does not upcast (fp32 training, CPU autocast, which keeps the input's dtype) it is F.layer_norm.
As with the native op, x must not be changed in place before backward (ComfyUI's adapter still hands its norms a
copy of an input its block adds to in place).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_LOW = (torch.float16, torch.bfloat16)


class _LayerNormKeepingInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, normalized_shape, eps):
        y, mean, rstd = torch.ops.aten.native_layer_norm(x.float(), normalized_shape, None, None, eps)
        ctx.save_for_backward(x, mean, rstd)
        ctx.dims = tuple(range(-len(normalized_shape), 0))
        return y

    @staticmethod
    def backward(ctx, dy):
        x, mean, rstd = ctx.saved_tensors
        x_hat = (x.float() - mean).mul_(rstd)
        g = dy.float()
        proj = (g * x_hat).mean(ctx.dims, keepdim=True)
        dx = (g - g.mean(ctx.dims, keepdim=True)).addcmul_(x_hat, proj, value=-1).mul_(rstd)
        return dx.to(x.dtype), None, None


def upcasts(x: torch.Tensor) -> bool:
    """Whether F.layer_norm would compute x in fp32 here: a bf16/fp16 x under an autocast that runs layer_norm in fp32
    (CUDA's; on the CPU, a policy such as memory/shape_profile.py's stand-in for CUDA's: asked of the op itself, on
    an empty tensor)."""
    if x.dtype not in _LOW or not torch.is_autocast_enabled(x.device.type):
        return False
    if x.device.type == "cuda":
        return True
    return F.layer_norm(x.new_empty((0, 1)), (1,)).dtype == torch.float32


def layer_norm(x: torch.Tensor, normalized_shape, eps: float = 1e-5) -> torch.Tensor:
    """F.layer_norm(x, normalized_shape, None, None, eps); where it would save an fp32 copy of a bf16/fp16 x for
    backward, x itself is saved instead (the module docstring)."""
    if torch.is_grad_enabled() and x.requires_grad and upcasts(x):
        return _LayerNormKeepingInput.apply(x, tuple(normalized_shape), eps)
    return F.layer_norm(x, normalized_shape, None, None, eps)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm (same arguments, parameters and state-dict keys); without affine, `layer_norm` above."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None and self.bias is None:
            return layer_norm(x, self.normalized_shape, self.eps)
        return super().forward(x)

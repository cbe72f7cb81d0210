"""The rectified-flow (flow-matching) objective used by Flux, SD3, Lumina 2, Wan and Qwen-Image.

The model predicts the velocity noise - x_0 and is trained on a distance to it: mean squared error (the standard
objective), Huber (quadratic below `huber_delta`, linear above: large errors pull less) or L1. Timestep weighting
such as min-SNR belongs to epsilon/v-prediction diffusion, where the SNR of each timestep sets the weight; flow
matching's velocity target already has a bounded scale at every t and its timestep emphasis comes from the
timestep sampling (logit-normal, shift), so no such weighting is offered.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

LOSSES = ("mse", "huber", "l1")


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """`x` in fp32, or as it is when wider. fp16/bf16 values are exact in fp32: a LATENT held in half precision
    (ComfyUI's VAE Encode under --fp16-intermediates, another node's bf16) trains as its values in fp32 would."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def noised(latents: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """x_t = (1 - t) * x_0 + t * noise, in fp32 (or wider) for the t the model is given. Half-precision latents once
    rounded t and (1 - t) * x_0 to their dtype (bf16: t off by up to 2^-9, x_t by 1e-2 at |x| ~ 3)."""
    latents, noise = at_least_fp32(latents), at_least_fp32(noise)
    t = t.view(-1, *([1] * (latents.ndim - 1))).to(torch.promote_types(latents.dtype, noise.dtype))
    return (1 - t) * latents + t * noise


def flow_matching_loss(prediction: torch.Tensor, latents: torch.Tensor, noise: torch.Tensor, *, kind: str = "mse",
                       huber_delta: float = 1.0, reduction: str = "mean") -> torch.Tensor:
    """The `kind` loss of the predicted velocity against noise - x_0, in fp32. reduction='none' gives one loss per
    sample (the mean over its elements), shape (B,); 'element' the unreduced loss (for masks/data/masks.py)."""
    pred, target = prediction.float(), (noise - latents).float()
    element = reduction == "element"
    reduction = "none" if element else reduction
    if kind == "mse":
        loss = F.mse_loss(pred, target, reduction=reduction)
    elif kind == "huber":
        loss = F.huber_loss(pred, target, reduction=reduction, delta=huber_delta)
    elif kind == "l1":
        loss = F.l1_loss(pred, target, reduction=reduction)
    else:
        raise ValueError(f"loss={kind!r} is not supported: choose one of {', '.join(LOSSES)}")
    if element:
        return loss
    return loss.flatten(1).mean(1) if reduction == "none" else loss


def exact_summable(loss: torch.Tensor) -> torch.Tensor:
    """A loss in float64, so that summing such losses on the device gives what summing them as Python floats did (one
    read for a whole step or validation pass instead of one per batch); on the host where the device has no float64
    (MPS)."""
    return (loss.cpu() if loss.device.type == "mps" else loss).double()

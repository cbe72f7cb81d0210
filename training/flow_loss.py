"""The rectified-flow (flow-matching) objective used by Flux, SD3, Lumina 2, Wan and Qwen-Image."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def noised(latents: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """x_t = (1 - t) * x_0 + t * noise."""
    t = t.view(-1, *([1] * (latents.ndim - 1))).to(latents.dtype)
    return (1 - t) * latents + t * noise


def flow_matching_loss(prediction: torch.Tensor, latents: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The model predicts the velocity noise - x_0; the loss is its mean squared error, in fp32."""
    return F.mse_loss(prediction.float(), (noise - latents).float())

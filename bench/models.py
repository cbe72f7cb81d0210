"""Benchmark models: Flux-shaped transformers with random weights and a rank-16 LoRA, plus their inputs.

- "tiny":     FluxParams.tiny() (hidden 128, 2 double + 2 single blocks), fp32, for CPU runs and tests.
- "flux-2b":  hidden 2048, 16 heads (head dim 128), 8 double + 16 single blocks, bf16: 2.26 B parameters
              (a double block is ~36 h^2, a single block ~15 h^2: 528 h^2 = 2.21 B, plus embedders and final layer;
              count_params("flux-2b") = 2,258,202,688 with 10.5 M LoRA).
- "flux-dev": FluxParams.dev() dimensions, bf16: 11.94 B parameters (37.4 M LoRA) = 23.9 GB of host RAM.
Weights are random (no download). A model is built on the `meta` device and materialised one block at a time into
host memory (pinned on request); the random values are drawn on the init device (the GPU when there is one, which
is far faster than CPU RNG) and copied down block by block, so host RAM never holds the model twice.
LoRA (peft, rank 16, alpha 16) goes on the attention projections: double blocks' img/txt qkv and proj, single
blocks' linear1/linear2 (which fuse attention and MLP). The LoRA weights are fp32 (AdamW state in fp32); under
autocast their matmuls run in the compute dtype, as in training (training/lora/layers.py keep_inputs_in_compute_dtype).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from peft import LoraConfig, inject_adapter_in_model
from torch import nn

from ..training.lora.layers import keep_inputs_in_compute_dtype
from ..training.models.reference_flux import Flux, FluxParams

LORA_TARGETS = r"(double_blocks\.\d+\.(img|txt)_attn\.(qkv|proj)|single_blocks\.\d+\.linear(1|2))"
LATENT_CHANNELS = 16
GUIDANCE = 3.5

MODEL_PARAMS: dict[str, Callable[[], FluxParams]] = {
    "tiny": FluxParams.tiny,
    "flux-2b": lambda: FluxParams(vec_in_dim=768, context_in_dim=4096, hidden_size=2048, num_heads=16, depth=8,
                                  depth_single_blocks=16, axes_dim=(16, 56, 56), guidance_embed=True),
    "flux-dev": FluxParams.dev,
}
TEXT_TOKENS = {"tiny": 64, "flux-2b": 512, "flux-dev": 512}  # T5 context length (tiny: shorter, for CPU)


class LatentFlux(nn.Module):
    """Flux called the way training calls it: latent in, latent out (keyword tensors, so model(**inputs) works)."""

    def __init__(self, flux: Flux):
        super().__init__()
        self.flux = flux

    def forward(self, x, timesteps, context, y, guidance=None):
        return self.flux.forward_latent(x, timesteps, context, y, guidance)


@dataclass
class BenchModel:
    name: str
    model: LatentFlux
    params: FluxParams
    txt_len: int
    total_params: int
    lora_params: int

    def make_inputs(self, batch: int, resolution: int, *, seed: int = 0,
                    device: torch.device | str = "cpu") -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Inputs for (batch, resolution in pixels): latent (B, 16, res/8, res/8), T5-like context
        (B, txt_len, context_dim), pooled vector (B, vec_dim), timesteps, guidance; and a target latent."""
        if resolution % 16:
            raise ValueError(f"resolution={resolution} must be a multiple of 16 (8x VAE, 2x2 patches)")
        g = torch.Generator().manual_seed(seed)
        lat = resolution // 8
        p = self.params
        inputs = {"x": torch.randn(batch, LATENT_CHANNELS, lat, lat, generator=g),
                  "timesteps": torch.rand(batch, generator=g),
                  "context": torch.randn(batch, self.txt_len, p.context_in_dim, generator=g),
                  "y": torch.randn(batch, p.vec_in_dim, generator=g)}
        if p.guidance_embed:
            inputs["guidance"] = torch.full((batch,), GUIDANCE)
        target = torch.randn(batch, LATENT_CHANNELS, lat, lat, generator=g)
        return {k: v.to(device) for k, v in inputs.items()}, target.to(device)

    def inputs_maker(self, batch: int, resolution: int, device: torch.device | str) -> Callable[[], Any]:
        """For memory.probe.probe_model: () -> (inputs, loss_fn)."""
        def make():
            inputs, target = self.make_inputs(batch, resolution, device=device)
            return inputs, lambda out: F.mse_loss(out.float(), target)
        return make

    def tokens(self, resolution: int) -> tuple[int, int]:
        """(image tokens, text tokens) per sample."""
        return (resolution // 16) ** 2, self.txt_len


def count_params(name: str) -> tuple[int, int]:
    """(all parameters, LoRA parameters) of a benchmark model, counted on the meta device (no memory)."""
    model = _meta_model(name, torch.float32)
    total = sum(p.numel() for p in model.parameters())
    return total, sum(p.numel() for p in model.parameters() if p.requires_grad)


def _meta_model(name: str, dtype: torch.dtype, lora_rank: int = 16, params: FluxParams | None = None) -> LatentFlux:
    if params is None and name not in MODEL_PARAMS:
        raise ValueError(f"unknown benchmark model '{name}': choose one of {', '.join(MODEL_PARAMS)}")
    with torch.device("meta"):
        flux = Flux(params or MODEL_PARAMS[name]()).to(dtype)
    flux.requires_grad_(False)
    cfg = LoraConfig(r=lora_rank, lora_alpha=lora_rank, target_modules=LORA_TARGETS)
    model = LatentFlux(inject_adapter_in_model(cfg, flux))
    keep_inputs_in_compute_dtype(model)  # as training does: no fp32 copy of each LoRA input under autocast
    return model


def build_bench_model(name: str, *, dtype: torch.dtype | None = None, init_device: torch.device | str | None = None,
                      pin_memory: bool = False, seed: int = 0, lora_rank: int = 16, params: FluxParams | None = None,
                      txt_len: int | None = None) -> BenchModel:
    """A benchmark model in host memory (the MemoryRuntime then places it). dtype defaults to fp32 for "tiny" (and
    custom `params`) and bf16 otherwise; init_device defaults to CUDA when available."""
    dtype = dtype or (torch.float32 if name == "tiny" or params is not None else torch.bfloat16)
    init_device = torch.device(init_device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = _meta_model(name, dtype, lora_rank, params)
    gen = torch.Generator(device=init_device).manual_seed(seed)
    for mname, module in model.named_modules():  # one module's parameters at a time: host RAM holds the model once
        for pname, p in list(module.named_parameters(recurse=False)):
            trainable = p.requires_grad
            values = _init_values(f"{mname}.{pname}", p, torch.float32 if trainable else p.dtype, init_device, gen)
            host = values.to("cpu")
            if pin_memory and torch.cuda.is_available():
                host = host.pin_memory()
            module._parameters[pname] = nn.Parameter(host, requires_grad=trainable)
        for bname, b in list(module.named_buffers(recurse=False)):
            module._buffers[bname] = torch.zeros(b.shape, dtype=b.dtype)
    total = sum(p.numel() for p in model.parameters())
    lora = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return BenchModel(name, model, params or MODEL_PARAMS[name](), txt_len or TEXT_TOKENS.get(name, 512), total, lora)


def _init_values(name: str, p: torch.Tensor, dtype: torch.dtype, device: torch.device,
                 gen: torch.Generator) -> torch.Tensor:
    """Scaled like a trained network, so activations stay finite through 57 blocks: weights ~ N(0, 1/fan_in),
    biases 0, norm scales 1; LoRA A ~ N(0, 1/fan_in) and B = 0 (peft's default)."""
    if name.endswith(".scale"):
        return torch.ones(p.shape, dtype=dtype, device=device)
    if name.endswith(".bias") or p.ndim < 2 or ".lora_B." in name:
        return torch.zeros(p.shape, dtype=dtype, device=device)
    out = torch.empty(p.shape, dtype=dtype, device=device)
    return out.normal_(0.0, p.shape[1] ** -0.5, generator=gen)

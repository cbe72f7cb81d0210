"""FLOPs of one LoRA training step, and the device peak they are compared with (MFU).

Forward matmul FLOPs are counted exactly by running the model on the `meta` device (shapes only, no compute) with
a hook on every nn.Linear: 2 * in * out per row. They split into F_base (frozen base weights) and F_lora (the
LoRA A/B matmuls). Attention is F_attn = sum over attention layers of 4 * B * heads * N^2 * head_dim (QK^T and
PV, 2 FLOPs per multiply-add), N = image + text tokens.

A training step with a FROZEN base does not compute the base weights' gradients, so it is NOT 6 x params x tokens:
    model FLOPs = 2 * F_base        (forward + input gradients: ~ 4 x matmul params x tokens)
                + 3 * F_lora        (forward + input gradients + LoRA weight gradients)
                + 3 * F_attn        (forward + dQ, dK, dV, dP in backward)
    hardware FLOPs = model FLOPs + r * (F_base_blocks + F_lora + F_attn)   (recompute forward of the fraction r of
                                                                            block FLOPs that is checkpointed)
MFU = model FLOPs / (step time x device peak); HFU uses the hardware FLOPs. Peaks are dense bf16 tensor-core
figures from the vendors' data sheets; on CPU the "peak" is a measured fp32 matmul rate, so CPU MFU only compares
runs on the same machine.
"""
from __future__ import annotations

import time

import torch
from torch import nn

from ..memory.strategy import Keep, Strategy
from .models import BenchModel, _meta_model

# dense bf16 tensor-core TFLOP/s (no sparsity), by substring of torch.cuda.get_device_name()
PEAK_BF16_TFLOPS = (("H200", 989.4), ("H100 PCIe", 756.0), ("H100", 989.4), ("A100", 312.0), ("L40S", 362.0),
                    ("4090", 165.2), ("A6000", 154.8), ("3090", 71.0))


def forward_flops(bench: BenchModel, batch: int, resolution: int) -> dict[str, float]:
    """Exact forward matmul FLOPs (meta-device run) and attention FLOPs, plus per-block matmul FLOPs."""
    model = _meta_model(bench.name, torch.float32, params=bench.params)
    counts = {"base": 0.0, "lora": 0.0}
    per_block: dict[str, float] = {}
    hooks = []
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            block = _block_of(name)

            def hook(mod, args, out, name=name, block=block):
                rows = args[0].numel() // mod.in_features
                f = 2.0 * mod.in_features * mod.out_features * rows
                counts["lora" if ".lora_" in name else "base"] += f
                if block:
                    per_block[block] = per_block.get(block, 0.0) + f
            hooks.append(m.register_forward_hook(hook))
    inputs, _ = bench.make_inputs(batch, resolution, device="meta")
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for h in hooks:
            h.remove()
    p = bench.params
    n_img, n_txt = bench.tokens(resolution)
    attn = 4.0 * batch * p.num_heads * (n_img + n_txt) ** 2 * p.head_dim * (p.depth + p.depth_single_blocks)
    return {"base": counts["base"], "lora": counts["lora"], "attention": attn,
            "block_matmul": per_block, "attention_per_block": attn / (p.depth + p.depth_single_blocks)}


def _block_of(name: str) -> str | None:
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part in ("double_blocks", "single_blocks") and parts[i + 1].isdigit():
            return f"{part}.{parts[i + 1]}"
    return None


def step_flops(fwd: dict, strategy: Strategy, block_names: list[str]) -> dict[str, float]:
    """Model and hardware FLOPs of one training step (see the module docstring)."""
    model = 2 * fwd["base"] + 3 * fwd["lora"] + 3 * fwd["attention"]
    per_block = [fwd["block_matmul"].get(_block_of(b + ".w"), 0.0) + fwd["attention_per_block"] for b in block_names]
    block_total = sum(per_block)
    # only eager checkpointing recomputes a block's matmuls; under a compile budget (Keep.BUDGET) the partitioner
    # recomputes cheap pointwise ops, which are not counted here
    recomputed = sum(f for i, f in enumerate(per_block) if strategy.keeps(i) is Keep.INPUTS)
    return {"model": model, "hardware": model + recomputed, "recompute_fraction": recomputed / max(block_total, 1.0)}


def device_peak_flops(device: torch.device | str) -> tuple[float | None, str]:
    """(peak FLOP/s, where the figure comes from)."""
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in PEAK_BF16_TFLOPS:
            if key in name:
                return tflops * 1e12, f"{name}: {tflops} TFLOP/s dense bf16 (data sheet)"
        return None, f"{name}: peak unknown, MFU not computed"
    return _measured_matmul_rate(), "measured fp32 matmul rate on this CPU (not a data-sheet peak)"


def _measured_matmul_rate(n: int = 1024, repeats: int = 5) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n ** 3 / best

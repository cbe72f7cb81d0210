"""Tiny random-weight checkpoints in each family's original key layout (the layout of the released diffusion-model
files, which ComfyUI's UNETLoader reads as they are), plus a tiny TAEF1 VAE for VAELoader ("taef1").

Flux comes from demo/tiny_checkpoint.py. SD3.5 (MMDiT with qk RMS norm and an attn2 block, like 3.5 medium) and
Wan (2.1; 2.2 A14B's experts, which have 2.1 14B's keys; 2.2 TI2V 5B, 48 latent channels) are ~1M parameters.
Lumina 2 and Qwen-Image cannot be made small: ComfyUI reads only their layer count and input widths from the file
and fixes heads and widths, so these are one block of the real width (~400M parameters), written as bf16 (~0.8 GB)
and meant to be loaded as fp8 (weight_dtype fp8_e4m3fn). write_scaled_fp8 makes any of them a "scaled fp8" file
(Comfy-Org's *_fp8_scaled layout), which ComfyUI loads into its quantized layers.
"""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

from tightrope.demo.tiny_checkpoint import make_tiny_checkpoint

Shapes = dict[str, tuple[int, ...]]


def _linear(name: str, n_in: int, n_out: int, bias: bool = True) -> Shapes:
    return {f"{name}.weight": (n_out, n_in), **({f"{name}.bias": (n_out,)} if bias else {})}


def _mlp(name: str, n_in: int, n_out: int, hidden_index: int = 2) -> Shapes:
    return {**_linear(f"{name}.0", n_in, n_out), **_linear(f"{name}.{hidden_index}", n_out, n_out)}


def sd3_shapes(depth: int = 2, context_dim: int = 64, pooled_dim: int = 32, pos: int = 16,
               attn2_blocks: tuple[int, ...] = (0,)) -> Shapes:
    """MMDiT (SD3.5): width 64 * depth, `depth` joint blocks; the last context block is pre-only."""
    h = 64 * depth
    s = {"pos_embed": (1, pos * pos, h), "x_embedder.proj.weight": (h, 16, 2, 2), "x_embedder.proj.bias": (h,),
         **_mlp("t_embedder.mlp", 256, h), **_mlp("y_embedder.mlp", pooled_dim, h),
         **_linear("context_embedder", context_dim, h), **_linear("final_layer.linear", h, 2 * 2 * 16),
         **_linear("final_layer.adaLN_modulation.1", h, 2 * h)}
    for i in range(depth):
        for part in ("context_block", "x_block"):
            pre, pre_only = f"joint_blocks.{i}.{part}", part == "context_block" and i == depth - 1
            attns = ("attn", "attn2") if part == "x_block" and i in attn2_blocks else ("attn",)
            for attn in attns:
                s |= _linear(f"{pre}.{attn}.qkv", h, 3 * h) | {f"{pre}.{attn}.ln_q.weight": (64,),
                                                               f"{pre}.{attn}.ln_k.weight": (64,)}
                if not pre_only:
                    s |= _linear(f"{pre}.{attn}.proj", h, h)
            if not pre_only:
                s |= _linear(f"{pre}.mlp.fc1", h, 4 * h) | _linear(f"{pre}.mlp.fc2", 4 * h, h)
            s |= _linear(f"{pre}.adaLN_modulation.1", h, (2 if pre_only else 3 * len(attns) + 3) * h)
    return s


def wan_shapes(dim: int = 128, ffn: int = 256, layers: int = 2, text_dim: int = 4096, channels: int = 16) -> Shapes:
    """Wan text-to-video (dim 128 = one attention head): 2.1 and 2.2 A14B (each expert) with 16 latent channels, 2.2
    TI2V 5B with 48 (its own VAE's latents: ComfyUI reads the 48 from head.head's rows, out_dim = rows / 4)."""
    s = {"patch_embedding.weight": (dim, channels, 1, 2, 2), "patch_embedding.bias": (dim,),
         **_mlp("text_embedding", text_dim, dim), **_mlp("time_embedding", 256, dim),
         **_linear("time_projection.1", dim, 6 * dim), "head.modulation": (1, 2, dim),
         **_linear("head.head", dim, channels * 2 * 2)}
    for i in range(layers):
        pre = f"blocks.{i}"
        s[f"{pre}.modulation"] = (1, 6, dim)
        for attn in ("self_attn", "cross_attn"):
            for p in "qkvo":
                s |= _linear(f"{pre}.{attn}.{p}", dim, dim)
            s |= {f"{pre}.{attn}.norm_q.weight": (dim,), f"{pre}.{attn}.norm_k.weight": (dim,)}
        s |= {f"{pre}.norm3.weight": (dim,), f"{pre}.norm3.bias": (dim,)}
        s |= _linear(f"{pre}.ffn.0", dim, ffn) | _linear(f"{pre}.ffn.2", ffn, dim)
    return s


def lumina2_shapes(layers: int = 1) -> Shapes:
    """Lumina 2 (NextDiT, width 2304, 24 query / 8 key-value heads of 96) with `layers` main layers plus its two
    noise- and two context-refiner layers."""
    d, qkv, ffn, t = 2304, (24 + 8 + 8) * 96, 9216, 1024

    def layer(pre: str, modulated: bool) -> Shapes:
        out = _linear(f"{pre}.attention.qkv", d, qkv, False) | _linear(f"{pre}.attention.out", d, d, False)
        out |= {f"{pre}.attention.q_norm.weight": (96,), f"{pre}.attention.k_norm.weight": (96,)}
        out |= _linear(f"{pre}.feed_forward.w1", d, ffn, False) | _linear(f"{pre}.feed_forward.w2", ffn, d, False)
        out |= _linear(f"{pre}.feed_forward.w3", d, ffn, False)
        out |= {f"{pre}.{n}.weight": (d,) for n in ("attention_norm1", "ffn_norm1", "attention_norm2", "ffn_norm2")}
        return out | (_linear(f"{pre}.adaLN_modulation.1", t, 4 * d) if modulated else {})

    s = {**_linear("x_embedder", 2 * 2 * 16, d), **_mlp("t_embedder.mlp", 256, t), "cap_embedder.0.weight": (d,),
         **_linear("cap_embedder.1", d, d), **_linear("final_layer.linear", d, 2 * 2 * 16),
         **_linear("final_layer.adaLN_modulation.1", t, d)}
    for i in range(2):
        s |= layer(f"noise_refiner.{i}", True) | layer(f"context_refiner.{i}", False)
    for i in range(layers):
        s |= layer(f"layers.{i}", True)
    return s


def qwen_image_shapes(layers: int = 1) -> Shapes:
    """Qwen-Image (width 3072 = 24 heads of 128, text width 3584) with `layers` blocks."""
    d, txt = 3072, 3584
    s = {**_linear("time_text_embed.timestep_embedder.linear_1", 256, d),
         **_linear("time_text_embed.timestep_embedder.linear_2", d, d), "txt_norm.weight": (txt,),
         **_linear("img_in", 64, d), **_linear("txt_in", txt, d), **_linear("norm_out.linear", d, 2 * d),
         **_linear("proj_out", d, 2 * 2 * 16)}
    for i in range(layers):
        pre = f"transformer_blocks.{i}"
        for stream in ("img", "txt"):
            s |= _linear(f"{pre}.{stream}_mod.1", d, 6 * d) | _linear(f"{pre}.{stream}_mlp.net.0.proj", d, 4 * d)
            s |= _linear(f"{pre}.{stream}_mlp.net.2", 4 * d, d)
        s |= {f"{pre}.attn.{n}.weight": (128,) for n in ("norm_q", "norm_k", "norm_added_q", "norm_added_k")}
        for p in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0", "to_add_out"):
            s |= _linear(f"{pre}.attn.{p}", d, d)
    return s


def taesd_shapes(latent_channels: int = 16) -> tuple[Shapes, Shapes]:
    """(encoder, decoder) of a Tiny AutoEncoder (TAESD layout; 16 latent channels = TAEF1)."""
    def conv(i, n_in, n_out, bias=True):
        return {f"{i}.weight": (n_out, n_in, 3, 3), **({f"{i}.bias": (n_out,)} if bias else {})}

    def block(i):
        return {k: v for j in (0, 2, 4) for k, v in conv(f"{i}.conv.{j}", 64, 64).items()}

    enc = conv(0, 3, 64) | conv(14, 64, latent_channels)
    for i in (1, 3, 4, 5, 7, 8, 9, 11, 12, 13):
        enc |= block(i)
    for i in (2, 6, 10):
        enc |= conv(i, 64, 64, bias=False)
    dec = conv(1, latent_channels, 64) | conv(19, 64, 3)
    for i in (3, 4, 5, 8, 9, 10, 13, 14, 15, 18):
        dec |= block(i)
    for i in (7, 12, 17):
        dec |= conv(i, 64, 64, bias=False)
    return enc, dec


def write_checkpoint(path: str | os.PathLike, shapes: Shapes, seed: int = 0, dtype=torch.float32) -> str:
    """Random weights, deterministic in `seed`: weights ~ N(0, 1/fan_in), biases and other vectors ~ N(0, 0.02^2),
    norm scales ~ 1 + N(0, 0.1^2)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name in sorted(shapes):
        shape = shapes[name]
        t = torch.randn(shape, generator=gen)
        leaf = name.rsplit(".", 2)[-2] if name.count(".") else name
        if len(shape) >= 2 and name.endswith("weight"):
            t /= (torch.tensor(shape[1:]).prod().item()) ** 0.5
        elif name.endswith("weight") and ("norm" in leaf or leaf.startswith("ln_") or name == "cap_embedder.0.weight"):
            t = 1 + 0.1 * t
        else:
            t *= 0.02
        tensors[name] = t.to(dtype).contiguous()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    save_file(tensors, str(path))
    return str(path)


def write_scaled_fp8(path: str | os.PathLike, source: str | os.PathLike, form: str = "scaled_fp8",
                     layers: str = "blocks.") -> str:
    """`source`'s 2-D weights whose names contain `layers` quantized as Comfy-Org's fp8 files store them: fp8 e4m3fn
    values with one fp32 scale per tensor (amax / 448), the rest as it was. `form` 'scaled_fp8': the older layout (a
    `scaled_fp8` marker key, `<layer>.scale_weight`), which ComfyUI converts on load (comfy/utils.convert_old_quants)
    into 'comfy_quant': per layer `<layer>.weight_scale` and a `<layer>.comfy_quant` JSON tensor {"format":
    "float8_e4m3fn"}, what ComfyUI 0.33 detects as quantization metadata (comfy/utils.detect_layer_quantization).
    'nvfp4': the same metadata naming NVFP4 (4-bit, block scales), which Tightrope refuses."""
    out = {"scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn)} if form == "scaled_fp8" else {}
    for k, v in load_file(str(source)).items():
        if v.ndim != 2 or not k.endswith(".weight") or layers not in k:
            out[k] = v
            continue
        layer = k[:-len(".weight")]
        if form == "nvfp4":
            rows, cols = v.shape
            out[k] = torch.zeros(rows, cols // 2, dtype=torch.uint8)  # two 4-bit values a byte
            out[f"{layer}.weight_scale"] = torch.ones(rows, cols // 16).to(torch.float8_e4m3fn)
            out[f"{layer}.weight_scale_2"] = torch.ones(())
        else:
            scale = (v.abs().max().float() / 448.0).reshape(())
            out[k] = (v.float() / scale).to(torch.float8_e4m3fn)
            out[f"{layer}.{'scale_weight' if form == 'scaled_fp8' else 'weight_scale'}"] = scale
        if form != "scaled_fp8":
            conf = json.dumps({"format": "nvfp4" if form == "nvfp4" else "float8_e4m3fn"}).encode()
            out[f"{layer}.comfy_quant"] = torch.tensor(list(conf), dtype=torch.uint8)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    save_file(out, str(path))
    return str(path)


CHECKPOINTS = {  # family -> (file name, writer(path)), the UNETLoader weight_dtype to load it with
    "flux": ("tiny_flux.safetensors", lambda p: make_tiny_checkpoint(p, seed=3), "default"),
    "sd3": ("tiny_sd35.safetensors", lambda p: write_checkpoint(p, sd3_shapes(), seed=1), "default"),
    "wan": ("tiny_wan21.safetensors", lambda p: write_checkpoint(p, wan_shapes(), seed=2), "default"),
    "wan22_high": ("wan2.2_t2v_high_noise_tiny.safetensors", lambda p: write_checkpoint(p, wan_shapes(), seed=21),
                   "default"),  # Wan 2.2 A14B's experts: Wan 2.1 14B's keys (ComfyUI: WAN21_T2V)
    "wan22_low": ("wan2.2_t2v_low_noise_tiny.safetensors", lambda p: write_checkpoint(p, wan_shapes(), seed=22),
                  "default"),
    "wan22_5b": ("wan2.2_ti2v_5B_tiny.safetensors",  # 48 latent channels (ComfyUI: WAN22_T2V)
                 lambda p: write_checkpoint(p, wan_shapes(channels=48), seed=23), "default"),
    "lumina2": ("tiny_lumina2.safetensors",
                lambda p: write_checkpoint(p, lumina2_shapes(), seed=4, dtype=torch.bfloat16), "fp8_e4m3fn"),
    "qwen_image": ("tiny_qwen_image.safetensors",
                   lambda p: write_checkpoint(p, qwen_image_shapes(), seed=5, dtype=torch.bfloat16), "fp8_e4m3fn"),
}


def write_taef1(folder: str | os.PathLike, seed: int = 7) -> None:
    enc, dec = taesd_shapes(16)
    write_checkpoint(os.path.join(folder, "taef1_encoder.safetensors"), enc, seed)
    write_checkpoint(os.path.join(folder, "taef1_decoder.safetensors"), dec, seed + 1)

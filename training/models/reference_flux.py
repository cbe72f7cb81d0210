"""Reference Flux transformer (Black Forest Labs flux-dev / flux-schnell) in plain PyTorch.

Written from the published architecture so that:
  * parameter names are exactly the original BFL checkpoint layout (``double_blocks.0.img_attn.qkv.weight``,
    ``...norm.query_norm.scale``, ``final_layer.adaLN_modulation.1.weight`` ...), so real weights load with
    ``load_state_dict(strict=True)``;
  * ``forward_latent`` follows ComfyUI's latent conventions (patch 2, circular pad, row/column image ids, zero text
    ids, timesteps scaled by 1000, cos before sin), so outputs agree with ComfyUI's Flux in fp32.

Blocks live in ``double_blocks`` / ``single_blocks`` and are always called with keyword tensors; the memory runtime
finds them by those names and wraps each block's ``forward``. Residuals are out of place (``x = x + gate * y``) so a
wrapped/checkpointed block never mutates its input.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...memory.norms import LayerNorm

PATCH = 2  # Flux packs 2x2 latent patches into one token


@dataclass(frozen=True, kw_only=True)
class FluxParams:
    """Hyper-parameters in BFL's convention: in/out_channels count *patchified* channels (16 latent ch * 2 * 2)."""

    in_channels: int = 64
    out_channels: int | None = 64  # None: same as in_channels
    vec_in_dim: int
    context_in_dim: int
    hidden_size: int
    mlp_ratio: float = 4.0
    num_heads: int
    depth: int
    depth_single_blocks: int
    axes_dim: tuple[int, ...]
    theta: int = 10000
    qkv_bias: bool = True
    guidance_embed: bool

    def __post_init__(self):
        object.__setattr__(self, "axes_dim", tuple(int(a) for a in self.axes_dim))  # hashable, list-proof
        if self.out_channels is None:
            object.__setattr__(self, "out_channels", self.in_channels)
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} not divisible by num_heads {self.num_heads}")
        if sum(self.axes_dim) != self.head_dim:
            raise ValueError(f"sum(axes_dim)={sum(self.axes_dim)} must equal head dim {self.head_dim}")
        if self.in_channels % (PATCH * PATCH) or self.out_channels % (PATCH * PATCH):
            raise ValueError("in/out_channels must be multiples of 4 (2x2 patches)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def dev(cls) -> "FluxParams":
        return cls(vec_in_dim=768, context_in_dim=4096, hidden_size=3072, num_heads=24, depth=19,
                   depth_single_blocks=38, axes_dim=(16, 56, 56), guidance_embed=True)

    @classmethod
    def schnell(cls) -> "FluxParams":
        return dataclasses.replace(cls.dev(), guidance_embed=False)

    @classmethod
    def tiny(cls) -> "FluxParams":
        # ComfyUI's detector derives num_heads = hidden / sum(axes_dim) = hidden / 128, so a ComfyUI-loadable tiny
        # model keeps head dim 128 and the real axes split; everything else is shrunk.
        return cls(vec_in_dim=32, context_in_dim=64, hidden_size=128, num_heads=1, depth=2,
                   depth_single_blocks=2, axes_dim=(16, 56, 56), guidance_embed=True)


# ----------------------------------------------------------------------------------------------------- functions
def timestep_embedding(t: Tensor, dim: int, max_period: float = 10000.0, time_factor: float = 1000.0) -> Tensor:
    """Sinusoidal embedding of t in [0, 1] (scaled by 1000, like BFL/ComfyUI); cos half first, then sin."""
    t = time_factor * t
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
    return emb


def rope(pos: Tensor, dim: int, theta: int) -> Tensor:
    """(B, N) positions -> (B, N, dim/2, 2, 2) rotation matrices. Frequencies in float64 for accuracy at large pos
    (MPS has no float64, so that case is computed on the CPU)."""
    device = torch.device("cpu") if pos.device.type == "mps" else pos.device
    omega = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim)
    ang = pos.to(device=device, dtype=torch.float64)[..., None] * omega
    cos, sin = torch.cos(ang), torch.sin(ang)
    out = torch.stack([cos, -sin, sin, cos], dim=-1).reshape(*ang.shape, 2, 2)
    return out.to(device=pos.device, dtype=torch.float32)


def apply_rope(xq: Tensor, xk: Tensor, freqs_cis: Tensor) -> tuple[Tensor, Tensor]:
    """Rotate consecutive (even, odd) channel pairs of q and k; math in fp32 whatever the model dtype."""
    def rot(x: Tensor) -> Tensor:
        x_ = x.float().reshape(*x.shape[:-1], -1, 1, 2)
        out = freqs_cis[..., 0] * x_[..., 0] + freqs_cis[..., 1] * x_[..., 1]
        return out.reshape(*x.shape).type_as(x)
    return rot(xq), rot(xk)


def attention(q: Tensor, k: Tensor, v: Tensor, pe: Tensor) -> Tensor:
    """q, k, v: (B, H, L, D) -> (B, L, H*D)."""
    q, k = apply_rope(q, k, pe)
    x = F.scaled_dot_product_attention(q, k, v)
    return x.permute(0, 2, 1, 3).reshape(x.shape[0], x.shape[2], -1)


def split_qkv(qkv: Tensor, num_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """(B, L, 3*H*D) -> three (B, H, L, D); the packed order is (K=3, H, D) as in BFL's rearrange."""
    B, L, _ = qkv.shape
    q, k, v = qkv.reshape(B, L, 3, num_heads, -1).permute(2, 0, 3, 1, 4)
    return q, k, v


# ------------------------------------------------------------------------------------------------------- modules
class EmbedND(nn.Module):
    """RoPE over several id axes (Flux: [unused/index, row, column]); each axis gets its slice of the head dim."""

    def __init__(self, dim: int, theta: int, axes_dim: tuple[int, ...]):
        super().__init__()
        self.dim, self.theta, self.axes_dim = dim, theta, tuple(axes_dim)

    def forward(self, ids: Tensor) -> Tensor:  # ids: (B, N, n_axes)
        emb = torch.cat([rope(ids[..., i], self.axes_dim[i], self.theta) for i in range(ids.shape[-1])], dim=-3)
        return emb.unsqueeze(1)  # (B, 1, N, head_dim/2, 2, 2): broadcasts over heads


class MLPEmbedder(nn.Module):
    def __init__(self, in_dim: int, hidden_dim: int):
        super().__init__()
        self.in_layer = nn.Linear(in_dim, hidden_dim, bias=True)
        self.silu = nn.SiLU()
        self.out_layer = nn.Linear(hidden_dim, hidden_dim, bias=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.out_layer(self.silu(self.in_layer(x)))


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))  # named `scale` in BFL checkpoints (not `weight`)

    def forward(self, x: Tensor) -> Tensor:
        x_dtype = x.dtype
        x = x.float()  # normalise in fp32 even for bf16 models
        rrms = torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + 1e-6)
        return (x * rrms).to(dtype=x_dtype) * self.scale


class QKNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.query_norm = RMSNorm(dim)
        self.key_norm = RMSNorm(dim)

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return self.query_norm(q).to(v), self.key_norm(k).to(v)


class SelfAttention(nn.Module):
    """Parameter container only: double blocks run qkv / norm / proj themselves (joint txt+img attention)."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = False):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.norm = QKNorm(dim // num_heads)
        self.proj = nn.Linear(dim, dim)


@dataclass
class ModulationOut:
    shift: Tensor
    scale: Tensor
    gate: Tensor


class Modulation(nn.Module):
    """adaLN: vec -> (shift, scale, gate) x 1 or 2, each (B, 1, hidden) to broadcast over tokens."""

    def __init__(self, dim: int, double: bool):
        super().__init__()
        self.is_double = double
        self.multiplier = 6 if double else 3
        self.lin = nn.Linear(dim, self.multiplier * dim, bias=True)

    def forward(self, vec: Tensor) -> tuple[ModulationOut, ModulationOut | None]:
        out = self.lin(F.silu(vec))[:, None, :].chunk(self.multiplier, dim=-1)
        return ModulationOut(*out[:3]), (ModulationOut(*out[3:]) if self.is_double else None)


def _mlp(hidden: int, mlp_hidden: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(hidden, mlp_hidden), nn.GELU(approximate="tanh"), nn.Linear(mlp_hidden, hidden))


def _ln(hidden: int) -> nn.LayerNorm:
    # affine comes from modulation instead; under CUDA autocast it keeps its bf16 input for backward, not the fp32
    # copy autocast makes (memory/norms.py)
    return LayerNorm(hidden, elementwise_affine=False, eps=1e-6)


class DoubleStreamBlock(nn.Module):
    """MMDiT block: separate weights for image and text tokens, one joint attention over [txt, img]."""

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float, qkv_bias: bool = False):
        super().__init__()
        mlp_hidden = int(hidden_size * mlp_ratio)
        self.num_heads = num_heads
        self.hidden_size = hidden_size
        self.img_mod = Modulation(hidden_size, double=True)
        self.img_norm1 = _ln(hidden_size)
        self.img_attn = SelfAttention(hidden_size, num_heads, qkv_bias=qkv_bias)
        self.img_norm2 = _ln(hidden_size)
        self.img_mlp = _mlp(hidden_size, mlp_hidden)
        self.txt_mod = Modulation(hidden_size, double=True)
        self.txt_norm1 = _ln(hidden_size)
        self.txt_attn = SelfAttention(hidden_size, num_heads, qkv_bias=qkv_bias)
        self.txt_norm2 = _ln(hidden_size)
        self.txt_mlp = _mlp(hidden_size, mlp_hidden)

    def _qkv(self, x: Tensor, norm: nn.Module, mod: ModulationOut, attn: SelfAttention):
        q, k, v = split_qkv(attn.qkv((1 + mod.scale) * norm(x) + mod.shift), self.num_heads)
        q, k = attn.norm(q, k, v)
        return q, k, v

    def forward(self, img: Tensor, txt: Tensor, vec: Tensor, pe: Tensor) -> tuple[Tensor, Tensor]:
        img_mod1, img_mod2 = self.img_mod(vec)
        txt_mod1, txt_mod2 = self.txt_mod(vec)
        img_q, img_k, img_v = self._qkv(img, self.img_norm1, img_mod1, self.img_attn)
        txt_q, txt_k, txt_v = self._qkv(txt, self.txt_norm1, txt_mod1, self.txt_attn)

        # text tokens first: pe was built from cat(txt_ids, img_ids) in the same order
        attn = attention(torch.cat((txt_q, img_q), dim=2), torch.cat((txt_k, img_k), dim=2),
                         torch.cat((txt_v, img_v), dim=2), pe=pe)
        txt_attn, img_attn = attn[:, : txt.shape[1]], attn[:, txt.shape[1]:]

        img = img + img_mod1.gate * self.img_attn.proj(img_attn)
        img = img + img_mod2.gate * self.img_mlp((1 + img_mod2.scale) * self.img_norm2(img) + img_mod2.shift)
        txt = txt + txt_mod1.gate * self.txt_attn.proj(txt_attn)
        txt = txt + txt_mod2.gate * self.txt_mlp((1 + txt_mod2.scale) * self.txt_norm2(txt) + txt_mod2.shift)
        return img, txt


class SingleStreamBlock(nn.Module):
    """Parallel attention + MLP on the concatenated [txt, img] sequence (fused in/out projections)."""

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float = 4.0):
        super().__init__()
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.mlp_hidden_dim = int(hidden_size * mlp_ratio)
        self.linear1 = nn.Linear(hidden_size, hidden_size * 3 + self.mlp_hidden_dim)  # qkv and mlp_in
        self.linear2 = nn.Linear(hidden_size + self.mlp_hidden_dim, hidden_size)  # proj and mlp_out
        self.norm = QKNorm(hidden_size // num_heads)
        self.pre_norm = _ln(hidden_size)
        self.mlp_act = nn.GELU(approximate="tanh")
        self.modulation = Modulation(hidden_size, double=False)

    def forward(self, x: Tensor, vec: Tensor, pe: Tensor) -> Tensor:
        mod, _ = self.modulation(vec)
        x_mod = (1 + mod.scale) * self.pre_norm(x) + mod.shift
        qkv, mlp = torch.split(self.linear1(x_mod), [3 * self.hidden_size, self.mlp_hidden_dim], dim=-1)
        q, k, v = split_qkv(qkv, self.num_heads)
        q, k = self.norm(q, k, v)
        out = self.linear2(torch.cat((attention(q, k, v, pe=pe), self.mlp_act(mlp)), dim=2))
        return x + mod.gate * out


class LastLayer(nn.Module):
    def __init__(self, hidden_size: int, patch_size: int, out_channels: int):
        super().__init__()
        self.norm_final = _ln(hidden_size)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels, bias=True)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size, bias=True))

    def forward(self, x: Tensor, vec: Tensor) -> Tensor:
        shift, scale = self.adaLN_modulation(vec).chunk(2, dim=1)
        x = (1 + scale[:, None, :]) * self.norm_final(x) + shift[:, None, :]
        return self.linear(x)


class Flux(nn.Module):
    """Flow-matching transformer on 2x2-patchified latent tokens."""

    def __init__(self, params: FluxParams):
        super().__init__()
        self.params = params
        self.in_channels = params.in_channels
        self.out_channels = params.out_channels
        self.hidden_size = params.hidden_size
        self.num_heads = params.num_heads
        self.pe_embedder = EmbedND(dim=params.head_dim, theta=params.theta, axes_dim=params.axes_dim)
        self.img_in = nn.Linear(self.in_channels, self.hidden_size, bias=True)
        self.time_in = MLPEmbedder(in_dim=256, hidden_dim=self.hidden_size)
        self.vector_in = MLPEmbedder(params.vec_in_dim, self.hidden_size)
        self.guidance_in = MLPEmbedder(256, self.hidden_size) if params.guidance_embed else nn.Identity()
        self.txt_in = nn.Linear(params.context_in_dim, self.hidden_size)
        self.double_blocks = nn.ModuleList(
            DoubleStreamBlock(self.hidden_size, self.num_heads, params.mlp_ratio, qkv_bias=params.qkv_bias)
            for _ in range(params.depth))
        self.single_blocks = nn.ModuleList(
            SingleStreamBlock(self.hidden_size, self.num_heads, mlp_ratio=params.mlp_ratio)
            for _ in range(params.depth_single_blocks))
        # final_layer's patch_size is 1 because out_channels already counts the 2x2 patch (BFL does the same)
        self.final_layer = LastLayer(self.hidden_size, 1, self.out_channels)

    def forward(self, img: Tensor, img_ids: Tensor, txt: Tensor, txt_ids: Tensor, timesteps: Tensor, y: Tensor,
                guidance: Tensor | None = None) -> Tensor:
        """img (B, N, in_ch), img_ids (B, N, 3), txt (B, L, ctx), txt_ids (B, L, 3), timesteps (B,) in [0, 1],
        y (B, vec_in_dim) pooled text vector, guidance (B,) -> (B, N, out_ch)."""
        if img.ndim != 3 or txt.ndim != 3:
            raise ValueError("img and txt must be (batch, tokens, channels)")
        img = self.img_in(img)
        vec = self.time_in(timestep_embedding(timesteps, 256).to(img.dtype))
        if self.params.guidance_embed:
            if guidance is None:
                raise ValueError("this Flux variant is guidance-distilled (flux-dev): pass a guidance strength")
            vec = vec + self.guidance_in(timestep_embedding(guidance, 256).to(img.dtype))
        vec = vec + self.vector_in(y.to(img.dtype))
        txt = self.txt_in(txt)
        pe = self.pe_embedder(torch.cat((txt_ids, img_ids), dim=1))

        for block in self.double_blocks:
            img, txt = block(img=img, txt=txt, vec=vec, pe=pe)
        x = torch.cat((txt, img), dim=1)
        for block in self.single_blocks:
            x = block(x, vec=vec, pe=pe)
        return self.final_layer(x[:, txt.shape[1]:, ...], vec)

    def forward_latent(self, x: Tensor, timesteps: Tensor, context: Tensor, y: Tensor,
                       guidance: Tensor | None = None) -> Tensor:
        """Latent in, latent out: x (B, C, H, W) with C = in_channels/4 (16 for Flux) -> (B, out_channels/4, H, W).
        Odd H/W are padded circularly to the patch (as ComfyUI does) and cropped back afterwards."""
        B, C, H, W = x.shape
        if C * PATCH * PATCH != self.in_channels:
            raise ValueError(f"latent has {C} channels, model expects {self.in_channels // (PATCH * PATCH)}")
        pad_h, pad_w = (-H) % PATCH, (-W) % PATCH
        if pad_h or pad_w:
            x = F.pad(x, (0, pad_w, 0, pad_h), mode="circular")
        h, w = x.shape[2] // PATCH, x.shape[3] // PATCH
        # "b c (h ph) (w pw) -> b (h w) (c ph pw)"
        img = x.reshape(B, C, h, PATCH, w, PATCH).permute(0, 2, 4, 1, 3, 5).reshape(B, h * w, C * PATCH * PATCH)

        n_axes = len(self.params.axes_dim)
        img_ids = torch.zeros(h, w, n_axes, device=x.device, dtype=torch.float32)
        img_ids[..., 1] = torch.arange(h, device=x.device, dtype=torch.float32)[:, None]  # row
        img_ids[..., 2] = torch.arange(w, device=x.device, dtype=torch.float32)[None, :]  # column
        img_ids = img_ids.reshape(1, h * w, n_axes).expand(B, -1, -1)
        txt_ids = torch.zeros(B, context.shape[1], n_axes, device=x.device, dtype=torch.float32)

        out = self.forward(img, img_ids, context, txt_ids, timesteps, y, guidance)
        c_out = self.out_channels // (PATCH * PATCH)
        # "b (h w) (c ph pw) -> b c (h ph) (w pw)"
        out = out.reshape(B, h, w, c_out, PATCH, PATCH).permute(0, 3, 1, 4, 2, 5).reshape(B, c_out, h * PATCH,
                                                                                          w * PATCH)
        return out[:, :, :H, :W]


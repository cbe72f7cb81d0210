"""ComfyUI's VAE and CLIP objects as the dataset's ImageEncoder / TextEncoder (see encoders.py).

Both are used exactly as ComfyUI's own VAEEncode and CLIPTextEncode nodes use them, so training sees the latents and
conditioning that sampling with the same objects would see. Nothing here imports ComfyUI (the objects are used
through their methods), so these classes work, and are tested, without it.
"""
from __future__ import annotations

import hashlib
import json

import torch
from torch import Tensor, nn


LUMINA2_PREFIX = ("You are an assistant designed to generate superior images with the superior degree of image-text "
                  "alignment based on textual prompts or user prompts. <Prompt Start> ")
_SAMPLED = 64  # values per tensor in a cache id, strided over the whole tensor


def weights_fingerprint(module: nn.Module | None, *extra) -> str:
    """A short hash of a module's tensor names, shapes and dtypes, `_SAMPLED` values strided over every tensor, and
    `extra`: two encoders that could encode differently never share it. Every tensor is sampled, because text
    encoders are several models in one (SD3.5's CLIP-L, CLIP-G and T5): swapping one part for a fine-tune of the
    same shape must give another id, or cached captions of the old one would be trained on."""
    h = hashlib.sha256(json.dumps([str(e) for e in extra]).encode())
    sd = module.state_dict() if module is not None else {}
    keys = sorted(sd)
    h.update(json.dumps([(k, list(sd[k].shape), str(sd[k].dtype)) for k in keys]).encode())
    for k in keys:
        t = sd[k]
        if t.device.type == "meta" or not t.numel():
            continue
        flat = t.detach().reshape(-1)
        try:
            sample = flat[::max(1, flat.numel() // _SAMPLED)][:_SAMPLED].to("cpu", torch.float32)
        except (RuntimeError, TypeError, NotImplementedError):  # a quantized type that cannot be read so: its shape
            continue
        h.update(sample.numpy().tobytes())
    return h.hexdigest()[:16]


class ComfyVaeEncoder:
    """ImageEncoder over a ComfyUI VAE: pixels in [-1, 1] (B, 3, H, W) -> vae.encode(BHWC in [0, 1]).

    A video VAE (Wan's) reads an IMAGE batch as the frames of one video, so images are encoded one at a time and the
    single frame's time axis is dropped: (B, C, h, w), as for image VAEs (the model adapter adds it back)."""

    def __init__(self, vae):
        if not hasattr(vae, "encode") or not hasattr(vae, "first_stage_model"):
            raise TypeError(f"the VAE input is a {type(vae).__name__}, not a ComfyUI VAE: connect Load VAE (or a "
                            "checkpoint loader's VAE output)")
        self.vae = vae
        compress = getattr(vae, "spacial_compression_encode", None)
        self.downscale = int(compress()) if compress else int(getattr(vae, "downscale_ratio", 8))
        self.video = getattr(vae, "latent_dim", 2) == 3
        stride = getattr(vae, "temporal_compression_decode", None) if self.video else None
        self.frame_stride = int(stride() or 1) if stride else 1  # Wan's VAE: 4 (1 + 4k frames -> 1 + k latents)
        self._cache_id = None

    @property
    def cache_id(self) -> str:
        if self._cache_id is None:
            vae = self.vae
            self._cache_id = f"comfy-vae-{type(vae.first_stage_model).__name__}-" + weights_fingerprint(
                vae.first_stage_model, getattr(vae, "latent_channels", None), self.downscale,
                getattr(vae, "vae_dtype", None))
        return self._cache_id

    def encode_video(self, frames: Tensor) -> Tensor:
        """One clip's frames (T, 3, H, W) in [-1, 1] -> its latent (C, T', h, w): the IMAGE batch a video VAE reads as
        one video (ComfyUI's VAEEncode of a Load Video's frames)."""
        if not self.video:
            raise ValueError("ComfyVaeEncoder.encode_video needs a video VAE (latent_dim 3, e.g. Wan's)")
        if frames.ndim != 4 or frames.shape[1] != 3:
            raise ValueError(f"ComfyVaeEncoder.encode_video wants (T, 3, H, W) in [-1, 1], got {tuple(frames.shape)}")
        latent = self.vae.encode(((frames.float() + 1) / 2).clamp(0, 1).movedim(1, -1))
        if latent.ndim != 5 or latent.shape[0] != 1:
            raise ValueError(f"the VAE returned latents of shape {tuple(latent.shape)} for one clip; expected "
                             "(1, C, T, h, w) from a video VAE")
        return latent[0]

    def encode(self, images: Tensor) -> Tensor:
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"ComfyVaeEncoder.encode wants (B, 3, H, W) in [-1, 1], got {tuple(images.shape)}")
        pixels = ((images.float() + 1) / 2).clamp(0, 1).movedim(1, -1)
        parts = [pixels[i:i + 1] for i in range(pixels.shape[0])] if self.video else [pixels]
        out = []
        for part in parts:
            latent = self.vae.encode(part)
            if latent.ndim == 5 and latent.shape[2] == 1:
                latent = latent[:, :, 0]
            if latent.ndim != 4:
                raise ValueError(f"the VAE returned latents of shape {tuple(latent.shape)} for one image; Tightrope "
                                 "trains on image latents (B, C, h, w): use an image or Wan-style video VAE")
            out.append(latent)
        return torch.cat(out)


class ComfyClipEncoder:
    """TextEncoder over a ComfyUI CLIP: clip.tokenize + encode_from_tokens(return_pooled=True), caption by caption
    (what CLIPTextEncode does). Models without a pooled embedding (Wan, Qwen-Image, Lumina 2) get width 0.

    Flux, SD3 and Wan tokenizers pad to 256, 77 and 512 tokens; Lumina 2's and Qwen-Image's do not pad, so each
    caption keeps its own token count, as at sampling, and the dataset batches captions of one length together.
    ComfyUI encodes caption by caption anyway, so the dataset hands over one caption per call."""

    captions_per_call = 1

    def __init__(self, clip):
        if not hasattr(clip, "tokenize") or not hasattr(clip, "encode_from_tokens"):
            raise TypeError(f"the CLIP input is a {type(clip).__name__}, not a ComfyUI CLIP: connect Load CLIP (or a "
                            "checkpoint loader's CLIP output)")
        self.clip = clip
        self._cache_id = None
        # Lumina 2 is sampled with CLIPTextEncodeLumina2 (comfy_extras/nodes_lumina2.py): system prompt +
        # " <Prompt Start> " + prompt; train on the conditioning that node gives for the caption
        tokenizer = type(getattr(clip, "tokenizer", None)).__name__
        self._prefix = LUMINA2_PREFIX if tokenizer == "LuminaTokenizer" else ""

    @property
    def cache_id(self) -> str:
        if self._cache_id is None:
            clip = self.clip
            model = getattr(clip, "cond_stage_model", None)
            patcher = getattr(clip, "patcher", None)
            patched = str(patcher.patches_uuid) if patcher is not None and getattr(patcher, "patches", None) else ""
            self._cache_id = f"comfy-clip-{type(model).__name__}-" + weights_fingerprint(
                model, getattr(clip, "layer_idx", None), json.dumps(getattr(clip, "tokenizer_options", {}),
                                                                    sort_keys=True, default=str), patched,
                self._prefix)
        return self._cache_id

    def encode(self, captions: list[str]) -> tuple[Tensor, Tensor]:
        if isinstance(captions, str):
            raise TypeError("ComfyClipEncoder.encode wants a list of captions, not a single string")
        contexts, pooled = [], []
        for caption in captions:
            out = self.clip.encode_from_tokens(self.clip.tokenize(self._prefix + caption),
                                               return_pooled=True, return_dict=True)
            context, vec = out["cond"], out.get("pooled_output")
            if contexts and context.shape[1] != contexts[0].shape[1]:
                raise ValueError(f"ComfyClipEncoder.encode: caption {caption[:60]!r} encodes to {context.shape[1]} "
                                 f"tokens, the first of this call to {contexts[0].shape[1]}: pass captions of one "
                                 "length, or one caption per call (captions_per_call)")
            contexts.append(context.float())
            pooled.append(vec.float() if vec is not None else context.new_zeros(context.shape[0], 0))
        return torch.cat(contexts), torch.cat(pooled)

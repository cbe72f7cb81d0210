"""Build a TrainingDataset from what a graph supplies: a folder plus encoders, or ComfyUI's LATENT + CONDITIONING."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .dataset import TrainingDataset
from .encoders import ImageEncoder, TextEncoder
from .image_folder import DatasetError
from .video_clips import DEFAULT_FPS, DEFAULT_FRAMES, ClipSettings


def encoders_for(vae: Any, clip: Any) -> tuple[ImageEncoder, TextEncoder]:
    """Our encoder protocol as is; ComfyUI's VAE / CLIP objects through the ComfyUI adapter."""
    image = vae if isinstance(vae, ImageEncoder) else None
    text = clip if isinstance(clip, TextEncoder) else None
    if image is None or text is None:
        from .comfy_encoders import ComfyClipEncoder, ComfyVaeEncoder  # ComfyUI imports live there only
        image = image or ComfyVaeEncoder(vae)
        text = text or ComfyClipEncoder(clip)
    return image, text


def dataset_from_folder(folder: str | Path, vae: Any, clip: Any, *, resolution: int, caption_dropout: float,
                        use_repeats: bool, strict: bool, cache_dir: Path | None,
                        mask: str = "none", progress=None, frames: int = DEFAULT_FRAMES,
                        fps: float = DEFAULT_FPS) -> TrainingDataset:
    """frames, fps: how video files in the folder become clips (video_clips.py)."""
    clips = ClipSettings(frames, float(fps))  # before the encoders: a bad setting fails first
    image, text = encoders_for(vae, clip)
    return TrainingDataset(folder, image, text, max_pixels=resolution * resolution, caption_dropout=caption_dropout,
                           use_repeats=use_repeats, strict=strict, cache_dir=cache_dir, mask=mask, progress=progress,
                           clips=clips)


def dataset_from_conditioning(latent: dict, conditioning: list, *, caption_dropout: float = 0.0,
                              empty_conditioning: list | None = None) -> TrainingDataset:
    """ComfyUI's LATENT ({"samples": (B,C,H,W)}, or a video VAE's (B,C,T,H,W): B clips of T latent frames each; the
    model must take video latents, input_checks.check_dataset_fits_model) and CONDITIONING ([[context (1|B,T,D),
    {"pooled_output": ...}]]): one conditioning for all latents, or one per latent."""
    samples = latent.get("samples") if isinstance(latent, dict) else None
    if not torch.is_tensor(samples):
        raise DatasetError("latent: expected ComfyUI's LATENT (a dict with 'samples'); connect a VAE Encode or "
                           "Empty Latent Image output")
    if samples.ndim == 5 and samples.shape[2] == 1:  # a video VAE's single-frame latents (Wan): image latents
        samples = samples[:, :, 0]
    if samples.ndim not in (4, 5):
        raise DatasetError(f"latent: samples have shape {tuple(samples.shape)}; expected images (batch, channels, "
                           "height, width) or a video VAE's latents (batch, channels, frames, height, width)")
    dropped = sorted({k for _, extra in conditioning for k in extra if k in _IMAGE_CONDITIONING})
    if dropped:
        raise DatasetError(f"conditioning carries {', '.join(dropped)} (an image-to-video / edit / reference "
                           "conditioning), which training does not use: ComfyUI would sample with it, so the LoRA "
                           "would learn without it; connect a plain CLIP Text Encode conditioning")
    conds = [(c, _pooled(c, extra)) for c, extra in conditioning]
    if len(conds) not in (1, samples.shape[0]):
        raise DatasetError(f"conditioning has {len(conds)} entries for {samples.shape[0]} latents: give one "
                           "conditioning (as CLIPTextEncode makes) or one per latent (e.g. Conditioning "
                           "(Combine) of one CLIPTextEncode per image)")
    pick = (lambda i: conds[0]) if len(conds) == 1 else (lambda i: conds[i])
    if caption_dropout > 0 and not empty_conditioning:
        raise DatasetError(f"caption_dropout={caption_dropout:g} trains some samples with the empty caption: connect "
                           "empty_conditioning (a CLIP Text Encode of an empty prompt), or set caption_dropout to 0")
    empty = empty_conditioning[0] if empty_conditioning else None
    return TrainingDataset.from_tensors(
        [samples[i] for i in range(samples.shape[0])], [pick(i)[0] for i in range(samples.shape[0])],
        [pick(i)[1] for i in range(samples.shape[0])], caption_dropout=caption_dropout,
        empty_context=empty[0] if empty else None, empty_pooled=_pooled(*empty) if empty else None)


# CONDITIONING keys that carry model inputs besides the text (ComfyUI's model_base extra_conds read them)
_IMAGE_CONDITIONING = ("concat_latent_image", "concat_mask", "concat_image", "clip_vision_output",
                       "reference_latents", "time_dim_concat", "unclip_conditioning", "noise_concat")


def _pooled(context, extra: dict):
    """The pooled text embedding; width 0 for models without one (Wan, Qwen-Image, Lumina 2: ComfyUI gives None)."""
    pooled = extra.get("pooled_output")
    return pooled if pooled is not None else context.new_zeros(context.shape[0], 0)

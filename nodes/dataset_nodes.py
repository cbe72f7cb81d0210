"""Dataset nodes: a folder of captioned images, or ComfyUI's own LATENT + CONDITIONING."""
from __future__ import annotations

import hashlib
import weakref

from ..training.data.builder import dataset_from_conditioning, dataset_from_folder
from ..training.data.cache_files import usage_summary
from ..training.data.image_folder import check_dataset_folder, folder_fingerprint
from ..training.data.masks import MASK_SOURCES
from ..training.data.video_clips import DEFAULT_FPS, DEFAULT_FRAMES
from . import host
from .input_validation import validation_result


# The datasets this process loaded, by folder. ComfyUI keeps a Load Dataset node's output while IS_CHANGED says the
# same, and a dataset reads its cache entries at each training read: `tightrope cache --delete` (another process) may
# remove them meanwhile, and the kept dataset failed at its first read (FileNotFoundError). IS_CHANGED says so now,
# and the folder is loaded again (the removed entries encoded again).
_LOADED: dict[str, "weakref.WeakSet"] = {}


def _removed_entries(folder: str) -> str:
    """A digest of the cache entries that the datasets loaded from `folder` (every folder for '': a folder linked
    from another node, which ComfyUI does not give IS_CHANGED) read and that are gone ('' if none)."""
    kept = [d for f in ([folder] if folder else list(_LOADED)) for d in list(_LOADED.get(f, ()))]
    gone = sorted({str(p) for d in kept for p in d.cache_files() if not p.is_file()})
    return hashlib.sha256("\0".join(gone).encode()).hexdigest() if gone else ""


class TightropeLoadDataset:
    DESCRIPTION = ("Images (and, for a video model such as Wan, video clips) with same-name .txt captions (kohya "
                   "'N_name' folders repeat N times), encoded once with the VAE and text encoder and cached on disk, "
                   "so the next run skips encoding.")
    CATEGORY = "Tightrope/data"
    RETURN_TYPES = ("TIGHTROPE_DATASET",)
    RETURN_NAMES = ("dataset",)
    FUNCTION = "load"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "folder": ("STRING", {"default": "", "tooltip": "Folder holding the images and their .txt captions."}),
            "vae": ("VAE", {"tooltip": "Encodes images to latents (the model's own VAE)."}),
            "clip": ("CLIP", {"tooltip": "Encodes captions (the model's own text encoders)."}),
            "resolution": ("INT", {"default": 512, "min": 16, "max": 4096, "step": 16,
                                   "tooltip": "Pixel budget: buckets keep each image's aspect ratio within "
                                              "resolution x resolution pixels."}),
            "caption_dropout": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 1.0, "step": 0.01,
                                          "tooltip": "Fraction of samples trained with an empty caption."}),
            "use_repeats": ("BOOLEAN", {"default": True,
                                        "tooltip": "Honour kohya 'N_name' folder repeat counts."}),
            "strict": ("BOOLEAN", {"default": False,
                                   "tooltip": "Stop at a bad image or caption; otherwise skip it with a warning."}),
        }, "optional": {
            "mask": (list(MASK_SOURCES), {"default": "none",
                                          "tooltip": "Loss mask per image (white = train, black = ignore): "
                                                     "mask_files reads name.mask.png beside name.png, alpha the "
                                                     "image's transparency. A missing or wrongly sized mask is an "
                                                     "error."}),
            "frames": ("INT", {"default": DEFAULT_FRAMES, "min": 1, "max": 1025, "step": 4,
                               "tooltip": "Video clips (.mp4 .webm .mov .mkv .avi .flv): frames per clip, from its "
                                          "start. Wan takes 1 + 4k (33, 49, 81); others are rounded down. A shorter "
                                          "clip trains on the frames it has. Images ignore it."}),
            "fps": ("FLOAT", {"default": DEFAULT_FPS, "min": 0.0, "max": 240.0, "step": 1.0,
                              "tooltip": "Video clips: the frame rate they are resampled to, the one the model "
                                         "samples at (Wan 2.1 / 2.2 A14B: 16, Wan 2.2 5B: 24), so motion trains at "
                                         "its real speed; 0 keeps each clip's own frames."}),
        }}

    @classmethod
    def VALIDATE_INPUTS(cls, **inputs):
        """Before anything runs: every widget in range, and a folder typed in (not linked) exists."""
        folder = inputs.get("folder")
        return validation_result(cls, inputs, lambda: folder is None or check_dataset_folder(folder))

    @classmethod
    def IS_CHANGED(cls, folder="", **inputs):
        """ComfyUI reuses this node's cached dataset while its inputs are the same: the folder's files count too, so
        images, captions or masks added or edited since the last run are scanned and encoded (new ones only); so are
        cache entries a kept dataset reads that were removed since (`tightrope cache --delete`)."""
        folder = folder if isinstance(folder, str) else ""  # None: linked from another node (not given here)
        gone = _removed_entries(folder)  # the same while the same ones are gone: loaded again once
        return (folder_fingerprint(folder) if folder else "") + (f"|cache entries removed {gone}" if gone else "")

    def load(self, folder, vae, clip, resolution, caption_dropout, use_repeats, strict, mask="none",
             frames=DEFAULT_FRAMES, fps=DEFAULT_FPS):
        dataset = dataset_from_folder(folder, vae, clip, resolution=resolution, caption_dropout=caption_dropout,
                                      use_repeats=use_repeats, strict=strict, cache_dir=host.cache_dir(), mask=mask,
                                      progress=host.work_progress("encoding images"), frames=frames, fps=fps)
        _LOADED.setdefault(folder, weakref.WeakSet()).add(dataset)
        if host.is_main():  # where the cache is, its size, and what this load did not use (training/data/cache_files)
            host.notify(usage_summary(host.cache_dir(), dataset.cache_files()))
        return (dataset,)


class TightropeDatasetFromLatents:
    DESCRIPTION = "A dataset from latents and conditioning you already encoded in ComfyUI (e.g. VAE Encode + CLIP "\
                  "Text Encode)."
    CATEGORY = "Tightrope/data"
    RETURN_TYPES = ("TIGHTROPE_DATASET",)
    RETURN_NAMES = ("dataset",)
    FUNCTION = "load"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "latent": ("LATENT", {"tooltip": "The encoded training images (a batch), or a video VAE's clips (batch, "
                                             "channels, frames, h, w) for a video model such as Wan."}),
            "conditioning": ("CONDITIONING", {"tooltip": "One conditioning for all images, or one per image."}),
            "caption_dropout": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 1.0, "step": 0.01,
                                          "tooltip": "Fraction of samples trained with the empty conditioning."}),
        }, "optional": {
            "empty_conditioning": ("CONDITIONING", {"tooltip": "The empty caption's conditioning, for dropout."}),
        }}

    @classmethod
    def VALIDATE_INPUTS(cls, **inputs):
        """Before anything runs: caption_dropout in range (NaN included)."""
        return validation_result(cls, inputs)

    def load(self, latent, conditioning, caption_dropout, empty_conditioning=None):
        return (dataset_from_conditioning(latent, conditioning, caption_dropout=caption_dropout,
                                          empty_conditioning=empty_conditioning),)

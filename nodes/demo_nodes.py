"""Nodes of the embedded default: a tiny Flux, stand-in encoders, and a generated image folder (no download)."""
from __future__ import annotations

from ..demo.model import demo_encoders, demo_model
from ..demo.conditioning import demo_conditioning
from ..demo.data import make_demo_dataset
from . import host
from .input_validation import validation_result


class TightropeDemoModel:
    DESCRIPTION = "A tiny random-weight Flux (hidden 128, 2+2 blocks) to try Tightrope on any machine, CPU included."
    CATEGORY = "Tightrope/demo"
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "load"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {
            "default": 0, "min": 0, "max": 2**31 - 1, "control_after_generate": "fixed",
            "tooltip": "Seed of the random weights: the same seed, the same model."})}}

    def load(self, seed):
        return (demo_model(seed),)


class TightropeDemoEncoders:
    DESCRIPTION = ("The demo's stand-ins for a VAE and text encoders (an exactly invertible latent codec and a "
                   "hashing caption embedder) sized for the demo model. Not real models.")
    CATEGORY = "Tightrope/demo"
    RETURN_TYPES = ("VAE", "CLIP")
    FUNCTION = "load"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {
            "default": 0, "min": 0, "max": 2**31 - 1, "control_after_generate": "fixed",
            "tooltip": "Seed of the codec's mixing matrix and the word vectors."})}}

    def load(self, seed):
        return demo_encoders(seed)


class TightropeDemoImages:
    DESCRIPTION = ("Draws a small captioned dataset (coloured shapes), optionally with loss masks, into a folder and "
                   "returns the folder's path.")
    CATEGORY = "Tightrope/demo"
    RETURN_TYPES = ("STRING",)
    RETURN_NAMES = ("folder",)
    FUNCTION = "make"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "subfolder": ("STRING", {"default": "tightrope_demo_images",
                                     "tooltip": "Folder name under the output folder to draw the images into."}),
            "count": ("INT", {"default": 16, "min": 1, "max": 1000, "tooltip": "How many images to draw."}),
            "size": ("INT", {"default": 64, "min": 16, "max": 1024, "step": 16,
                             "tooltip": "Side of each square image in pixels."}),
            "seed": ("INT", {"default": 0, "min": 0, "max": 2**31 - 1, "control_after_generate": "fixed",
                             "tooltip": "Same seed, same images."}),
        }, "optional": {
            "masks": ("BOOLEAN", {"default": False,
                                  "tooltip": "Also draw a loss mask per image (name.mask.png: the shape white, the "
                                             "background black), for Load Dataset's mask = mask_files."}),
        }}

    @classmethod
    def VALIDATE_INPUTS(cls, **inputs):
        """Before anything runs: every widget in range, the subfolder inside the output folder."""
        subfolder = inputs.get("subfolder")
        return validation_result(cls, inputs, lambda: subfolder is None or _images_folder(subfolder))

    def make(self, subfolder, count, size, seed, masks=False):
        folder = _images_folder(subfolder)
        return (str(make_demo_dataset(folder, n_images=count, size=size, seed=seed, masks=masks)),)


def _images_folder(subfolder: str):
    from ..training.state.atomic_write import safe_output_path
    return safe_output_path(host.output_dir(), subfolder, name="subfolder", example="tightrope_demo_images")


class TightropeDemoConditioning:
    DESCRIPTION = ("Stand-in text conditioning sized for the connected model (Flux, SD3.5, Lumina 2, Wan, Qwen-Image, "
                   "or the demo model): each word maps to a fixed random vector. Trains and samples without the "
                   "model's text encoders; not a real text encoder.")
    CATEGORY = "Tightrope/demo"
    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "encode"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("MODEL", {"tooltip": "The model the conditioning is for (sets its widths)."}),
            "text": ("STRING", {"default": "a red circle", "multiline": True,
                                "tooltip": "The prompt: the same words, the same conditioning."}),
            "tokens": ("INT", {"default": 16, "min": 1, "max": 512, "tooltip": "Context length in tokens."}),
            "seed": ("INT", {"default": 0, "min": 0, "max": 2**31 - 1, "control_after_generate": "fixed",
                             "tooltip": "Seed of the word vectors."}),
        }}

    def encode(self, model, text, tokens, seed):
        return (demo_conditioning(model, text, tokens, seed),)

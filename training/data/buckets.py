"""Aspect-ratio buckets: train each image near its own shape under a fixed pixel budget.

A bucket is a (width, height) whose area fits `max_pixels` and whose sides are multiples of `multiple`
(the encoder's downscale times the model's patch size: 16 for an 8x VAE with patch 2, 4 for the demo
codec), so every latent splits into whole patches. Images in one bucket share a latent shape and can
be batched together.
"""
from __future__ import annotations

import math

from PIL import Image, ImageOps


def choose_bucket(width: int, height: int, max_pixels: int, multiple: int) -> tuple[int, int]:
    """The (width, height) bucket for an image: sides multiples of `multiple`, area at most `max_pixels`,
    aspect ratio as close to the image's as the grid allows without giving up much resolution.

    The bucket is filled by scaling and center-cropping (never stretching), so a ratio mismatch costs
    the crop and a small bucket costs resolution. Candidates are the sizes near the ideal one (the image
    scaled to exactly max_pixels); each is scored by  area/max_pixels * kept**2,  kept being the fraction
    of the image that survives the crop. Crop counts twice because cutting off part of a subject hurts
    more than slightly lower resolution, yet a 512x288 bucket (exact 16:9) under a 512x512 budget still
    loses to 672x384 (1.6% cropped, 45% more pixels). Ties go to the smaller crop, then the larger area.
    """
    if width < 1 or height < 1:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    if max_pixels < multiple * multiple:
        raise ValueError(f"max_pixels={max_pixels} is smaller than one {multiple}x{multiple} cell: raise max_pixels")
    m, ratio = multiple, width / height

    def widths_near(w: float) -> set[int]:
        base = max(1, math.floor(w / m))
        return {k * m for k in (base - 1, base, base + 1) if k >= 1}

    candidates = set()
    # Each side near its ideal value, paired with the partner sides that keep the ratio (floor and ceil).
    for w in widths_near(math.sqrt(max_pixels * ratio)):
        candidates |= {(w, h) for h in widths_near(w / ratio)}
    for h in widths_near(math.sqrt(max_pixels / ratio)):
        candidates |= {(w, h) for w in widths_near(h * ratio)}
    # Extreme ratios: the thin side bottoms out at one multiple, the long side takes the rest.
    candidates |= {(m, max_pixels // m // m * m), (max_pixels // m // m * m, m)}
    fitting = [(w, h) for w, h in candidates if w * h <= max_pixels]

    def score(size: tuple[int, int]) -> tuple[float, float, int, int]:
        w, h = size
        kept = min(w / h / ratio, ratio * h / w)
        # Rounded so float noise can't break ties; the width breaks the last tie deterministically.
        return (-round(w * h / max_pixels * kept * kept, 12), -round(kept, 12), -w * h, w)

    return min(fitting, key=score)


def fit_to_bucket(image: Image.Image, bucket: tuple[int, int]) -> Image.Image:
    """Scale the image to cover the bucket (Lanczos), then crop the overhang equally from both sides."""
    if image.size == tuple(bucket):
        return image
    return ImageOps.fit(image, tuple(bucket), method=Image.Resampling.LANCZOS, centering=(0.5, 0.5))

"""A tiny captioned dataset drawn on the fly, so the demo and the tests need no downloads.

Each image is one shape (circle, square or triangle) in one colour on a contrasting background, at a
varied position and size; its caption says which ("a red circle on a blue background"). With masks=True each
image also gets a loss mask, NNN.mask.png: the shape white (trained), the background black (ignored).
"""
from __future__ import annotations

import random
import re
from pathlib import Path

from PIL import Image, ImageDraw

from ..training.data.image_folder import MASK_SUFFIX

COLOURS = {
    "red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 210), "yellow": (240, 210, 40),
    "white": (245, 245, 245), "black": (15, 15, 15), "purple": (140, 50, 170), "orange": (245, 140, 30),
}
SHAPES = ("circle", "square", "triangle")


def _luma(rgb: tuple[int, int, int]) -> float:
    r, g, b = rgb
    return 0.299 * r + 0.587 * g + 0.114 * b


def _a(word: str) -> str:
    return f"an {word}" if word[0] in "aeiou" else f"a {word}"


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int], fill) -> None:
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=fill)


def make_demo_dataset(folder: str | Path, n_images: int = 16, size: int = 64, seed: int = 0,
                      masks: bool = False) -> Path:
    """Write NNN.png + NNN.txt pairs into `folder` (created if needed), and NNN.mask.png (the shape's region, for
    Load Dataset's mask='mask_files') when `masks`; same seed -> same bytes, the same images with or without masks."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    names = sorted(COLOURS)
    for i in range(n_images):
        shape = SHAPES[rng.randrange(len(SHAPES))]
        colour = names[rng.randrange(len(names))]
        # Contrasting: a background whose brightness differs enough that the shape stays visible.
        backgrounds = [n for n in names if abs(_luma(COLOURS[n]) - _luma(COLOURS[colour])) > 60]
        background = backgrounds[rng.randrange(len(backgrounds))]
        side = rng.randint(size * 3 // 10, size * 7 // 10)
        x0, y0 = rng.randint(0, size - side), rng.randint(0, size - side)

        box = (x0, y0, x0 + side - 1, y0 + side - 1)
        image = Image.new("RGB", (size, size), COLOURS[background])
        _draw_shape(ImageDraw.Draw(image), shape, box, COLOURS[colour])
        image.save(folder / f"{i:03d}.png", format="PNG")
        if masks:
            mask = Image.new("L", (size, size), 0)
            _draw_shape(ImageDraw.Draw(mask), shape, box, 255)
            mask.save(folder / f"{i:03d}{MASK_SUFFIX}", format="PNG")
        (folder / f"{i:03d}.txt").write_text(f"{_a(colour)} {shape} on {_a(background)} background\n", encoding="utf-8")
    _remove_leftovers(folder, n_images, masks)
    return folder


def _remove_leftovers(folder: Path, n_images: int, masks: bool) -> None:
    """Files an earlier call wrote that this one did not (a larger count, or masks then): the folder holds exactly
    what was asked, or Load Dataset would train on the old images too (found by a helper). Only the demo's own names
    (NNN.png, NNN.txt, NNN.mask.png); anything else in the folder is left alone."""
    for path in folder.iterdir():
        m = re.fullmatch(r"(\d{3,})(\.png|\.txt|" + re.escape(MASK_SUFFIX) + ")", path.name)
        if m and path.is_file() and (int(m.group(1)) >= n_images or m.group(2) == MASK_SUFFIX and not masks):
            path.unlink()

"""What a dataset folder holds that trains, but likely not as meant: each said once per load, naming the files and
the fix (image_folder.py scans the folder, dataset.py reads the images' headers before encoding them)."""
from __future__ import annotations

import warnings
from pathlib import Path

# Upscaling an image by more than this into its bucket is warned about: it mostly teaches the LoRA blur.
UPSCALE_WARNING_FACTOR = 2.0
MANY_REPEATS = 100  # more repeats than this in a folder name get a warning (a year, say)


def _quoted(path: Path) -> str:
    return f"'{path}'"


def _named(items: list[str], limit: int = 5) -> str:
    return ", ".join(items[:limit]) + (f" and {len(items) - limit} more" if len(items) > limit else "")


def warn_many_repeats(entries: list, root: Path) -> None:  # image_folder.ImageEntry each
    """kohya reads any 'N_name' folder as N repeats: a '2024_holiday' folder would show its images 2024 times an
    epoch. Counts that large are more likely a date than a wish, so they are named once per run."""
    many = sorted({(e.path.relative_to(root).parts[0], e.repeats) for e in entries if e.repeats > MANY_REPEATS})
    if many:
        named = ", ".join(f"'{folder}' ({n}x)" for folder, n in many[:3])
        warnings.warn(f"dataset folder '{root}': {named} repeat their images that many times an epoch (kohya's "
                      "'N_name' folders); rename the folder if the number is not a repeat count, or set use_repeats "
                      "to false", stacklevel=3)


def warn_shared_captions(entries: list) -> None:  # image_folder.ImageEntry each
    """Images of one name in several formats ('a.png' and 'a.jpg') share the caption 'a.txt' and each trains as an
    image of its own: most often an export left twice, which doubles that image's weight without a word."""
    by_stem: dict[Path, list[Path]] = {}
    for entry in entries:
        by_stem.setdefault(entry.path.with_suffix(""), []).append(entry.path)
    shared = [paths for paths in by_stem.values() if len(paths) > 1]
    if shared:
        named = _named([" and ".join(_quoted(p) for p in paths) for paths in shared], 3)
        warnings.warn(f"{len(shared)} caption file(s) each serve images of one name in several formats, which all "
                      f"train: {named}: delete the copies you did not mean to train (or rename them, each with its "
                      "own caption)", stacklevel=3)


def warn_upscaled(upscaled: list[tuple[Path, float]]) -> None:
    """One warning naming the images (path, factor) blown up by more than UPSCALE_WARNING_FACTOR into their bucket."""
    if upscaled:
        warnings.warn(f"{len(upscaled)} image(s) are smaller than the training resolution and are upscaled more than "
                      f"{UPSCALE_WARNING_FACTOR:g}x, which trains blur: "
                      f"{_named([f'{_quoted(p)} {factor:.1f}x' for p, factor in upscaled])}: use larger images, or "
                      "lower the Load Dataset resolution", stacklevel=3)


def warn_animated(animated: list[Path]) -> None:
    """One warning naming the animated images (PNG or WebP with several frames): training sees their first frame only,
    as Pillow decodes it."""
    if animated:
        warnings.warn(f"{len(animated)} image(s) are animated and train on their first frame only: "
                      f"{_named([_quoted(p) for p in animated])}: export the frames you want as separate "
                      "images", stacklevel=3)

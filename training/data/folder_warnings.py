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


def warn_duplicates(copies: dict[str, list[tuple[Path, int]]]) -> None:
    """One warning naming the images saved more than once (copies: each image file's sha256 -> its (path, repeats)):
    byte-identical files under other names or in other folders (a scraped set, an export left twice) each train, so
    that image weighs as much as all its copies together. The same file in two kohya folders ('3_a/x.png' and
    '5_a/x.png') is named too: most often a copy left behind when moving an image to change its weight, and a
    heavier weight is what the folder's count is for. Masks are not images here; a copy with a caption of its own is
    named as well (several captions for one image, if meant, can be ignored)."""
    groups = [paths for paths in copies.values() if len(paths) > 1]
    if groups:
        def group(paths: list[tuple[Path, int]]) -> str:
            shown = " = ".join(_quoted(p) + (f" ({r}x)" if r > 1 else "") for p, r in paths)
            return shown + (f": {sum(r for _, r in paths)}x an epoch" if any(r > 1 for _, r in paths) else "")
        warnings.warn(f"{len(groups)} image(s) are saved more than once (byte-identical files), and each copy trains, "
                      f"so that image weighs as much as its copies together: {_named([group(g) for g in groups], 3)}: "
                      "delete the copies you did not mean to train (to train an image more often, raise its 'N_name' "
                      "folder's repeat count instead)", stacklevel=3)

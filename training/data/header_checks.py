"""Checks of a folder's images from their headers, before any encoding (the dataset's first pass)."""
from __future__ import annotations

from pathlib import Path

from .buckets import choose_bucket
from .folder_warnings import UPSCALE_WARNING_FACTOR, warn_animated, warn_upscaled
from .image_folder import DatasetError, read_image_header
from .video_clips import is_video


def warn_from_headers(entries, max_pixels: int, multiple: int, max_image_pixels: int) -> dict[Path, tuple[int, int]]:
    """From the images' headers, before any encoding: the images that fitting to their bucket enlarges more than
    UPSCALE_WARNING_FACTOR (path, factor), and those with several frames (an image that cannot be read is the
    encoding's to report). Returns the sizes read (path -> read_image_size's), for the images the hash index knows."""
    upscaled, animated, sizes = [], [], {}
    for entry in entries:
        if is_video(entry.path):  # a clip's size is read when it is encoded (video_clips.py)
            continue
        try:
            size, frames = read_image_header(entry.path, max_pixels=max_image_pixels)
        except (DatasetError, OSError):
            continue
        sizes[entry.path] = size
        bucket = choose_bucket(*size, max_pixels, multiple)
        factor = max(bucket[0] / size[0], bucket[1] / size[1])  # fit_to_bucket scales to cover the bucket
        if factor > UPSCALE_WARNING_FACTOR:
            upscaled.append((entry.path, factor))
        if frames:
            animated.append(entry.path)
    warn_upscaled(upscaled)
    warn_animated(animated)
    return sizes

"""Checks of a folder's images from their headers, before any encoding (the dataset's first pass)."""
from __future__ import annotations

from pathlib import Path

from .buckets import choose_bucket
from .folder_warnings import UPSCALE_WARNING_FACTOR, warn_animated, warn_upscaled
from .image_folder import ImageHeader
from .video_clips import is_video


def warn_from_headers(entries: list, hashes, max_pixels: int, multiple: int,
                      max_image_pixels: int) -> dict[Path, ImageHeader]:
    """From the images' headers (hashes: image_hashes.ImageHashes, which remembers them: an unchanged image is not
    opened), before any encoding: the images that fitting to their bucket enlarges more than UPSCALE_WARNING_FACTOR,
    and those with several frames (an image that cannot be read is the encoding's to report). Returns the headers
    read, path -> ImageHeader. A clip's size is read when it is encoded (video_clips.py)."""
    upscaled, animated, headers = [], [], {}
    for entry in entries:
        if is_video(entry.path):
            continue
        try:
            header = headers[entry.path] = hashes.header(entry.path, max_image_pixels)
        except (ValueError, OSError):  # image_folder.DatasetError is a ValueError
            continue
        bucket = choose_bucket(*header.size, max_pixels, multiple)
        factor = max(bucket[0] / header.size[0], bucket[1] / header.size[1])  # fit_to_bucket scales to cover it
        if factor > UPSCALE_WARNING_FACTOR:
            upscaled.append((entry.path, factor))
        if header.frames:
            animated.append(entry.path)
    warn_upscaled(upscaled)
    warn_animated(animated)
    return headers

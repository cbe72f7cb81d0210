"""A still image's EXIF read from its header (image_folder.read_header), without decoding the pixels where the
header holds it all."""
from __future__ import annotations

import os
import struct

from PIL import Image


def header_exif(image: Image.Image) -> Image.Exif:
    """The image's EXIF as load_oriented will see it, without decoding the pixels where the header holds it all.
    Pillow's PNG getexif() decodes the whole image first (metadata may follow the pixel data): 0.1 s for a 4 MP PNG,
    paid for every header read of every image, a rerun whose latents are all cached included. A PNG whose metadata
    chunks all come before its pixel data (what cameras and editors write) is read from the header; one with
    metadata after it goes through Pillow's own path."""
    if image.format == "PNG" and "exif" not in image.info and not _png_metadata_after_pixels(image):
        return Image.Image.getexif(image)  # PngImageFile.getexif without its load(): the header's chunks are all
    return image.getexif()


_PNG_METADATA = (b"eXIf", b"tEXt", b"zTXt", b"iTXt")  # where Pillow finds EXIF (and XMP orientation) in a PNG


def _png_metadata_after_pixels(image: Image.Image) -> bool:
    """Whether a PNG has metadata chunks after its pixel data (IDAT) that only a decode would read; True where the
    chunk walk cannot tell (a truncated or odd file: Pillow's own path decides). Seeks over the pixel data."""
    fp = image.fp
    start = fp.tell()
    try:
        fp.seek(8)  # past the signature
        after_pixels = False
        while True:
            head = fp.read(8)
            if len(head) < 8:
                return True
            length, kind = struct.unpack(">I4s", head)
            if kind == b"IEND":
                return False
            if kind in (b"IDAT", b"fdAT"):
                after_pixels = True
            elif after_pixels and kind in _PNG_METADATA:
                return True
            fp.seek(length + 4, os.SEEK_CUR)  # the chunk's data and CRC
    except (OSError, ValueError, struct.error):
        return True
    finally:
        fp.seek(start)

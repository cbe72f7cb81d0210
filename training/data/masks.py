"""Masked loss: a per-image weight map (white = train, black = ignore) that weights the loss on the latent grid.

A mask comes from `name.mask.png` beside `name.png` (mask='mask_files') or from the image's own alpha channel
(mask='alpha'). It goes through exactly the image's geometry (EXIF orientation, then ImageOps.fit's scale-to-cover
and centre crop to the bucket), then is area-averaged to the latent grid: a latent cell stands for a
downscale x downscale patch of pixels, so its weight is the fraction of that patch the mask keeps. Area averaging
keeps the mask's mass (half a cell masked weighs half), never rings (a Lanczos mask would go below 0 or above 1
at edges) and never flips a cell on or off the way nearest-neighbour sampling would. The loss grid is the latent
grid, not the transformer's coarser patch grid: the loss is a mean over latent elements, so that is the finest
resolution a weight can act on.

A missing mask, one of the wrong size and an image without alpha (mask='alpha') are found from file headers before
any image is encoded, and always raised, whatever `strict` says: training on without them would silently train on
what the user chose to leave out. A mask that is black everywhere is found when it is read, and is treated like a
bad image (raised, or skipped with a warning when strict=False).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from PIL import Image, ImageOps
from torch import Tensor

from ..flow_loss import flow_matching_loss
from .image_folder import MASK_SUFFIX, DatasetError, ImageEntry, companion_file, load_oriented
from .image_hashes import ImageHashes

MASK_SOURCES = ("none", "mask_files", "alpha")
MASK_VERSION = "box-fit-area-v2"  # bump when the mask preprocessing changes, so cached masks stop matching
_WIDE_GREY = ("I;16", "I;16L", "I;16B", "I;16N", "I")  # 16-bit greyscale modes
_SHOWN = 3  # files named in one error


@dataclass(frozen=True)
class MaskSource:
    path: Path      # the file the mask is read from: the mask file, or the image itself (alpha)
    alpha: bool     # read the alpha channel (else the grey levels)
    cache_key: str  # what determines the mask besides the image: the mask file's bytes, or "alpha"


def mask_path(image: Path, listings: dict | None = None) -> Path:
    """Where mask='mask_files' looks for the mask of `image`: name.mask.png beside it (for any image format), found
    as a caption is (image_folder.companion_file: in another case, e.g. 'a.MASK.PNG', where no exact name exists)."""
    return companion_file(image, image.stem + MASK_SUFFIX, listings)


def find_masks(entries: list[ImageEntry], source: str, max_pixels: int,
               hashes: ImageHashes | None = None) -> dict[Path, MaskSource]:
    """Each image's mask source (empty for 'none'), checked from file headers; DatasetError naming the files. hashes:
    the load's index (image_hashes.py), which gives an unchanged file's header and sha256 without opening it."""
    hashes = ImageHashes(None) if hashes is None else hashes
    if source not in MASK_SOURCES:
        raise DatasetError(f"mask={source!r} is not supported: choose one of {', '.join(MASK_SOURCES)}")
    if source == "none":
        return {}
    if source == "alpha":
        opaque = [e.path for e in entries if not hashes.header(e.path, max_pixels).alpha]
        if opaque:
            raise DatasetError(f"mask='alpha' but {len(opaque)} of {len(entries)} images have no alpha channel "
                               f"({_names(opaque)}): save them as PNG with transparency (transparent = not trained), "
                               "or choose mask='mask_files' or 'none'")
        return {e.path: MaskSource(e.path, True, "alpha") for e in entries}
    listings: dict = {}
    paths = {e.path: mask_path(e.path, listings) for e in entries}
    missing = [path for path in paths.values() if not path.is_file()]
    if missing:
        raise DatasetError(f"mask='mask_files' but {len(missing)} of {len(entries)} images have no mask file "
                           f"({_names(missing)}): put a greyscale name.mask.png (white = train, black = ignore) of "
                           "the image's size beside each image, or choose mask='none'")
    found = {}
    for e in entries:
        path = paths[e.path]
        digest, data = hashes.digest(path)  # data None: the index knew the file; nothing was read
        size, image_size = hashes.header(path, max_pixels, data=data).size, hashes.header(e.path, max_pixels).size
        if size != image_size:
            raise DatasetError(f"mask file '{path}' is {size[0]}x{size[1]} but its image '{e.path}' is "
                               f"{image_size[0]}x{image_size[1]}: save the mask at the image's size")
        found[e.path] = MaskSource(path, False, digest)
    return found


def _names(paths: list[Path]) -> str:
    more = f" and {len(paths) - _SHOWN} more" if len(paths) > _SHOWN else ""
    return ", ".join(f"'{p}'" for p in paths[:_SHOWN]) + more


def latent_mask(source: MaskSource, bucket: tuple[int, int], downscale: int, max_pixels: int) -> Tensor:
    """The (1, h, w) fp32 weights in [0, 1] on the latent grid of an image fitted to `bucket` (width, height)."""
    image = load_oriented(source.path, max_pixels=max_pixels)
    if source.alpha:
        weights = image.convert("RGBA").getchannel("A").convert("F").point(lambda v: v / 255.0)
    elif image.mode in _WIDE_GREY:  # 16-bit greyscale: Pillow's conversion to "L" clips at 255 instead of scaling
        weights = image.convert("I").convert("F").point(lambda v: v / 65535.0)
    elif image.mode == "F":  # float greyscale: already 0..1
        weights = image
    else:
        weights = image.convert("L").convert("F").point(lambda v: v / 255.0)
    if weights.size != tuple(bucket):  # the image's geometry (buckets.fit_to_bucket), with an area filter
        weights = ImageOps.fit(weights, tuple(bucket), method=Image.Resampling.BOX, centering=(0.5, 0.5))
    w, h = weights.size
    pixels = torch.frombuffer(bytearray(weights.tobytes()), dtype=torch.float32).view(1, 1, h, w)
    mask = F.avg_pool2d(pixels.clamp(0.0, 1.0), downscale)[0]
    if not mask.sum() > 0:
        raise DatasetError(f"the mask of '{source.path}' is black everywhere: nothing of this image would be "
                           "trained; whiten the part to train on, or remove the image")
    return mask


def masked_mean(elementwise: Tensor, mask: Tensor) -> Tensor:
    """The mean over images of each image's mask-weighted mean (masked_per_image). A fully white mask gives the
    plain mean; masked-out elements contribute exactly nothing, to the loss or its gradient."""
    return masked_per_image(elementwise, mask).mean()


def masked_per_image(elementwise: Tensor, mask: Tensor) -> Tensor:
    """(B,) mask-weighted means of a (B, C, h, w) loss, or (B, C, T, h, w) for families with a frame axis (Wan,
    Qwen-Image): sum(mask_b * loss_b) / (C * T * sum(mask_b)), the (B, 1, h, w) mask broadcast over channels and
    frames. Each image is normalised by its own kept area, so a small mask does not shrink the learning rate, every
    image weighs the same as in an unmasked batch, and a batch cut into parts (torchrun ranks, each weighted by its
    share of images) gives exactly the whole batch's loss."""
    mask = mask.to(elementwise.dtype)
    if elementwise.ndim > mask.ndim:  # the frame axis sits between channels and height
        mask = mask.reshape(*mask.shape[:2], *[1] * (elementwise.ndim - mask.ndim), *mask.shape[2:])
    if mask.shape[0] != elementwise.shape[0] or mask.shape[-2:] != elementwise.shape[-2:]:
        raise ValueError(f"a loss mask of shape {tuple(mask.shape)} does not fit a loss of shape "
                         f"{tuple(elementwise.shape)}")
    per_element = elementwise[0].numel() // mask[0].numel()  # C * T
    return (elementwise * mask).flatten(1).sum(1) / (mask.flatten(1).sum(1) * per_element)


def masked_flow_loss(prediction: Tensor, latents: Tensor, noise: Tensor, mask: Tensor, *, kind: str = "mse",
                     huber_delta: float = 1.0) -> Tensor:
    """flow_loss.flow_matching_loss (the `kind` distance of the velocity, fp32) weighted by the mask."""
    elementwise = flow_matching_loss(prediction, latents, noise, kind=kind, huber_delta=huber_delta,
                                     reduction="element")
    return masked_mean(elementwise, mask)

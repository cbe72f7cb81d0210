"""Reading a training folder: images, their same-name .txt captions, and kohya-style repeat folders.

Layout: images sit in the folder itself or in subfolders; a subfolder named `N_name` (kohya's form,
e.g. `10_mychar/`) repeats each image under it N times per epoch; anything else counts once. Hidden
files and folders (".name") are ignored; links to folders are followed (a link loop is not).

Every problem raises DatasetError naming the file and saying how to fix it. With strict=False a
problem with one image or its caption skips that image with a warning instead; a dataset left with no
usable image still raises.

Order: images are listed by their relative paths' names, part by part, in code point order ('B.png' before
'a.png'), on every OS: the same folder gives the same samples in the same order, and the same seeded run, on Linux,
Windows and macOS (pathlib's own order ignores case on Windows).

Captions: `name.txt` beside `name.png` (any image extension, in any case); where no file has exactly that name, the
one file beside it whose name differs only in case ('IMG_1.PNG' + 'img_1.txt', 'a.png' + 'a.TXT'), as Windows and
macOS (case-insensitive file systems) find it themselves; two such files (a case-sensitive file system can hold
'a.TXT' and 'A.txt') are an error. Masks (`name.mask.png`) are found the same way. Read as UTF-8 (a BOM is dropped),
surrounding whitespace stripped and inner runs of whitespace/newlines (Windows' CRLF line ends too) joined into single
spaces. A missing or empty (blank) caption file is an error, not a silent empty caption: it is almost always a
forgotten caption, and training on purpose without captions is what caption dropout is for.
"""
from __future__ import annotations

import hashlib
import io
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from PIL import Image, ImageOps

from .folder_warnings import warn_many_repeats, warn_shared_captions
from .image_exif import header_exif

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
VIDEO_EXTENSIONS = (".mp4", ".webm", ".mov", ".mkv", ".avi", ".flv")  # clips (video_clips.py), as ComfyUI's datasets
# Formats people often drop in by mistake; named in the "no images" error so the fix is obvious.
_UNSUPPORTED_IMAGE_EXTENSIONS = (".gif", ".tif", ".tiff", ".avif", ".heic", ".heif", ".jxl", ".psd")
# 100 megapixels: far above any training image, far below what would exhaust memory while decoding.
DEFAULT_MAX_IMAGE_PIXELS = 100_000_000
MASK_SUFFIX = ".mask.png"  # name.mask.png beside name.png (or name.jpg ...) is that image's loss mask
_REPEAT_FOLDER = re.compile(r"^(\d+)_(.+)$")
_EXIF_ORIENTATION = 0x0112
# more than this is refused: an epoch of 'N_name' repeats is planned item by item, so a date-named folder
# ('20240615_beach': 20 million repeats an image) takes minutes and gigabytes per Train node, then runs out of memory
_MAX_REPEATS = 10_000


class DatasetError(ValueError):
    """A problem with the training data; the message names the input and says how to fix it."""


@dataclass(frozen=True)
class ImageEntry:
    path: Path
    caption: str
    repeats: int


def skip_or_raise(error: DatasetError, strict: bool) -> None:
    """The strict/non-strict policy in one place: raise, or warn and let the caller skip the image."""
    if strict:
        raise error
    warnings.warn(f"skipping an image (strict=False): {error}", stacklevel=3)


def _repeats_for(folder: Path, root: Path) -> int:
    """Repeats come from the top-level subfolder under root; the root itself and plain folders -> 1."""
    if folder == root:
        return 1
    top = folder.relative_to(root).parts[0]
    match = _REPEAT_FOLDER.match(top)
    if not match:
        return 1
    repeats = int(match.group(1))
    if repeats < 1:
        raise DatasetError(f"folder '{root / top}' asks for {repeats} repeats: rename it with a count of at least 1, "
                           f"e.g. '1_{match.group(2)}', or set use_repeats to false")
    if repeats > _MAX_REPEATS:
        raise DatasetError(f"folder '{root / top}' asks for {repeats} repeats an epoch (kohya's 'N_name' folders), "
                           f"more than the {_MAX_REPEATS} allowed: a number that large is a date or an id, not a "
                           f"repeat count; rename the folder (e.g. '1_{match.group(2)}'), or set use_repeats to false")
    return repeats


def companion_file(image: Path, name: str, listings: dict | None = None) -> Path:
    """The file `name` beside `image` (its caption or mask): that exact name, else the one file there whose name
    differs from it only in case (module docstring); the exact path when there is none. `listings` caches each
    folder's names between calls (a scan's thousands of images each list the folder once)."""
    exact = image.with_name(name)
    if exact.is_file():
        return exact
    listings = {} if listings is None else listings
    if image.parent not in listings:
        try:
            listings[image.parent] = os.listdir(image.parent)
        except OSError:
            listings[image.parent] = []
    found = sorted(n for n in listings[image.parent] if n.lower() == name.lower() and (image.parent / n).is_file())
    if len(found) > 1:
        raise DatasetError(f"image '{image}' has {len(found)} files named '{name}' but for case ("
                           f"{', '.join(found)}): keep one, as a case-insensitive file system (Windows, macOS) must")
    return image.parent / found[0] if found else exact


def read_caption(image_path: Path, listings: dict | None = None) -> str:
    caption_path = companion_file(image_path, image_path.stem + ".txt", listings)
    if not caption_path.is_file():
        raise DatasetError(f"image '{image_path}' has no caption file: write its caption into '{caption_path}'")
    try:
        text = caption_path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise DatasetError(f"caption file '{caption_path}' is not valid UTF-8 (bad byte at offset {e.start}): "
                           f"re-save it with UTF-8 encoding") from None
    except OSError as e:
        raise DatasetError(f"cannot read caption file '{caption_path}' ({e.strerror or e}): "
                           f"check that it exists and is readable") from None
    caption = " ".join(text.split())
    if not caption:
        raise DatasetError(f"caption file '{caption_path}' is empty: write a caption into it (to train partly "
                           f"without captions, caption every image and set caption_dropout instead)")
    return caption


def _list_images(root: Path) -> tuple[list[Path], list[Path]]:
    """Supported images and would-be images in unsupported formats, both sorted, hidden names skipped."""
    images, unsupported = [], []
    for path in _walk(root):
        dangling = path.is_symlink() and not path.exists()  # an image's link to a moved file: reported by the scan
        if any(part.startswith(".") for part in path.relative_to(root).parts) or not (path.is_file() or dangling) \
                or path.name.lower().endswith(MASK_SUFFIX):  # an image's mask (training/masks.py), not an image
            continue
        suffix = path.suffix.lower()
        if suffix in IMAGE_EXTENSIONS or suffix in VIDEO_EXTENSIONS:
            images.append(path)
        elif suffix in _UNSUPPORTED_IMAGE_EXTENSIONS:
            unsupported.append(path)
    return images, unsupported


def _walk(root: Path) -> list[Path]:
    """Every path under root, sorted by name, part by part, in code point order (as sorted(root.rglob("*")) sorts them
    on Linux, not as on Windows, where paths compare ignoring case), hidden folders not entered (their files are
    skipped anyway). Links to folders are followed, as kohya's listing follows them: pathlib's "**" does not, so a
    linked 'N_name' subfolder was silently left out of training. A link back to a folder above it (a loop) is not
    followed again."""
    found: list[tuple[tuple[str, ...], Path]] = []  # (the path's parts under root, the path)

    def visit(folder: Path, parts: tuple[str, ...], above: frozenset) -> None:
        try:
            stat = folder.stat()
            entries = sorted(os.scandir(folder), key=lambda entry: entry.name)
        except OSError:  # an unreadable folder is skipped, as rglob skips it
            return
        above = above | {(stat.st_dev, stat.st_ino)}
        for entry in entries:
            path = folder / entry.name
            found.append((parts + (entry.name,), path))
            try:
                is_dir = entry.is_dir()  # follows a link
            except OSError:
                is_dir = False
            if is_dir and not entry.name.startswith("."):
                try:
                    target = os.stat(path)  # entry.stat() has no inode on Windows but for a symlink's (a junction: 0)
                except OSError:
                    continue
                if (target.st_dev, target.st_ino) not in above:
                    visit(path, parts + (entry.name,), above)

    visit(root, (), frozenset())
    return [path for _, path in sorted(found, key=lambda item: item[0])]


def folder_path(folder: str | Path) -> Path:
    """The folder with '~' expanded and double quotes around it dropped (Windows' "Copy as path" adds them, and no
    name may hold '"' there); an unknown '~user' is a DatasetError (pathlib raises a RuntimeError)."""
    text = str(folder)
    try:
        return Path(text[1:-1] if len(text) > 1 and text[0] == text[-1] == '"' else folder).expanduser()
    except RuntimeError:
        user = re.split(r"[/\\]", str(folder))[0]
        raise DatasetError(f"dataset folder '{folder}' starts with '{user}', a user whose home folder this machine "
                           f"does not know: give the folder's full path") from None


def check_dataset_folder(folder: str | Path) -> Path:
    """The folder as a Path, if it exists and is a folder (cheap: nothing is listed); DatasetError otherwise."""
    fix = "pass the folder that holds your images and their .txt captions"
    if not str(folder).strip():
        raise DatasetError(f"the dataset folder is not set (folder={str(folder)!r}): {fix}")
    root = folder_path(folder)
    if not root.exists():
        where = "" if root.is_absolute() else f" (relative to the working directory: {root.absolute()})"
        raise DatasetError(f"dataset folder '{root}' does not exist{where}: {fix}")
    if not root.is_dir():
        raise DatasetError(f"dataset folder '{root}' is a file, not a folder: {fix}")
    return root


def folder_fingerprint(folder: str | Path) -> str:
    """What a dataset folder holds, cheaply: a hash of every file's relative path, size and modification time (no
    file is read), hidden names skipped as the scan skips them. Images, captions or masks added, removed or edited
    change it; an unreadable or missing folder gives its own value (the node's input check reports it)."""
    digest = hashlib.sha256()
    try:
        root = folder_path(str(folder))
        for path in _walk(root):
            relative = path.relative_to(root)
            if not any(part.startswith(".") for part in relative.parts) and path.is_file():
                stat = path.stat()
                digest.update(f"{relative.as_posix()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode(
                    "utf-8", "surrogateescape"))  # a name of bytes that are not UTF-8: those bytes
    except (OSError, DatasetError) as e:
        return f"unreadable: {e}"
    return digest.hexdigest()


def scan_folder(folder: str | Path, *, strict: bool = True, use_repeats: bool = True) -> list[ImageEntry]:
    """Find every image with its caption and repeat count (images are not decoded here); use_repeats=False counts
    every image once: 'N_name' folder names are not read as repeat counts (nor refused: '0_misc', '20240615_beach')."""
    root = check_dataset_folder(folder)
    images, unsupported = _list_images(root)
    if not images:
        found = (f" (found {len(unsupported)} file(s) in unsupported formats, e.g. '{unsupported[0]}': "
                 f"convert them to PNG or JPEG)") if unsupported else ""
        raise DatasetError(f"dataset folder '{root}' has no images{found}: put {', '.join(IMAGE_EXTENSIONS)} images "
                           f"(or {', '.join(VIDEO_EXTENSIONS)} clips for a video model), each with a same-name .txt "
                           "caption, in it or in N_name subfolders")

    entries, problems, listings = [], [], {}
    for path in images:
        try:
            if not path.exists():
                raise DatasetError(f"image '{path}' is a link to '{os.readlink(path)}', which does not exist: fix or "
                                   f"remove the link")
            repeats = _repeats_for(path.parent, root) if use_repeats else 1
            entries.append(ImageEntry(path, read_caption(path, listings), repeats))
        except DatasetError as e:
            skip_or_raise(e, strict)
            problems.append(e)
    if not entries:
        raise no_usable_images(root, len(images), problems)
    if use_repeats:
        warn_many_repeats(entries, root)
    warn_shared_captions(entries)
    return entries


def no_usable_images(root: Path, n_images: int, problems: list[DatasetError]) -> DatasetError:
    return DatasetError(f"dataset folder '{root}' has no usable images: all {n_images} were skipped; first problem: "
                        f"{problems[0]}")


def _open(path: Path, data: bytes | None, max_pixels: int) -> Image.Image:
    """Open lazily (header only) with our own decompression-bomb guard in place of PIL's warning."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data) if data is not None else path)
    except Image.DecompressionBombError:
        raise _too_big(path, "too many", max_pixels) from None
    except (OSError, SyntaxError, ValueError) as e:  # UnidentifiedImageError is an OSError
        raise _unreadable(path, e) from None
    check_pixels(path, image.size, max_pixels)
    return image


def check_pixels(path: Path, size: tuple[int, int], max_pixels: int) -> None:
    """The decompression-bomb guard on a known size (a header read now, or remembered: image_hashes.py)."""
    width, height = size
    if width * height > max_pixels:
        raise _too_big(path, f"{width}x{height} = {width * height}", max_pixels)


def _too_big(path: Path, pixels: str, max_pixels: int) -> DatasetError:
    return DatasetError(f"image '{path}' has {pixels} pixels, over the limit of {max_pixels} that guards "
                        f"against decompression bombs: downscale it to at most {max_pixels} pixels (training "
                        f"resizes it to the resolution anyway), or remove it from the folder")


def _unreadable(path: Path, error: Exception) -> DatasetError:
    return DatasetError(f"cannot read image '{path}' ({error}): re-export it as PNG or JPEG, or delete it "
                        f"(strict=False skips such images)")


def read_image_size(path: Path, *, data: bytes | None = None,
                    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> tuple[int, int]:
    """(width, height) as the image will be trained, i.e. after EXIF rotation, from the header alone."""
    return read_image_header(path, data=data, max_pixels=max_pixels)[0]


def read_image_header(path: Path, *, data: bytes | None = None,
                      max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> tuple[tuple[int, int], bool]:
    """(read_image_size's (width, height), whether the file holds several frames)."""
    return read_header(path, data=data, max_pixels=max_pixels)[:2]


class ImageHeader(NamedTuple):
    """What a load needs of an image before decoding it: its (width, height) as trained (after EXIF rotation),
    whether it holds several frames (a camera's MPO JPEG, a preview or depth image after the photo, does not count:
    its first frame is the photo) and whether it has an alpha channel. Remembered per file by image_hashes.py."""
    size: tuple[int, int]
    frames: bool
    alpha: bool


def read_header(path: Path, *, data: bytes | None = None, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> ImageHeader:
    """The image's ImageHeader, from its header alone (one open of the file, or `data`, its bytes)."""
    with _open(path, data, max_pixels) as image:
        (width, height), alpha = image.size, _has_alpha(image)
        try:
            orientation = header_exif(image).get(_EXIF_ORIENTATION, 1)
        except Exception:  # a broken EXIF block: load_image will ignore it too
            orientation = 1
        try:
            frames = image.format != "MPO" and bool(getattr(image, "is_animated", False))
        except (OSError, SyntaxError, ValueError, EOFError):  # a damaged later frame: the first is all we decode
            frames = False
    return ImageHeader((height, width) if orientation in (5, 6, 7, 8) else (width, height), frames, alpha)


def to_rgb(image: Image.Image) -> Image.Image:
    """Any Pillow mode -> 8-bit RGB; transparency is composited onto white."""
    mode = image.mode
    if mode in ("I;16", "I;16L", "I;16B", "I;16N", "I"):
        # 16-bit greyscale: scale 0..65535 to 0..255 (Pillow's own conversion clips instead).
        return image.convert("I").point(lambda v: v / 257).convert("L").convert("RGB")
    if mode == "F":
        return image.point(lambda v: v * 255).convert("L").convert("RGB")  # assumes 0..1 floats
    if _has_alpha(image):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image if mode == "RGB" else image.convert("RGB")  # covers L, 1, P, CMYK, YCbCr, LAB, HSV


def _has_alpha(image: Image.Image) -> bool:
    return image.mode in ("RGBA", "RGBa", "LA", "La", "PA") or (image.mode == "P" and "transparency" in image.info)


def load_oriented(path: Path, *, data: bytes | None = None,
                  max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> Image.Image:
    """Decode fully and apply EXIF orientation, keeping the image's own mode (a mask's alpha or grey levels)."""
    image = _open(path, data, max_pixels)
    try:
        image.load()  # decodes now, so a truncated or corrupt file fails here, not mid-training
        try:
            return ImageOps.exif_transpose(image)
        except Exception:  # a broken EXIF block is not worth losing the image over
            return image
    except (OSError, SyntaxError, ValueError) as e:
        raise _unreadable(path, e) from None


def load_image(path: Path, *, data: bytes | None = None, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> Image.Image:
    """Decode fully, apply EXIF orientation, and convert to RGB. `data` (the file's bytes) avoids a re-read."""
    image = load_oriented(path, data=data, max_pixels=max_pixels)
    try:
        return to_rgb(image)
    except (OSError, SyntaxError, ValueError) as e:
        raise _unreadable(path, e) from None


def image_to_tensor(image) -> torch.Tensor:
    """8-bit RGB PIL image -> (3, H, W) float32 in [-1, 1]."""
    w, h = image.size
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(h, w, 3)
    return pixels.permute(2, 0, 1).float().div(127.5).sub(1.0)

"""A reload of an unchanged folder opens no image or mask file (training/data/image_hashes.py remembers each file's
header with its sha256), a changed file is read again, and the index keeps only what can still be used: entries of
deleted files and folders leave it, at most MAX_ENTRIES stay, and two loads writing it at once keep each other's."""
import json
import os
import time
import warnings
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors import safe_open

from file_opens import count_opens
from tightrope.demo.encoders import DemoCaptionEmbedder, DemoLatentCodec
from tightrope.training.data import image_hashes
from tightrope.training.data.dataset import TrainingDataset
from tightrope.training.data.image_folder import DatasetError
from tightrope.training.data.image_hashes import INDEX_NAME, ImageHashes
from tightrope.training.state.atomic_write import atomic_save_file

HOUR_AGO = time.time() - 3600


def _age(*paths: Path) -> None:
    for path in paths:
        os.utime(path, (HOUR_AGO, HOUR_AGO))


def _folder(root: Path, n=4, side=32, mode="RGB", masks=False) -> Path:
    """n images (with captions, and name.mask.png masks if asked), last modified an hour ago (not racy)."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        Image.new(mode, (side, side), (40 * i, 90, 200 - 30 * i, 128)[:len(mode)]).save(root / f"{i}.png")
        (root / f"{i}.txt").write_text(f"image {i}", encoding="utf-8")
        if masks:
            Image.new("L", (side, side), 255 - 20 * i).save(root / f"{i}.mask.png")
    _age(*root.iterdir())
    return root


def _load(folder: Path, cache: Path, mask="none", side=32, **kw) -> TrainingDataset:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TrainingDataset(folder, DemoLatentCodec(), DemoCaptionEmbedder(), max_pixels=side * side,
                               cache_dir=cache, mask=mask, **kw)


def _opened(opened: list[str], folder: Path) -> list[str]:
    """The image and mask files of `folder` opened (captions are read at every load: they are the captions)."""
    return sorted(Path(p).name for p in opened if p.startswith(str(folder)) and p.endswith(".png"))


def _entries(cache: Path) -> dict:
    with safe_open(str(cache / INDEX_NAME), framework="pt") as f:
        return json.loads(f.metadata()["entries"])


@pytest.mark.parametrize("mask", ["none", "mask_files", "alpha"])
def test_a_reload_of_an_unchanged_folder_opens_no_image_or_mask_file(tmp_path, mask):
    folder = _folder(tmp_path / "data", mode="RGBA" if mask == "alpha" else "RGB", masks=mask == "mask_files")
    first = _load(folder, tmp_path / "cache", mask)
    written = (tmp_path / "cache" / INDEX_NAME).stat().st_mtime_ns
    with count_opens() as opened:
        second = _load(folder, tmp_path / "cache", mask)
    assert _opened(opened, folder) == []
    assert (second.hashed_images, second.image_cache_hits) == (0, 4)
    assert second.content_digest() == first.content_digest()  # the same latents and masks, by the same keys
    assert (tmp_path / "cache" / INDEX_NAME).stat().st_mtime_ns == written  # nothing new: not rewritten


def test_an_image_replaced_by_one_of_another_size_is_read_again_and_bucketed_by_its_new_size(tmp_path):
    folder = _folder(tmp_path / "data")
    _load(folder, tmp_path / "cache")
    Image.new("RGB", (64, 16), (1, 2, 3)).save(folder / "2.png")  # another shape: another bucket
    _age(folder / "2.png")  # its mtime an hour ago as before: the inode and change time tell
    with count_opens() as opened:
        again = _load(folder, tmp_path / "cache")
    assert _opened(opened, folder) == ["2.png", "2.png"] and again.hashed_images == 1  # its header, then whole
    assert again.latent_shape(2)[1:] == (8, 32) and again.latent_shape(1)[1:] == (16, 16)  # demo codec: 2x down


def test_a_remembered_size_is_still_checked_against_max_image_pixels(tmp_path):
    folder = _folder(tmp_path / "data")
    _load(folder, tmp_path / "cache")
    with count_opens() as opened, pytest.raises(DatasetError, match="decompression bombs"):
        _load(folder, tmp_path / "cache", max_image_pixels=500)  # 32x32 = 1024 pixels
    assert _opened(opened, folder) == []


def test_an_edited_mask_is_read_and_hashed_again_alone(tmp_path):
    folder = _folder(tmp_path / "data", masks=True)
    first = _load(folder, tmp_path / "cache", "mask_files")
    half = Image.new("L", (32, 32), 0)
    half.paste(255, (0, 0, 16, 32))
    half.save(folder / "1.mask.png")
    _age(folder / "1.mask.png")
    with count_opens() as opened:
        again = _load(folder, tmp_path / "cache", "mask_files")
    # the mask hashed, its image read to encode it again (its latent is cached with its mask), the mask decoded
    assert _opened(opened, folder) == ["1.mask.png", "1.mask.png", "1.png"]
    assert (again.hashed_masks, again.hashed_images, again.encoded_images) == (1, 1, 1)
    assert torch.equal(again.mask(0), first.mask(0)) and not torch.equal(again.mask(1), first.mask(1))


def _rewrite(cache: Path, entries: dict, **meta) -> None:
    index = cache / INDEX_NAME
    with safe_open(str(index), framework="pt") as f:
        metadata = f.metadata()
    atomic_save_file({}, index, metadata | {"entries": json.dumps(entries)} | meta)


@pytest.mark.parametrize("old", ["first format", "other Pillow"])
def test_an_index_without_headers_reads_each_header_once_and_hashes_nothing(tmp_path, old):
    """An index of the first format (digests only) or of another Pillow (its headers not trusted): the digests stay
    trusted, each header is read once from its file and recorded; the next load opens nothing."""
    folder = _folder(tmp_path / "data")
    _load(folder, tmp_path / "cache")
    if old == "first format":
        _rewrite(tmp_path / "cache", {k: v[:7] for k, v in _entries(tmp_path / "cache").items()},
                 format="tightrope.image_hashes.1")
    else:
        _rewrite(tmp_path / "cache", _entries(tmp_path / "cache"), headers="1 Pillow 0.0")
    with count_opens() as opened:
        again = _load(folder, tmp_path / "cache")
    assert _opened(opened, folder) == ["0.png", "1.png", "2.png", "3.png"]  # a header read each, nothing hashed
    assert again.hashed_images == 0
    with count_opens() as opened:
        assert _load(folder, tmp_path / "cache").hashed_images == 0
    assert _opened(opened, folder) == [] and again.headers_read == 4


def test_mask_entries_stay_while_the_folder_is_loaded_without_masks(tmp_path):
    folder = _folder(tmp_path / "data", masks=True)
    _load(folder, tmp_path / "cache", "mask_files")
    _load(folder, tmp_path / "cache", "none")
    with count_opens() as opened:
        _load(folder, tmp_path / "cache", "mask_files")
    assert _opened(opened, folder) == []


def test_entries_of_a_deleted_folder_leave_the_index_at_its_next_write_a_week_after_their_hashing(tmp_path):
    """Entries of a folder gone for good leave; a week's grace, as the folder may only be gone here (a cache shared
    by machines that mount it elsewhere). Those of a folder that exists but is not loaded stay."""
    a, b, c, d = (_folder(tmp_path / name, n=2) for name in "abcd")
    for folder in (a, b, c, d):
        _load(folder, tmp_path / "cache")
    entries = _entries(tmp_path / "cache")
    for k, v in entries.items():
        if Path(k).parent.name in "bc":
            v[5] -= 8 * 86400 * 10**9  # hashed 8 days ago
    _rewrite(tmp_path / "cache", entries)
    for gone in (b, d):
        for path in gone.iterdir():
            path.unlink()
        gone.rmdir()
    (a / "1.png").unlink()
    (a / "1.txt").unlink()
    _load(a, tmp_path / "cache")
    assert sorted(Path(k).relative_to(tmp_path).as_posix() for k in _entries(tmp_path / "cache")) == \
        ["a/0.png", "c/0.png", "c/1.png", "d/0.png", "d/1.png"]  # c exists; d's were hashed less than a week ago


def test_the_index_keeps_at_most_max_entries_the_loaded_folder_first(tmp_path, monkeypatch):
    monkeypatch.setattr(image_hashes, "MAX_ENTRIES", 5, raising=False)
    old, new = _folder(tmp_path / "old", n=3), _folder(tmp_path / "new", n=3)
    _load(old, tmp_path / "cache")
    _load(new, tmp_path / "cache")
    names = sorted(Path(k).relative_to(tmp_path).as_posix() for k in _entries(tmp_path / "cache"))
    assert len(names) == 5 and {"new/0.png", "new/1.png", "new/2.png"} <= set(names)


def test_two_loads_writing_the_index_at_once_keep_each_others_entries(tmp_path):
    """Two processes (two runs, or ComfyUI and a headless run) load two folders into one cache at once: each read the
    index before the other wrote it; the one writing last keeps the other's entries."""
    a, b = _folder(tmp_path / "a", n=2), _folder(tmp_path / "b", n=2)
    first, second = ImageHashes(tmp_path / "cache"), ImageHashes(tmp_path / "cache")
    for hashes, folder in ((first, a), (second, b)):
        for image in sorted(folder.glob("*.png")):
            hashes.digest(image)
    first.save(a)
    second.save(b)
    assert sorted(Path(k).relative_to(tmp_path).as_posix() for k in _entries(tmp_path / "cache")) == \
        ["a/0.png", "a/1.png", "b/0.png", "b/1.png"]
    again = ImageHashes(tmp_path / "cache")
    with count_opens() as opened:
        for image in sorted(a.glob("*.png")) + sorted(b.glob("*.png")):
            again.digest(image)
    assert _opened(opened, tmp_path) == [] and (again.trusted, again.hashed) == (4, 0)


def test_a_reload_from_remembered_headers_rotates_and_warns_as_a_read_one(tmp_path):
    """What the header gives besides the size comes from the index too: EXIF rotation (a JPEG turned upright), several
    frames (an animated PNG) and the upscale factor, each warned about at every load, none of them opened again."""
    folder = tmp_path / "data"
    folder.mkdir()
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees: a 64x16 file trains as 16x64
    Image.new("RGB", (64, 16), (200, 10, 10)).save(folder / "rotated.jpg", exif=exif)
    frames = [Image.new("RGB", (32, 32), c) for c in ((255, 0, 0), (0, 255, 0))]
    frames[0].save(folder / "animated.png", save_all=True, append_images=frames[1:])
    Image.new("RGB", (8, 8), (9, 9, 9)).save(folder / "small.png")
    for name in ("rotated", "animated", "small"):
        (folder / f"{name}.txt").write_text(name, encoding="utf-8")
    _age(*folder.iterdir())
    said = []
    for load in range(2):
        with count_opens() as opened, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dataset = TrainingDataset(folder, DemoLatentCodec(), DemoCaptionEmbedder(), max_pixels=32 * 32,
                                      cache_dir=tmp_path / "cache")
        said.append(sorted(str(w.message).split(":")[0] for w in caught if issubclass(w.category, UserWarning)))
        shapes = {dataset.caption(i): dataset.latent_shape(i)[1:] for i in range(dataset.num_images)}
        assert shapes["rotated"][0] > shapes["rotated"][1]  # upright: taller than wide
    assert said[0] == said[1] == ["1 image(s) are animated and train on their first frame only",
                                  "1 image(s) are smaller than the training resolution and are upscaled more than 2x, "
                                  "which trains blur"]
    assert [p for p in opened if p.startswith(str(folder)) and not p.endswith(".txt")] == []

"""The index of the images' sha256 in the dataset cache (training/data/image_hashes.py): a second load of an unchanged
folder reads no image whole, and an image changed in any way git's index would see is read, hashed and encoded again
(never an old latent for a new image)."""
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from PIL import Image

from tightrope.demo.encoders import DemoCaptionEmbedder, DemoLatentCodec
from tightrope.training.data import image_hashes
from tightrope.training.data.dataset import TrainingDataset, image_to_tensor
from tightrope.training.data.image_hashes import INDEX_NAME, ImageHashes, file_key
from tightrope.training.state.atomic_write import FileWriteError

HOUR_AGO = time.time() - 3600


def _folder(root, n=4, side=32, suffix=".png", age=True):
    """n images of one size in distinct colours, each with a caption; age: last modified an hour ago (not racy).
    Uncompressed: an image of the same size is a file of the same size."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        Image.new("RGB", (side, side), (50 * i, 90, 200 - 40 * i)).save(root / f"{i}{suffix}", compress_level=0)
        (root / f"{i}.txt").write_text(f"image {i}", encoding="utf-8")
    if age:
        for path in root.iterdir():
            os.utime(path, (HOUR_AGO, HOUR_AGO))
    return root


def _load(folder, cache, side=32):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dataset = TrainingDataset(folder, DemoLatentCodec(), DemoCaptionEmbedder(), max_pixels=side * side,
                                  cache_dir=cache)
    return dataset, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


def _count_image_reads(monkeypatch) -> list:
    reads, read_bytes = [], Path.read_bytes

    def counting(self):
        if self.suffix in (".png", ".bmp"):
            reads.append(self.name)
        return read_bytes(self)
    monkeypatch.setattr(Path, "read_bytes", counting)
    return reads


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


def _edit_in_place(path: Path, colour) -> None:
    """Another image of the same byte size written into the same file (same inode), its mtime set back."""
    before = os.stat(path)
    Image.new("RGB", Image.open(path).size, colour).save(path.with_name("new" + path.suffix), compress_level=0)
    data = path.with_name("new" + path.suffix).read_bytes()
    path.with_name("new" + path.suffix).unlink()
    assert len(data) == before.st_size
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino)


def test_a_second_load_of_an_unchanged_folder_reads_no_image_whole(tmp_path, monkeypatch):
    from png_decodes import count_png_decodes
    folder = _folder(tmp_path / "data", n=6, side=256)
    first, _ = _load(folder, tmp_path / "cache")
    assert (first.hashed_images, first.encoded_images) == (6, 6) and (tmp_path / "cache" / INDEX_NAME).is_file()
    reads, decodes = _count_image_reads(monkeypatch), count_png_decodes(monkeypatch)
    index_written = (tmp_path / "cache" / INDEX_NAME).stat().st_mtime_ns
    image_bytes = sum(p.stat().st_size for p in folder.glob("*.png"))
    read_before = _rchar() if os.path.exists("/proc/self/io") else None
    second, _ = _load(folder, tmp_path / "cache")
    if read_before is not None:  # only the headers (and the cache's): far less than the images
        assert _rchar() - read_before < image_bytes / 4, (_rchar() - read_before, image_bytes)
    assert (second.hashed_images, second.encoded_images, second.image_cache_hits) == (0, 0, 6)
    assert reads == [] and decodes == []
    assert second.content_digest() == first.content_digest()
    assert (tmp_path / "cache" / INDEX_NAME).stat().st_mtime_ns == index_written  # nothing new: not rewritten


@pytest.mark.parametrize("suffix", [".png", ".bmp"])
def test_an_image_edited_in_place_with_its_size_and_mtime_kept_is_hashed_and_encoded_again(tmp_path, suffix):
    """Its change time (and for a save that replaces the file, its inode) tells: git's index sees it the same way."""
    folder = _folder(tmp_path / "data", suffix=suffix)
    first, _ = _load(folder, tmp_path / "cache")
    _edit_in_place(folder / f"2{suffix}", (255, 255, 255))
    second, _ = _load(folder, tmp_path / "cache")
    assert (second.hashed_images, second.encoded_images, second.image_cache_hits) == (1, 1, 3)
    assert not torch.equal(first.latent(2), second.latent(2))
    with Image.open(folder / f"2{suffix}") as image:  # the new image's latent
        assert torch.equal(second.latent(2), DemoLatentCodec().encode(image_to_tensor(image.convert("RGB"))[None])[0])
    assert all(torch.equal(first.latent(i), second.latent(i)) for i in (0, 1, 3))


def test_an_image_written_again_within_the_timestamp_granularity_of_its_hashing_is_hashed_again(tmp_path,
                                                                                                 monkeypatch):
    """Git's racily clean case: on a file system with coarse timestamps an image saved twice within one tick keeps
    every stat field (faked here: ext4's ns times would show the change), so an entry hashed within that tick of the
    file's last modification is not trusted. The same stat an hour old is trusted (the control)."""
    folder = _folder(tmp_path / "data", age=False)  # just written: racy at the first load
    first, _ = _load(folder, tmp_path / "cache")
    target, real_key = folder / "1.png", file_key
    recorded = file_key(target)
    _edit_in_place(target, (0, 0, 0))
    monkeypatch.setattr(image_hashes, "file_key", lambda p: recorded if Path(p) == target else real_key(p))
    second, _ = _load(folder, tmp_path / "cache")
    assert second.encoded_images == 1 and not torch.equal(first.latent(1), second.latent(1))
    assert second.hashed_images == 4  # all were racy; now recorded as hashed long after their last change

    aged = _folder(tmp_path / "aged")  # control: the same faked stat of an old file is trusted, as git trusts it
    _load(aged, tmp_path / "cache")
    recorded = file_key(aged / "1.png")
    monkeypatch.setattr(image_hashes, "file_key", lambda p: recorded if Path(p) == aged / "1.png" else real_key(p))
    assert _load(aged, tmp_path / "cache")[0].hashed_images == 0


def _latent_of(path: Path, side: int) -> torch.Tensor:
    with Image.open(path) as image:
        pixels = image_to_tensor(image.convert("RGB").resize((side, side), Image.LANCZOS))
    return DemoLatentCodec().encode(pixels[None])[0]


def test_an_index_wrong_about_a_file_never_files_a_latent_under_another_images_hash(tmp_path, monkeypatch):
    """Where the index vouches for a hash a file no longer has (an edit no stat field shows: Windows keeps the
    creation time it reports as st_ctime), a latent to be encoded is encoded from the bytes read then, under their own
    hash: the old image's key never gets the new image's latent."""
    folder = _folder(tmp_path / "data")
    (tmp_path / "original.png").write_bytes((folder / "1.png").read_bytes())
    _load(folder, tmp_path / "cache")
    recorded, real_key = file_key(folder / "1.png"), file_key
    _edit_in_place(folder / "1.png", (0, 0, 0))
    monkeypatch.setattr(image_hashes, "file_key", lambda p: recorded if Path(p) == folder / "1.png" else real_key(p))
    assert _load(folder, tmp_path / "cache")[0].hashed_images == 0  # the limit: nothing tells
    other_size, _ = _load(folder, tmp_path / "cache", side=16)  # another bucket: every latent is encoded
    assert other_size.hashed_images == 4 and torch.equal(other_size.latent(1), _latent_of(folder / "1.png", 16))
    original = _folder(tmp_path / "again", n=0)
    (tmp_path / "original.png").rename(original / "1.png")
    (original / "1.txt").write_text("image 1", encoding="utf-8")
    again, _ = _load(original, tmp_path / "cache", side=16)
    assert again.image_cache_hits == 0 and torch.equal(again.latent(0), _latent_of(original / "1.png", 16))


def test_a_file_that_changes_while_it_is_hashed_is_not_recorded(tmp_path, monkeypatch):
    folder = _folder(tmp_path / "data")
    calls, real_key = [], file_key

    def changing(path):
        calls.append(path)
        key = real_key(path)
        return key if Path(path).name != "0.png" or len(calls) % 2 else [key[0] + 1, *key[1:]]
    monkeypatch.setattr(image_hashes, "file_key", changing)
    _load(folder, tmp_path / "cache")
    monkeypatch.setattr(image_hashes, "file_key", real_key)
    assert _load(folder, tmp_path / "cache")[0].hashed_images == 1


def test_copies_are_still_named_from_the_indexed_hashes(tmp_path, monkeypatch):
    folder = _folder(tmp_path / "data")
    (folder / "copy.png").write_bytes((folder / "0.png").read_bytes())
    (folder / "copy.txt").write_text("a copy", encoding="utf-8")
    os.utime(folder / "copy.png", (HOUR_AGO, HOUR_AGO))
    _load(folder, tmp_path / "cache")
    reads = _count_image_reads(monkeypatch)
    dataset, said = _load(folder, tmp_path / "cache")
    assert reads == [] and dataset.hashed_images == 0
    assert len([m for m in said if "saved more than once" in m and "copy.png" in m]) == 1, said


def test_a_damaged_or_foreign_index_hashes_everything_and_is_rewritten(tmp_path):
    folder = _folder(tmp_path / "data")
    first, _ = _load(folder, tmp_path / "cache")
    index = tmp_path / "cache" / INDEX_NAME
    for damage in (b"garbage", index.read_bytes().replace(b"tightrope.image_hashes", b"somebody_else.image_hash")):
        index.write_bytes(damage)
        again, _ = _load(folder, tmp_path / "cache")
        assert (again.hashed_images, again.encoded_images) == (4, 0)
        assert again.content_digest() == first.content_digest()
        assert _load(folder, tmp_path / "cache")[0].hashed_images == 0  # written again


def test_entries_with_a_field_missing_or_of_another_device_are_not_trusted(tmp_path):
    import json
    from safetensors import safe_open
    from tightrope.training.state.atomic_write import atomic_save_file
    folder = _folder(tmp_path / "data")
    _load(folder, tmp_path / "cache")
    index = tmp_path / "cache" / INDEX_NAME
    with safe_open(str(index), framework="pt") as f:
        meta = f.metadata()
    entries = json.loads(meta["entries"])
    entries[str(folder / "0.png")].pop(2)  # its ctime gone
    entries[str(folder / "1.png")][4] += 1  # another device (a copy of the index from elsewhere)
    entries[str(folder / "2.png")][6] = "not a digest"
    atomic_save_file({}, index, meta | {"entries": json.dumps(entries)})
    assert _load(folder, tmp_path / "cache")[0].hashed_images == 3


def test_a_read_only_cache_folder_loads_without_an_index(tmp_path, monkeypatch):
    folder = _folder(tmp_path / "data")
    first, _ = _load(folder, tmp_path / "cache")
    (tmp_path / "cache" / INDEX_NAME).unlink()

    def refused(tensors, path, metadata=None, **kw):
        raise FileWriteError(Path(path), 30, "Read-only file system")
    monkeypatch.setattr(image_hashes, "atomic_save_file", refused)
    for _ in range(2):
        again, said = _load(folder, tmp_path / "cache")
        assert (again.hashed_images, again.image_cache_hits) == (4, 4) and not said
        assert again.content_digest() == first.content_digest()
    assert not (tmp_path / "cache" / INDEX_NAME).exists()


def test_folders_sharing_a_cache_keep_their_entries_and_deleted_images_leave_it(tmp_path):
    a, b = _folder(tmp_path / "a"), _folder(tmp_path / "b", n=2)
    _load(a, tmp_path / "cache")
    _load(b, tmp_path / "cache")
    (a / "3.png").unlink()
    (a / "3.txt").unlink()
    assert _load(a, tmp_path / "cache")[0].hashed_images == 0
    known = ImageHashes(tmp_path / "cache")._known
    assert str(a / "3.png") not in known and {str(b / "0.png"), str(b / "1.png"), str(a / "0.png")} <= set(known)
    assert _load(b, tmp_path / "cache")[0].hashed_images == 0


def test_two_processes_loading_at_once_share_the_index(tmp_path):
    """torchrun ranks load one folder into one cache at once: each writes the index atomically, the last one wins."""
    folder = _folder(tmp_path / "data", n=8)
    script = ("import sys, warnings; warnings.simplefilter('ignore')\n"
              "from tightrope.demo.encoders import DemoCaptionEmbedder, DemoLatentCodec\n"
              "from tightrope.training.data.dataset import TrainingDataset\n"
              "TrainingDataset(sys.argv[1], DemoLatentCodec(), DemoCaptionEmbedder(), max_pixels=1024, "
              "cache_dir=sys.argv[2])\n")
    import tightrope  # the children import the package these tests import
    env = os.environ | {"PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(tightrope.__file__)),
                                                       os.environ.get("PYTHONPATH", "")])}
    ranks = [subprocess.Popen([sys.executable, "-c", script, str(folder), str(tmp_path / "cache")], env=env)
             for _ in range(2)]
    assert [rank.wait(timeout=120) for rank in ranks] == [0, 0]
    again, _ = _load(folder, tmp_path / "cache")
    assert (again.hashed_images, again.encoded_images) == (0, 0)
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.endswith(".tmp")]

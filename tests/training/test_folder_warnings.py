"""The dataset folder's warnings (training/data/folder_warnings.py) that need the images' bytes: byte-identical copies
of an image, found from the hashes the latent cache keys need."""
import re
import shutil
import warnings
from pathlib import Path

from PIL import Image

from tightrope.demo.encoders import DemoCaptionEmbedder, DemoLatentCodec
from tightrope.training.data.dataset import TrainingDataset

SAVED_TWICE = "saved more than once"


def _image(path, colour, caption):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (32, 32), colour).save(path)
    path.with_suffix(".txt").write_text(caption, encoding="utf-8")
    return path


def _load(folder, cache_dir=None, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dataset = TrainingDataset(folder, DemoLatentCodec(), DemoCaptionEmbedder(), max_pixels=32 * 32,
                                  cache_dir=cache_dir, **kw)
    return dataset, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


def test_byte_identical_images_are_named_once_with_their_repeats_and_the_fix(tmp_path):
    root = tmp_path / "data"
    original = _image(root / "cat.png", (200, 10, 10), "a cat")
    (root / "scraped").mkdir()
    shutil.copyfile(original, root / "scraped" / "cat (1).png")
    (root / "scraped" / "cat (1).txt").write_text("a cat on a sofa", encoding="utf-8")  # a caption of its own
    kohya = _image(root / "3_dog" / "dog.png", (10, 200, 10), "a dog")
    (root / "5_dog").mkdir()
    shutil.copyfile(kohya, root / "5_dog" / "dog.png")
    shutil.copyfile(kohya.with_suffix(".txt"), root / "5_dog" / "dog.txt")
    _image(root / "bird.png", (10, 10, 200), "a bird")  # no copy
    dataset, said = _load(root)
    assert dataset.num_images == 5 and len(dataset) == 1 + 1 + 3 + 5 + 1  # every copy still trains
    named = [m for m in said if SAVED_TWICE in m]
    assert len(named) == 1, said
    assert named[0] == (
        f"2 image(s) are saved more than once (byte-identical files), and each copy trains, so that image weighs as "
        f"much as its copies together: '{root / '3_dog' / 'dog.png'}' (3x) = '{root / '5_dog' / 'dog.png'}' (5x): 8x "
        f"an epoch, '{root / 'cat.png'}' = '{root / 'scraped' / 'cat (1).png'}': delete the copies you did not mean "
        "to train (to train an image more often, raise its 'N_name' folder's repeat count instead)")
    assert "bird" not in named[0]

    _, said = _load(root, use_repeats=False)  # repeats not read: none shown
    (named,) = [m for m in said if SAVED_TWICE in m]
    assert "(3x)" not in named and "8x an epoch" not in named and f"'{root / 'cat.png'}'" in named


def test_identical_masks_and_distinct_images_are_not_named(tmp_path):
    """Masks are not images: two all-white masks (the same bytes) of two different images say nothing."""
    root = tmp_path / "data"
    for name, colour in (("a", (200, 0, 0)), ("b", (0, 200, 0))):
        _image(root / f"{name}.png", colour, f"image {name}")
        Image.new("L", (32, 32), 255).save(root / f"{name}.mask.png")
    assert (root / "a.mask.png").read_bytes() == (root / "b.mask.png").read_bytes()
    dataset, said = _load(root, mask="mask_files")
    assert dataset.num_images == 2 and not [m for m in said if SAVED_TWICE in m], said


def test_a_skipped_copy_is_not_named(tmp_path):
    """With strict=False an image that cannot be read is skipped: it does not train, so it is no copy."""
    root = tmp_path / "data"
    _image(root / "a.png", (200, 0, 0), "image a")
    _image(root / "b.png", (0, 200, 0), "image b")
    (root / "broken.png").write_bytes(b"not a png")
    (root / "broken.txt").write_text("broken", encoding="utf-8")
    shutil.copyfile(root / "broken.png", root / "broken2.png")
    shutil.copyfile(root / "broken.txt", root / "broken2.txt")
    dataset, said = _load(root, strict=False)
    assert dataset.num_images == 2 and not [m for m in said if SAVED_TWICE in m], said


def test_finding_copies_reads_no_image_more_than_the_encoding_does(tmp_path, monkeypatch):
    """The check hashes nothing of its own: each image's bytes are read once a load (the latent cache key is their
    sha256), with copies or without, on a first load and on one whose latents are all cached (these images were
    just written, so the hash index does not vouch for them yet: test_image_hashes.py has a load that reads none);
    the header reads (upscale, animation and bucket checks) read no whole file."""
    root = tmp_path / "data"
    for i in range(6):
        _image(root / f"{i}.png", (40 * i, 0, 0), f"image {i}")
    shutil.copyfile(root / "0.png", root / "copy.png")
    shutil.copyfile(root / "0.txt", root / "copy.txt")
    reads, read_bytes = [], Path.read_bytes

    def counting(self):
        if self.suffix == ".png":
            reads.append(self.name)
        return read_bytes(self)
    monkeypatch.setattr(Path, "read_bytes", counting)
    for load in ("first", "cached"):
        reads.clear()
        dataset, said = _load(root, tmp_path / "cache")
        # on the first load the copy is a cache hit of its original's latent
        assert (dataset.encoded_images, dataset.image_cache_hits) == ((6, 1) if load == "first" else (0, 7))
        assert sorted(reads) == sorted(p.name for p in root.glob("*.png")), load
        assert len([m for m in said if SAVED_TWICE in m]) == 1
        assert re.search(r"'[^']*0\.png' = '[^']*copy\.png'", [m for m in said if SAVED_TWICE in m][0])

import torch
from PIL import Image

from tightrope.demo.data import COLOURS, make_demo_dataset


def _contents(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_demo_dataset_is_deterministic_and_captioned(tmp_path):
    a = _contents(make_demo_dataset(tmp_path / "a", n_images=6, size=48, seed=3))
    b = _contents(make_demo_dataset(tmp_path / "b", n_images=6, size=48, seed=3))
    assert a == b
    assert sorted(a) == [f"{i:03d}.{ext}" for i in range(6) for ext in ("png", "txt")]
    assert a != _contents(make_demo_dataset(tmp_path / "c", n_images=6, size=48, seed=4))

    caption = (tmp_path / "a" / "000.txt").read_text(encoding="utf-8").strip()
    words = caption.split()
    assert words[0] in ("a", "an") and words[2] in ("circle", "square", "triangle") and caption.endswith("background")
    with Image.open(tmp_path / "a" / "000.png") as image:
        assert image.size == (48, 48) and image.mode == "RGB"
        assert len(image.getcolors()) >= 2  # a shape on a background, not a blank canvas


def test_demo_masks_cover_each_shape_and_leave_the_images_unchanged(tmp_path):
    plain = _contents(make_demo_dataset(tmp_path / "plain", n_images=6, size=48, seed=3))
    masked = _contents(make_demo_dataset(tmp_path / "a", n_images=6, size=48, seed=3, masks=True))
    assert masked == _contents(make_demo_dataset(tmp_path / "b", n_images=6, size=48, seed=3, masks=True))
    assert sorted(masked) == sorted([*plain, *(f"{i:03d}.mask.png" for i in range(6))])
    assert {k: v for k, v in masked.items() if not k.endswith(".mask.png")} == plain  # same images, same captions
    for i in range(6):
        with Image.open(tmp_path / "a" / f"{i:03d}.png") as image, \
                Image.open(tmp_path / "a" / f"{i:03d}.mask.png") as mask:
            assert mask.size == image.size and mask.mode == "L"
            white, pixels = torch.tensor(list(mask.tobytes())) == 255, torch.tensor(list(image.tobytes())).view(-1, 3)
            # white exactly where the shape is: the pixels of the caption's colour (no anti-aliasing, and the
            # background's colour always differs from the shape's)
            colour = COLOURS[(tmp_path / "a" / f"{i:03d}.txt").read_text().split()[1]]
            assert torch.equal(white, (pixels == torch.tensor(colour)).all(1)) and 0 < white.sum() < white.numel()
            assert set(mask.tobytes()) == {0, 255}


def test_a_smaller_count_or_no_masks_leaves_exactly_what_was_asked(tmp_path):
    """Written again with fewer images (or without masks), the folder held the old images too and Load Dataset
    trained on them (found by a helper in a real server); the user's own files stay."""
    make_demo_dataset(tmp_path, n_images=8, size=32, seed=0, masks=True)
    (tmp_path / "notes.txt").write_text("mine")
    make_demo_dataset(tmp_path, n_images=6, size=32, seed=1)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted([f"{i:03d}{ext}" for i in range(6) for ext in (".png", ".txt")] + ["notes.txt"])

from PIL import Image

from tightrope.demo.data import make_demo_dataset


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

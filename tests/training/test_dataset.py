import re

import pytest
import torch
from PIL import Image

from tightrope.training.data.dataset import TrainingDataset, image_to_tensor
from tightrope.demo.data import make_demo_dataset
from tightrope.demo.encoders import DemoCaptionEmbedder, DemoLatentCodec
from tightrope.training.data.image_folder import DatasetError


class Counting:
    """Wraps an encoder and counts what it is asked to encode, to check the dataset's own counters."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0
        self.cache_id, self.downscale = inner.cache_id, getattr(inner, "downscale", None)

    def encode(self, x):
        self.calls += len(x)
        return self.inner.encode(x)


def _build(folder, cache_dir=None, **kw):
    image_encoder, text_encoder = Counting(DemoLatentCodec()), Counting(DemoCaptionEmbedder())
    kw.setdefault("max_pixels", 64 * 64)
    ds = TrainingDataset(folder, image_encoder, text_encoder, cache_dir=cache_dir, **kw)
    return ds, image_encoder.calls, text_encoder.calls


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return make_demo_dataset(tmp_path_factory.mktemp("demo") / "data", n_images=16, size=64, seed=0)


def _mixed_folder(root):
    """Three aspect ratios (three buckets) and a kohya repeat folder."""
    for i, size in enumerate([(64, 64)] * 3 + [(96, 48)] * 2 + [(48, 96)] * 2):
        sub = root / ("2_twice" if i == 0 else "")
        sub.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", size, (30 * i, 100, 200)).save(sub / f"{i}.png")
        (sub / f"{i}.txt").write_text(f"image number {i}", encoding="utf-8")
    return root


def test_encodes_once_and_second_construction_uses_the_cache(demo, tmp_path):
    first, image_calls, text_calls = _build(demo, tmp_path / "cache")
    assert (first.encoded_images, first.image_cache_hits, image_calls) == (16, 0, 16)
    # no empty caption without caption dropout (an encoder that does not pad gives it a length of its own)
    assert first.encoded_captions == text_calls == len({first.caption(i) for i in range(16)})
    assert len(first) == 16 and first.bucket_counts == {(16, 32, 32): 16}

    second, image_calls, text_calls = _build(demo, tmp_path / "cache")
    assert (second.encoded_images, second.image_cache_hits, image_calls) == (0, 16, 0)
    assert (second.encoded_captions, text_calls) == (0, 0) and second.caption_cache_hits == first.encoded_captions
    for i in range(16):
        assert torch.equal(first.latent(i), second.latent(i))
        assert all(torch.equal(a, b) for a, b in zip(first.text(i), second.text(i)))
    assert not list((tmp_path / "cache").rglob("*.tmp"))  # atomic writes leave no temp files
    assert all(p.suffix == ".safetensors" for p in (tmp_path / "cache").rglob("*") if p.is_file())

    # The latents really are the encoded images: the codec decodes them back to the pixels.
    pixels = DemoLatentCodec().decode(second.latent(0)[None])[0]
    with Image.open(demo / "000.png") as image:
        assert torch.allclose(pixels, image_to_tensor(image.convert("RGB")), atol=1e-5)


def test_each_png_is_decoded_once_when_encoded_and_never_on_a_cache_hit(tmp_path, monkeypatch):
    """Header reads (upscale/animation check, bucket choice) must not decode: Pillow's PNG getexif() would decode each
    image twice more per run, 0.1 s per 4 MP PNG, on a run whose latents are all cached too."""
    from png_decodes import count_png_decodes
    folder = make_demo_dataset(tmp_path / "data", n_images=6, size=32)
    decodes = count_png_decodes(monkeypatch)
    first, _, _ = _build(folder, tmp_path / "cache")
    assert first.encoded_images == 6 and len(decodes) == 6
    decodes.clear()
    second, _, _ = _build(folder, tmp_path / "cache")
    assert second.image_cache_hits == 6 and decodes == []


def test_changed_image_or_encoder_changes_the_key(tmp_path):
    folder = make_demo_dataset(tmp_path / "data", n_images=4, size=32)
    _build(folder, tmp_path / "cache", max_pixels=32 * 32)
    Image.new("RGB", (32, 32), "white").save(folder / "002.png")
    ds, image_calls, _ = _build(folder, tmp_path / "cache", max_pixels=32 * 32)
    assert (ds.encoded_images, ds.image_cache_hits, image_calls) == (1, 3, 1)
    ds = TrainingDataset(folder, DemoLatentCodec(seed=1), DemoCaptionEmbedder(), max_pixels=32 * 32,
                         cache_dir=tmp_path / "cache")
    assert ds.encoded_images == 4  # another encoder, another cache_id
    ds, image_calls, _ = _build(folder, tmp_path / "cache", max_pixels=16 * 16)
    assert image_calls == 4  # another bucket resolution


def test_damaged_cache_entry_is_re_encoded(tmp_path):
    folder = make_demo_dataset(tmp_path / "data", n_images=2, size=32)
    first, _, _ = _build(folder, tmp_path / "cache", max_pixels=32 * 32)
    next((tmp_path / "cache" / "latents").rglob("*.safetensors")).write_bytes(b"garbage")
    ds, image_calls, _ = _build(folder, tmp_path / "cache", max_pixels=32 * 32)
    assert image_calls == 1 and all(torch.equal(first.latent(i), ds.latent(i)) for i in range(2))


def test_without_cache_dir_everything_stays_in_memory(demo):
    ds, image_calls, _ = _build(demo)
    assert image_calls == 16 and ds.latent(3).shape == (16, 32, 32)


def test_repeats_buckets_and_single_bucket_batches(tmp_path):
    ds, _, _ = _build(_mixed_folder(tmp_path / "mixed"), max_pixels=64 * 64, multiple=4)
    assert ds.num_images == 7 and len(ds) == 8  # image 0 twice
    assert ds.bucket_counts == {(16, 22, 44): 2, (16, 32, 32): 4, (16, 44, 22): 2}
    assert len(_build(tmp_path / "mixed", use_repeats=False)[0]) == 7

    steps = ds.steps_per_epoch(3)
    assert steps == 1 + 2 + 1  # ceil(2/3) + ceil(4/3) + ceil(2/3): a bucket's last batch may be short
    seen = []
    for batch in (b for _, b in zip(range(steps), ds.batches(3, seed=0))):
        assert batch["latents"].shape[0] == batch["context"].shape[0] == batch["pooled"].shape[0] == len(
            batch["captions"])
        assert batch["context"].shape[1:] == (16, 64) and batch["pooled"].shape[1:] == (32,)
        seen += batch["captions"]
    assert sorted(seen) == sorted(["image number 0"] * 2 + [f"image number {i}" for i in range(1, 7)])


def _take(iterator, n):
    return [next(iterator) for _ in range(n)]


def _same(a, b):
    return all(x["captions"] == y["captions"] and all(torch.equal(x[k], y[k]) for k in ("latents", "context", "pooled"))
               for x, y in zip(a, b))


def test_batches_are_deterministic_and_resumable(demo):
    ds, _, _ = _build(demo, caption_dropout=0.25)
    run = _take(ds.batches(4, seed=7), 12)  # three epochs of four steps
    assert _same(run, _take(ds.batches(4, seed=7), 12))
    assert not _same(run, _take(ds.batches(4, seed=8), 12))
    assert _same(run[5:], _take(ds.batches(4, seed=7, start_step=5), 7))
    assert [b["captions"] for b in run[:4]] != [b["captions"] for b in run[4:8]]  # reshuffled each epoch


def test_caption_dropout_rate_and_embedding(demo):
    ds, _, _ = _build(demo, caption_dropout=0.3)
    empty_context, empty_pooled = ds.empty_text()
    dropped = total = 0
    for batch in _take(ds.batches(4, seed=0), 150):
        for j, caption in enumerate(batch["captions"]):
            total += 1
            if caption == "":
                dropped += 1
                assert torch.equal(batch["context"][j], empty_context)
                assert torch.equal(batch["pooled"][j], empty_pooled)
            else:
                assert not torch.equal(batch["context"][j], empty_context)
    assert 0.25 < dropped / total < 0.35
    assert all(c for b in _take(_build(demo)[0].batches(4, seed=0), 8) for c in b["captions"])  # rate 0


def test_batch_size_larger_than_dataset(demo):
    ds, _, _ = _build(demo)
    with pytest.raises(DatasetError) as e:
        next(ds.batches(17, seed=0))
    assert "batch_size=17" in str(e.value) and "16 items" in str(e.value) and "at most 16" in str(e.value)


def test_non_strict_skips_a_corrupt_image(tmp_path):
    folder = make_demo_dataset(tmp_path / "data", n_images=3, size=32)
    (folder / "001.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    with pytest.raises(DatasetError, match=re.escape(str(folder / "001.png"))):
        _build(folder, max_pixels=32 * 32)
    with pytest.warns(UserWarning, match=re.escape(str(folder / "001.png"))):
        ds, _, _ = _build(folder, max_pixels=32 * 32, strict=False)
    assert ds.num_images == 2


def test_multiple_must_fit_the_encoder(demo):
    with pytest.raises(ValueError, match="downscale"):
        _build(demo, multiple=3)


def test_from_tensors(tmp_path):
    latents = [torch.randn(1, 16, 8, 8), torch.randn(16, 8, 8), torch.randn(16, 4, 12)]
    contexts = [torch.randn(1, 5, 64), torch.randn(5, 64), torch.randn(5, 64)]
    pooled = [torch.randn(1, 32), torch.randn(32), torch.randn(32)]
    ds = TrainingDataset.from_tensors(latents, contexts, pooled, captions=["a", "b", "c"], repeats=[1, 2, 1])
    assert len(ds) == 4 and ds.bucket_counts == {(16, 4, 12): 1, (16, 8, 8): 3}
    batch = next(b for b in ds.batches(2, seed=0) if b["latents"].shape[-1] == 8)
    assert batch["context"].shape == (2, 5, 64) and batch["pooled"].shape == (2, 32)
    assert torch.equal(ds.latent(0), latents[0][0])

    with pytest.raises(DatasetError, match="empty_context and empty_pooled"):
        TrainingDataset.from_tensors(latents, contexts, pooled, caption_dropout=0.1)
    with pytest.raises(DatasetError, match="3 latents but 2 contexts"):
        TrainingDataset.from_tensors(latents, contexts[:2], pooled)
    # captions of several lengths (one conditioning per image from an encoder that does not pad): batched by length
    ragged = TrainingDataset.from_tensors(latents[:2] * 2, [torch.randn(5, 64), torch.randn(6, 64)] * 2,
                                          pooled + [pooled[0]])
    assert ragged.steps_per_epoch(2) == 2 and ragged.bucket_counts == {(16, 8, 8): 4}
    assert sorted(b["context"].shape[1] for b in _take(ragged.batches(2, seed=0), 2)) == [5, 6]
    with pytest.raises(DatasetError, match="caption embeddings differ in width"):
        TrainingDataset.from_tensors(latents, [torch.randn(5, 64), torch.randn(5, 32), torch.randn(5, 64)], pooled)
    ds = TrainingDataset.from_tensors(latents, contexts, pooled, caption_dropout=1.0,
                                      empty_context=torch.zeros(1, 5, 64), empty_pooled=torch.zeros(1, 32))
    assert all(b["context"].abs().sum() == 0 for b in _take(ds.batches(1, seed=0), 6))


def test_an_interrupt_stops_the_caption_encoding_too(tmp_path):
    """Captions are encoded before any image, one per call with ComfyUI's CLIP (a T5 forward each: 5,000 captions
    on a CPU are hours): an interrupt raised by the progress report stops them after the call in progress, and the
    next load encodes only the captions left."""
    folder = make_demo_dataset(tmp_path / "data", n_images=6, size=32)
    encoder = Counting(DemoCaptionEmbedder())
    encoder.captions_per_call = 1
    reports = []

    def interrupting(done, total):
        reports.append((done, total))
        if len(reports) == 2:
            raise KeyboardInterrupt("interrupted while encoding captions")
    with pytest.raises(KeyboardInterrupt, match="captions"):
        TrainingDataset(folder, DemoLatentCodec(), encoder, max_pixels=64 * 64, cache_dir=tmp_path / "cache",
                        progress=interrupting)
    assert encoder.calls == 2 and reports == [(0, 6), (0, 6)]
    again = TrainingDataset(folder, DemoLatentCodec(), DemoCaptionEmbedder(), max_pixels=64 * 64,
                            cache_dir=tmp_path / "cache")
    n = len({again.caption(i) for i in range(6)})
    assert (again.caption_cache_hits, again.encoded_captions) == (2, n - 2)

def test_encoding_reports_progress_and_an_interrupt_keeps_what_was_encoded(demo, tmp_path):
    """Load Dataset encoded a whole folder with no progress bar and no way to stop it: it reports each image now,
    and an interrupt raised by the report stops the encoding; the next load encodes only what was left."""
    seen = []

    def interrupting(done, total):
        seen.append((done, total))
        if done == 5:
            raise KeyboardInterrupt("interrupted while encoding")
    with pytest.raises(KeyboardInterrupt, match="while encoding"):
        _build(demo, tmp_path / "cache", progress=interrupting)
    # (0, 16) after the captions' encoder call, then the report after each image, then the stop
    assert seen == [(0, 16)] + [(k, 16) for k in range(1, 6)]
    seen.clear()
    resumed, image_calls, _ = _build(demo, tmp_path / "cache", progress=lambda d, t: seen.append((d, t)))
    assert (resumed.image_cache_hits, image_calls) == (5, 11) and seen == [(k, 16) for k in range(1, 17)]


def test_many_buckets_in_few_images_are_said_to_thin_the_batches(tmp_path):
    """A batch holds one bucket's images: 8 images of 7 bucket shapes with batch_size 4 train 7 batches an epoch, not
    2 of 4, which nothing said (found by a helper: 50 free crops at 1024 made 39 buckets, batches of 1.3)."""
    folder = tmp_path / "ratios"
    folder.mkdir()
    for i in range(8):
        Image.new("RGB", (32 + 8 * i, 64), (30 * i, 0, 0)).save(folder / f"{i}.png")
        (folder / f"{i}.txt").write_text(f"image {i}", encoding="utf-8")
    ds, _, _ = _build(folder, max_pixels=48 * 48)
    assert ds.steps_per_epoch(4) == 7
    assert ds.thin_batches(4) == ("batch_size=4: a batch holds images of one bucket (one image size), and the 8 items "
                                  "fall into 7 buckets: an epoch has 7 batches of 1.1 items on average, not 2 of 4: "
                                  "crop the images to a few aspect ratios for full batches, or raise grad_accumulation "
                                  "for a larger effective batch")
    assert ds.thin_batches(1) is None  # batches of one are what was asked for
    same, _, _ = _build(make_demo_dataset(tmp_path / "square", n_images=8, size=64, seed=0), max_pixels=48 * 48)
    assert same.thin_batches(4) is None

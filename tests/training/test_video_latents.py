"""Multi-frame video latents (B, C, T, h, w) from ComfyUI's LATENT (a video VAE's VAE Encode, Wan's) train as clips:
one sample each (C, T, h, w), bucketed by their frames and size (never batched with another T or h, w), probed at
their full size, fingerprinted by their frames; a model that takes image latents (Flux) is refused before any run."""
import pytest
import torch
from demo_setup import demo_session

from tightrope.training.data.builder import dataset_from_conditioning
from tightrope.training.data.dataset import TrainingDataset
from tightrope.training.data.image_folder import DatasetError
from tightrope.training.trainer import SaveTarget, train

CPU = torch.device("cpu")


def _cond(n=1, width=32):
    return [[torch.randn(1, 6, width), {"pooled_output": None}] for _ in range(n)]


def test_video_latents_become_clip_samples():
    samples = torch.randn(3, 16, 5, 8, 8)
    data = dataset_from_conditioning({"samples": samples}, _cond())
    assert data.num_images == 3 and data.clip_count() == 3
    assert data.latent_shape(1) == (16, 5, 8, 8) and torch.equal(data.latent(1), samples[1])
    batch = next(data.batches(3, seed=0))
    assert batch["latents"].shape == (3, 16, 5, 8, 8)
    assert data.encoded_widths()[0] == {16}


def test_single_frame_latents_stay_images():
    data = dataset_from_conditioning({"samples": torch.randn(2, 16, 1, 8, 8)}, _cond())
    assert data.latent_shape(0) == (16, 8, 8) and data.clip_count() == 0


def _mixed():
    g = torch.Generator().manual_seed(0)
    latents = ([torch.randn(16, 5, 8, 8, generator=g) for _ in range(3)]  # 5 latent frames (17 video frames)
               + [torch.randn(16, 3, 8, 8, generator=g) for _ in range(3)]  # 3 latent frames
               + [torch.randn(16, 3, 8, 12, generator=g) for _ in range(2)]  # another size
               + [torch.randn(1, 16, 16, 16, generator=g) for _ in range(4)])  # images, batched (1, C, h, w)
    n = len(latents)
    return TrainingDataset.from_tensors(latents, [torch.randn(6, 32, generator=g) for _ in range(n)],
                                        [torch.zeros(0) for _ in range(n)])


def test_clips_of_other_frames_or_size_are_never_batched_together():
    data = _mixed()
    assert data.bucket_counts == {(16, 5, 8, 8): 3, (16, 3, 8, 8): 3, (16, 3, 8, 12): 2, (16, 16, 16): 4}
    for epoch in range(3):
        for batch in data.epoch_plan(2, seed=1, epoch=epoch):
            assert len({data.latent_shape(data._items[i]) for i, _ in batch}) == 1
    seen = set()
    for batch, _ in zip(data.batches(2, seed=1), range(20)):
        seen.add(tuple(batch["latents"].shape))
    assert seen == {(2, 16, 5, 8, 8), (1, 16, 5, 8, 8), (2, 16, 3, 8, 8), (1, 16, 3, 8, 8), (2, 16, 3, 8, 12),
                    (2, 16, 16, 16)}


def test_the_largest_batch_counts_the_frames():
    """5 latent frames of 8x8 (320 cells) outweigh an image of 16x16 (256): the probe must see the clips."""
    assert _mixed().largest_batch(2)["latents"].shape == (2, 16, 5, 8, 8)


def test_fingerprint_covers_the_frames():
    x = torch.randn(2, 16, 5, 8, 8)
    one = dataset_from_conditioning({"samples": x}, _cond()).content_digest()
    fewer = dataset_from_conditioning({"samples": x[:, :, :3].contiguous()}, _cond()).content_digest()
    assert one != fewer


@pytest.mark.parametrize("shape", [(2, 16, 3, 4, 8, 8), (16, 8)])
def test_other_latent_shapes_are_refused(shape):
    with pytest.raises(DatasetError, match=r"latent: samples have shape .* expected images .* or a video VAE's"):
        dataset_from_conditioning({"samples": torch.randn(*shape)}, _cond())


def test_an_image_model_refuses_video_latents_before_anything_runs(tmp_path):
    """The demo's Flux takes image latents: a clip dataset is refused in one line naming the input and the fix."""
    session = demo_session(tmp_path)
    cond = session.dataset.text(0)
    data = TrainingDataset.from_tensors([torch.randn(16, 3, 8, 8) for _ in range(2)], [cond[0]] * 2, [cond[1]] * 2)
    with pytest.raises(DatasetError, match=r"the dataset holds 2 video clip\(s\) \(multi-frame latents\), but this "
                                           r"flux model .* takes image latents: train a video model \(Wan\)"):
        train(session.advanced(dataset=data), 2, device=CPU, save=SaveTarget(tmp_path / "out", "run", every=1))
    assert not (tmp_path / "out").exists()


def test_thin_batches_name_the_clips_frames():
    """Clips of other frame counts fall into buckets of their own: the thin-batches warning says so, not only
    'image size'."""
    g = torch.Generator().manual_seed(0)
    latents = [torch.randn(16, t, 8, 8, generator=g) for t in (1, 2, 3, 4, 5, 6, 7, 8)]
    data = TrainingDataset.from_tensors(latents, [torch.randn(6, 32, generator=g) for _ in latents],
                                        [torch.zeros(0) for _ in latents])
    said = data.thin_batches(4)
    assert "one image or clip size (frames and height x width)" in said
    assert "give every clip at least the frames set" in said

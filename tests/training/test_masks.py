"""Masked loss: masks follow their image through EXIF flips, bucketing and cropping onto the latent grid, are cached
with the latents, weight the loss so a masked-out half adds nothing to the gradient, and bad masks fail early."""
import dataclasses
import io

import pytest
import torch
import torch.nn.functional as F
from demo_setup import demo_session
from PIL import Image

from tightrope.training.data.dataset import TrainingDataset
from tightrope.demo.model import demo_encoders
from tightrope.training.data.image_folder import DatasetError
from tightrope.training.lora.layers import LoraSpec, inject_lora, lora_parameters
from tightrope.training.data.masks import masked_flow_loss, masked_mean
from tightrope.training.models import adapter_for
from tightrope.training.trainer import train

CPU = torch.device("cpu")
RED, BLACK, WHITE = (255, 0, 0), (0, 0, 0), 255
MIRROR = 2  # EXIF orientation: mirrored left-right


def _png(image: Image.Image, orientation: int | None = None) -> bytes:
    buf = io.BytesIO()
    exif = Image.Exif()
    if orientation is not None:
        exif[0x0112] = orientation
    image.save(buf, format="PNG", exif=exif)
    return buf.getvalue()


def _half(size, left, right, mode="RGB"):
    """An image whose left half (in pixels, rounded down) is `left` and right half `right`."""
    w, h = size
    image = Image.new(mode, size, right)
    image.paste(left, (0, 0, w // 2, h))
    return image


def _folder(tmp_path, images: dict, masks: dict | None = None):
    folder = tmp_path / "data"
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in images.items():
        (folder / f"{name}.png").write_bytes(data)
        (folder / f"{name}.txt").write_text(f"picture {name}")
    for name, data in (masks or {}).items():
        (folder / f"{name}.mask.png").write_bytes(data)
    return folder


def _dataset(folder, mask, max_pixels=32 * 32, cache=None):
    vae, clip = demo_encoders()
    return TrainingDataset(folder, vae, clip, max_pixels=max_pixels, mask=mask, cache_dir=cache)


def _red(dataset, i):
    """How red the trained image is (red minus green: red 1, black and white 0) on the latent grid (the demo codec
    decodes latents exactly)."""
    vae, _ = demo_encoders()
    pixels = (vae.decode(dataset.latent(i)[None])[0] + 1) / 2
    return F.avg_pool2d(pixels[0:1] - pixels[1:2], 2)[0]


def test_a_zero_half_mask_leaves_that_half_out_of_the_gradient(tmp_path):
    folder = _folder(tmp_path, {"a": _png(_half((32, 32), RED, (0, 90, 200)))},
                     {"a": _png(_half((32, 32), 0, WHITE, mode="L"))})
    dataset = _dataset(folder, "mask_files")
    batch = next(dataset.batches(1, seed=0))
    mask = batch["mask"]
    assert mask.shape == (1, 1, 16, 16)  # the latent grid
    assert torch.equal(mask[..., :8], torch.zeros(1, 1, 16, 8)) and torch.equal(mask[..., 8:], torch.ones(1, 1, 16, 8))

    session = demo_session(tmp_path)
    adapter = adapter_for(session.model)
    g = torch.Generator().manual_seed(0)
    latents, noise = batch["latents"], torch.randn(batch["latents"].shape, generator=g)
    t = torch.tensor([0.6])
    with torch.enable_grad(), adapter.training_module() as module:
        inject_lora(module, LoraSpec(rank=4, targets="attention_mlp", init="gaussian"), adapter.family)
        params = list(lora_parameters(module).values())
        pred = adapter.predict(module, (1 - t) * latents + t * noise, t, batch["context"], batch["pooled"], 1.0)
        target_latents = latents.clone().requires_grad_(True)
        masked = torch.autograd.grad(masked_flow_loss(pred, target_latents, noise, mask), [*params, target_latents],
                                     retain_graph=True)
        # plain torch: the flow-matching MSE over the right half only
        plain = torch.autograd.grad(F.mse_loss(pred[..., 8:], (noise - latents)[..., 8:]), params, retain_graph=True)
        # the left half's targets changed wildly: the gradient does not change at all
        wild = latents.clone()
        wild[..., :8] = 1e3
        wild_grads = torch.autograd.grad(masked_flow_loss(pred, wild, noise, mask), params)
    assert torch.equal(masked[-1][..., :8], torch.zeros_like(latents[..., :8]))  # the left half adds exactly 0
    assert masked[-1][..., 8:].abs().sum() > 0
    # the same mean of the same squared errors, summed in another order (the masked sum adds exact zeros): fp32
    # summation of ~4k terms agrees to well within 1e-5 relative
    for a, b in zip(masked[:-1], plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7 * b.abs().max().item())
    assert any(b.abs().max() > 0 for b in plain)
    assert all(torch.equal(a, b) for a, b in zip(masked[:-1], wild_grads))


def test_the_trainer_weights_the_loss_by_the_mask(tmp_path):
    """An all-white mask trains as without a mask; a half mask trains otherwise, and every step reads it."""
    image = {f"i{k}": _png(_half((32, 32), RED, (0, 40 * k, 200))) for k in range(2)}
    plain_folder = _folder(tmp_path / "plain", image)
    white = _folder(tmp_path / "white", image, {k: _png(Image.new("L", (32, 32), WHITE)) for k in image})
    half = _folder(tmp_path / "half", image, {k: _png(_half((32, 32), 0, WHITE, mode="L")) for k in image})
    base = demo_session(tmp_path)
    runs = {name: train(base.advanced(dataset=_dataset(f, mask)), 2, device=CPU)
            for name, f, mask in (("plain", plain_folder, "none"), ("white", white, "mask_files"),
                                  ("half", half, "mask_files"))}
    # white: sum(1 * l) / (C * sum(1)) is the mean, summed in another order: equal to fp32 rounding
    torch.testing.assert_close(torch.tensor(runs["white"].losses), torch.tensor(runs["plain"].losses), rtol=1e-5,
                               atol=0)
    assert runs["half"].losses[0] != pytest.approx(runs["plain"].losses[0], rel=1e-3)


def test_masks_follow_the_crop_of_a_bucket(tmp_path):
    """116x24 under a 32x32 budget goes to the 64x16 bucket: scaled by 2/3 after cropping 10 source px off each
    side. The red (and masked) left 40 px end at (40 - 10) * 2/3 = 20 px: latent column 10 exactly. Stretching the
    mask instead of cropping it would put that edge at 40 * 64/116 = 22 px."""
    image = Image.new("RGB", (116, 24), BLACK)
    image.paste(RED, (0, 0, 40, 24))
    mask = Image.new("L", (116, 24), 0)
    mask.paste(WHITE, (0, 0, 40, 24))
    dataset = _dataset(_folder(tmp_path, {"wide": _png(image)}, {"wide": _png(mask)}), "mask_files")
    weights, red = dataset.mask(0)[0], _red(dataset, 0)
    assert weights.shape == dataset.latent(0).shape[1:] == (8, 32)
    assert torch.equal(weights[:, :10], torch.ones(8, 10)) and torch.equal(weights[:, 10:], torch.zeros(8, 22))
    # the image went the same way (Lanczos rings a little at the edge: clearly red inside, clearly not outside)
    assert red[:, :9].min() > 0.8 and red[:, 11:].max() < 0.2


@pytest.mark.parametrize("source", ["alpha", "mask_files"])
def test_masks_follow_an_exif_mirrored_image(tmp_path, source):
    """Stored mirrored with EXIF orientation 2: the image trains un-mirrored; its alpha flips with it, and a mask
    file is read as drawn (for the image as shown)."""
    stored = _half((32, 32), (255, 0, 0, 255), (0, 0, 0, 0), mode="RGBA")  # stored: red and opaque on the left
    masks = {"m": _png(_half((32, 32), 0, WHITE, mode="L"))} if source == "mask_files" else None  # shown: right
    dataset = _dataset(_folder(tmp_path, {"m": _png(stored, orientation=MIRROR)}, masks), source)
    weights, red = dataset.mask(0)[0], _red(dataset, 0)
    assert torch.equal(weights[:, 8:], torch.ones(16, 8)) and torch.equal(weights[:, :8], torch.zeros(16, 8))
    assert red[:, 8:].min() > 0.9 and red[:, :8].max() < 0.1  # shown: red on the right, as the mask


def test_masks_are_cached_with_the_latents(tmp_path):
    images = {"a": _png(_half((32, 32), RED, BLACK))}
    folder = _folder(tmp_path, images, {"a": _png(_half((32, 32), 0, WHITE, mode="L"))})
    first = _dataset(folder, "mask_files", cache=tmp_path / "cache")
    again = _dataset(folder, "mask_files", cache=tmp_path / "cache")
    assert (first.encoded_images, again.encoded_images, again.image_cache_hits) == (1, 0, 1)
    assert torch.equal(again.mask(0), first.mask(0)) and torch.equal(next(again.batches(1, 0))["mask"][0],
                                                                      first.mask(0))
    (folder / "a.mask.png").write_bytes(_png(Image.new("L", (32, 32), WHITE)))  # an edited mask: encoded again
    edited = _dataset(folder, "mask_files", cache=tmp_path / "cache")
    assert edited.encoded_images == 1 and torch.equal(edited.mask(0), torch.ones(1, 16, 16))
    plain = _dataset(folder, "none", cache=tmp_path / "cache")  # mask files are not images; no mask, no key
    assert plain.num_images == 1 and plain.mask(0) is None and "mask" not in next(plain.batches(1, 0))


def test_bad_masks_are_dataset_errors_naming_the_file(tmp_path):
    pic = _png(Image.new("RGB", (32, 32), RED))
    folder = _folder(tmp_path, {"a": pic, "b": pic}, {"a": _png(Image.new("L", (32, 32), WHITE))})
    with pytest.raises(DatasetError, match=r"mask='mask_files' but 1 of 2 images have no mask file \('.*/b\.mask\.png'"
                                           r"\).*or choose mask='none'"):
        _dataset(folder, "mask_files")
    (folder / "b.mask.png").write_bytes(_png(Image.new("L", (16, 32), WHITE)))
    with pytest.raises(DatasetError, match=r"mask file '.*/b\.mask\.png' is 16x32 but its image '.*/b\.png' is "
                                           r"32x32: save the mask at the image's size"):
        _dataset(folder, "mask_files")
    (folder / "b.mask.png").write_bytes(_png(Image.new("L", (32, 32), 0)))
    with pytest.raises(DatasetError, match=r"the mask of '.*/b\.mask\.png' is black everywhere"):
        _dataset(folder, "mask_files")
    with pytest.raises(DatasetError, match=r"mask='alpha' but 2 of 2 images have no alpha channel \('.*/a\.png', "
                                           r"'.*/b\.png'\): save them as PNG with transparency"):
        _dataset(folder, "alpha")
    with pytest.raises(DatasetError, match="mask='depth' is not supported: choose one of none, mask_files, alpha"):
        _dataset(folder, "depth")


def test_the_trainer_copies_the_mask_to_the_device_before_the_forward(tmp_path, monkeypatch):
    """On CUDA a host-to-device copy queued after the forward waits for the whole forward, and a pageable one blocks
    the host meanwhile, so nothing (backward included) is queued until the forward has run: every input, the mask
    too, goes to the device before the model is called (the mask was copied inside the loss, after predict)."""
    from tightrope.training import trainer

    events = []

    class Mask(torch.Tensor):  # records its copies to the device
        def to(self, *args, **kwargs):
            events.append("mask to device")
            return torch.Tensor(self).to(*args, **kwargs)

    real_step = trainer._micro_step

    def micro_step(parts, inputs, *args):
        real_predict = parts.adapter.predict
        parts.adapter.predict = lambda *a: events.append("predict") or real_predict(*a)
        try:
            return real_step(parts, dataclasses.replace(inputs, mask=inputs.mask.as_subclass(Mask)), *args)
        finally:
            del parts.adapter.predict

    monkeypatch.setattr(trainer, "_micro_step", micro_step)
    image = {f"i{k}": _png(_half((32, 32), RED, (0, 40 * k, 200))) for k in range(2)}
    half = _folder(tmp_path / "half", image, {k: _png(_half((32, 32), 0, WHITE, mode="L")) for k in image})
    train(demo_session(tmp_path).advanced(dataset=_dataset(half, "mask_files")), 2, device=CPU)
    assert events == ["mask to device", "predict"] * 2


def test_masked_mean_of_a_loss_with_a_frame_axis_weights_each_sample_by_its_own_mask():
    """Wan and Qwen-Image latents are (B, C, 1, h, w): the (B, 1, h, w) mask must meet the batch axis, not the
    channels (batch 2 used to raise; batch == channels weighted sample 0's mask everywhere). Each image is normalised
    by its own kept area, then images are averaged. Reference: plain torch per sample."""
    g = torch.Generator().manual_seed(0)
    for batch, channels in ((2, 16), (4, 4)):
        loss = torch.rand(batch, channels, 1, 6, 5, generator=g)
        mask = (torch.rand(batch, 1, 6, 5, generator=g) > 0.5).float()
        mask[:, :, 0, 0] = 1  # nothing black everywhere
        expected = torch.stack([(loss[b, :, 0] * mask[b]).sum() / (mask[b].sum() * channels)
                                for b in range(batch)]).mean()
        torch.testing.assert_close(masked_mean(loss, mask), expected)
        torch.testing.assert_close(masked_mean(loss[:, :, 0], mask), expected)  # the same loss without the axis
    with pytest.raises(ValueError, match=r"a loss mask of shape \(3, 1, 1, 6, 5\) does not fit a loss of shape"):
        masked_mean(torch.rand(2, 4, 1, 6, 5), torch.ones(3, 1, 6, 5))


def test_a_batch_cut_into_parts_weighted_by_their_images_gives_the_whole_batchs_masked_loss():
    """torchrun weights each rank's part by its share of the images: with masks of different areas that is exact
    only if each image is normalised by its own area (the whole batch's mask total made 2 ranks' gradient 46 %
    off). The difference is summation order only: fp32, a few ulps."""
    g = torch.Generator().manual_seed(1)
    loss = torch.rand(4, 4, 8, 8, generator=g)
    mask = torch.zeros(4, 1, 8, 8)
    for b, side in enumerate((8, 2, 5, 1)):
        mask[b, :, :side, :side] = 1
    parts = [masked_mean(loss[lo:hi], mask[lo:hi]) * (hi - lo) / 4 for lo, hi in ((0, 2), (2, 3), (3, 4))]
    torch.testing.assert_close(sum(parts), masked_mean(loss, mask), rtol=1e-6, atol=0)


def test_a_16_bit_grey_mask_keeps_its_grey_levels(tmp_path):
    """Pillow's 16-bit -> 8-bit conversion clips at 255, so a 25 % grey became 100 %: the mask is scaled instead."""
    grey16 = Image.new("I;16", (32, 32), 0)
    grey16.paste(Image.new("I;16", (16, 32), 16384), (0, 0))  # left half 16384 / 65535 = 0.25
    folder = _folder(tmp_path, {"a": _png(Image.new("RGB", (32, 32), RED))}, {"a": _png(grey16)})
    mask = next(_dataset(folder, "mask_files").batches(1, seed=0))["mask"]
    torch.testing.assert_close(mask[..., :8], torch.full((1, 1, 16, 8), 16384 / 65535))
    assert torch.equal(mask[..., 8:], torch.zeros(1, 1, 16, 8))

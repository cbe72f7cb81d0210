"""The losses of the flow objective against plain torch: MSE, Huber (with delta) and L1 of the prediction against
the velocity noise - x_0, in fp32, as a batch mean or one mean per sample; and the trainer uses the one chosen."""
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from demo_setup import demo_session

from tightrope.training.data.dataset import TrainingDataset
from tightrope.training.flow_loss import flow_matching_loss, noised
from tightrope.training.models.adapter import ReferenceFluxModel
from tightrope.training.train_config import ConfigError, TrainConfig
from tightrope.training.trainer import train


def _batch():
    g = torch.Generator().manual_seed(0)
    latents, noise = torch.randn(3, 4, 6, 6, generator=g), torch.randn(3, 4, 6, 6, generator=g)
    prediction = (noise - latents + 1.5 * torch.randn(3, 4, 6, 6, generator=g)).to(torch.bfloat16)  # some errors > 1
    return prediction, latents, noise


@pytest.mark.parametrize("kind, reference", [
    ("mse", lambda p, y, r: F.mse_loss(p, y, reduction=r)),
    ("huber", lambda p, y, r: F.huber_loss(p, y, reduction=r, delta=0.5)),
    ("l1", lambda p, y, r: F.l1_loss(p, y, reduction=r)),
])
def test_losses_equal_plain_torch_on_the_flow_target(kind, reference):
    prediction, latents, noise = _batch()
    target = noise - latents
    mean = flow_matching_loss(prediction, latents, noise, kind=kind, huber_delta=0.5)
    assert mean.dtype == torch.float32
    # the same torch function on the same fp32 inputs (the bf16 prediction upcast first): equal bit for bit
    assert torch.equal(mean, reference(prediction.float(), target, "mean"))
    per_sample = flow_matching_loss(prediction, latents, noise, kind=kind, huber_delta=0.5, reduction="none")
    expected = reference(prediction.float(), target, "none").mean(dim=(1, 2, 3))
    assert per_sample.shape == (3,) and torch.equal(per_sample, expected)
    # the mean of per-sample means is the batch mean (equal sizes); summation order differs by an ulp at most
    torch.testing.assert_close(per_sample.mean(), mean, rtol=1e-6, atol=0)


def test_huber_is_quadratic_below_delta_and_linear_above():
    latents, noise = torch.zeros(1, 4), torch.zeros(1, 4)
    prediction = torch.tensor([[0.1, -0.2, 3.0, -5.0]])
    per_element = [0.5 * 0.1 ** 2, 0.5 * 0.2 ** 2, 1.0 * (3.0 - 0.5), 1.0 * (5.0 - 0.5)]  # delta = 1
    assert flow_matching_loss(prediction, latents, noise, kind="huber").item() == pytest.approx(sum(per_element) / 4)


def test_unknown_loss_and_bad_delta_are_refused():
    with pytest.raises(ConfigError, match="loss='smooth' is not supported: choose one of mse, huber, l1"):
        TrainConfig(loss="smooth")
    for delta in (0.0, -1.0):
        with pytest.raises(ConfigError, match=f"huber_delta={delta!r} must be greater than 0"):
            TrainConfig(loss="huber", huber_delta=delta)
    with pytest.raises(ValueError, match="loss='smooth' is not supported"):
        flow_matching_loss(*_batch(), kind="smooth")


def test_the_trainer_trains_on_the_chosen_loss(tmp_path):
    """The first step sees the same prediction whatever the loss (same seed, untrained LoRA): Huber with a delta above
    every error is exactly half the MSE there (0.5 * x^2 per element; halving is exact in binary floating point)."""
    mse = train(demo_session(tmp_path), 1, device=torch.device("cpu")).losses[0]
    huber = train(demo_session(tmp_path, loss="huber", huber_delta=100.0), 1, device=torch.device("cpu")).losses[0]
    l1 = train(demo_session(tmp_path, loss="l1"), 1, device=torch.device("cpu")).losses[0]
    assert huber == pytest.approx(0.5 * mse, rel=1e-6)  # per-element halving is exact; the mean's rounding may differ
    # mean |x| <= sqrt(mean x^2) (Cauchy-Schwarz), with equality only if every |x| is the same, which it is not
    assert 0 < l1 < math.sqrt(mse) and l1 != pytest.approx(mse, rel=1e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_latents_are_noised_at_the_models_timestep(dtype):
    """x_t = (1 - t) * x_0 + t * noise for the fp32 t the model is given, whatever the latents' dtype: fp16/bf16
    latents once rounded t to their dtype (bf16: up to 2^-9) and (1 - t) * x_0 with it. The reference is the same fp32
    arithmetic on the same values (fp16/bf16 values are exact in fp32), so the two are equal bit for bit."""
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(4, 3, 5, 5, generator=g).to(dtype)
    noise, t = torch.randn(4, 3, 5, 5, generator=g), torch.rand(4, generator=g)
    t4 = t.view(-1, 1, 1, 1)
    x_t = noised(latents, noise, t)
    assert x_t.dtype == torch.float32 and torch.equal(x_t, (1 - t4) * latents.float() + t4 * noise)
    assert torch.equal(noised(latents.float(), noise, t), x_t)  # fp32 latents: the same numbers, as before


def test_latents_held_in_half_precision_train_as_their_values_in_fp32(tmp_path, monkeypatch):
    """A LATENT in fp16 (ComfyUI's VAE Encode under --fp16-intermediates) trains and validates exactly as the same
    values in fp32: the latent format's shift and scale (Flux's, patched onto the demo model), the noised input and
    the target noise - x_0 are the same fp32 numbers, and so is every step."""
    monkeypatch.setattr(ReferenceFluxModel, "process_latents", lambda self, x: (x - 0.1159) * 0.3611)
    session = demo_session(tmp_path)
    params = session.model.flux.params
    g = torch.Generator().manual_seed(1)
    latents = [torch.randn(params.in_channels // 4, 16, 16, generator=g).half() for _ in range(4)]
    context, pooled = torch.randn(8, params.context_in_dim, generator=g), torch.randn(params.vec_in_dim, generator=g)
    datasets = [TrainingDataset.from_tensors(lat, [context] * 4, [pooled] * 4)
                for lat in (latents, [x.float() for x in latents])]
    runs = [train(dataclasses.replace(session, dataset=d, validation_dataset=d), 2, device=torch.device("cpu"))
            for d in datasets]
    assert runs[0].losses == runs[1].losses and len(runs[0].validation_losses) == 2  # steps 0 and 2
    assert runs[0].validation_losses == runs[1].validation_losses
    assert all(torch.equal(v, runs[1].lora_state[k]) for k, v in runs[0].lora_state.items())

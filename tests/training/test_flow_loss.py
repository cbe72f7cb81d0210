"""The losses of the flow objective against plain torch: MSE, Huber (with delta) and L1 of the prediction against
the velocity noise - x_0, in fp32, as a batch mean or one mean per sample; and the trainer uses the one chosen."""
import math

import pytest
import torch
import torch.nn.functional as F
from demo_setup import demo_session

from tightrope.training.flow_loss import flow_matching_loss
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

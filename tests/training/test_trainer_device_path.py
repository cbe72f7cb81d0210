"""The step's device path: inputs are on the device before the forward is queued; fp16 scales the loss."""
import sys

import pytest
import torch
from demo_setup import demo_session

from tightrope.memory.strategy import Strategy
from tightrope.training.models import adapter as model_adapter
from tightrope.training.trainer import train

CPU = torch.device("cpu")


def test_inputs_reach_the_device_before_the_forward(tmp_path, monkeypatch):
    """On CUDA a host->device copy queued after the forward waits for the whole forward (the host stalls): the
    trainer's copies (x_t, t, context, pooled, latents, noise; through the runtime's InputCopies) must all come
    before the model runs."""
    events = []
    real_predict, real_to = model_adapter.ReferenceFluxModel.predict, torch.Tensor.to

    def predict(self, *args, **kwargs):
        events.append("forward")
        return real_predict(self, *args, **kwargs)

    def to(self, *args, **kwargs):
        if sys._getframe(1).f_code.co_filename.endswith(("trainer.py", "input_copies.py")):
            events.append("copy")
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(model_adapter.ReferenceFluxModel, "predict", predict)
    monkeypatch.setattr(torch.Tensor, "to", to)
    train(demo_session(tmp_path), 2, device=CPU)
    assert events == (["copy"] * 6 + ["forward"]) * 2


@pytest.mark.parametrize("dtype,scaled", [("fp16", True), ("bf16", False)])
def test_fp16_compute_scales_the_loss(tmp_path, monkeypatch, dtype, scaled):
    """fp16 gradients underflow without loss scaling; bf16 has fp32's range and needs none."""
    made = []

    class Recording(torch.amp.GradScaler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(torch.amp, "GradScaler", Recording)
    result = train(demo_session(tmp_path, strategy=Strategy.of(compute_dtype=dtype)), 2, device=CPU)
    assert [s.is_enabled() for s in made] == [scaled]
    assert all(map(torch.isfinite, torch.tensor(result.losses)))
    if scaled:  # the scale was in use: a step that found no overflow keeps it at its start value (2**16)
        assert made[0].get_scale() == 2.0 ** 16

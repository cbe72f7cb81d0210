"""The host reads losses once per step and once per validation pass, never per micro-batch or validation batch: on
a GPU each read waits for the work queued so far, and the next batch is only then read and prepared while the GPU
idles. A step's micro-batches (and a validation pass's batches) are queued back to back."""
import sys

import torch
from demo_setup import demo_session

from tightrope.training import trainer, validation
from tightrope.training.trainer import train

CPU = torch.device("cpu")


def test_the_loss_is_read_once_per_step_after_every_micro_batch_is_queued(tmp_path, monkeypatch):
    events = []
    real_item, real_float, real_micro_step = torch.Tensor.item, torch.Tensor.__float__, trainer._micro_step

    def from_trainer():
        return sys._getframe(2).f_code.co_filename.endswith(("trainer.py", "validation.py"))

    def item(self):
        if from_trainer():
            events.append("read")
        return real_item(self)

    def to_float(self):
        if from_trainer():
            events.append("read")
        return real_float(self)

    def micro_step(*args):
        events.append("micro-step")
        return real_micro_step(*args)

    monkeypatch.setattr(torch.Tensor, "item", item)
    monkeypatch.setattr(torch.Tensor, "__float__", to_float)
    monkeypatch.setattr(trainer, "_micro_step", micro_step)
    result = train(demo_session(tmp_path, grad_accumulation=3), 2, device=CPU)
    assert events == (["micro-step"] * 3 + ["read"]) * 2, events  # was a read after every micro-step
    assert len(result.losses) == 2 and all(isinstance(v, float) for v in result.losses)


def test_the_step_loss_is_the_image_weighted_mean_of_its_micro_batches(tmp_path, monkeypatch):
    """The value read is the sum the micro-steps returned, as a Python float (float64: the same sum Python floats of
    each micro-batch's weighted loss gave)."""
    returned = []
    real = trainer._micro_step

    def micro_step(*args):
        out = real(*args)
        returned.append(out)
        return out

    monkeypatch.setattr(trainer, "_micro_step", micro_step)
    result = train(demo_session(tmp_path, grad_accumulation=2), 2, device=CPU)
    assert all(t.dtype == torch.float64 and t.ndim == 0 and not t.requires_grad for t in returned)
    sums = [returned[0].item() + returned[1].item(), returned[2].item() + returned[3].item()]
    assert list(result.losses) == sums


def test_a_validation_pass_reads_its_loss_once(tmp_path, monkeypatch):
    """4 held-out images at batch 1: 4 forwards queued, one read; its value the float64 sum Python floats gave."""
    reads, per_batch = [], []
    real_float = torch.Tensor.__float__
    real_batch = validation.Validation._batch_losses

    def to_float(self):
        if sys._getframe(1).f_code.co_filename.endswith("validation.py"):
            reads.append(len(per_batch))
        return real_float(self)

    def batch_losses(self, *args):
        out = real_batch(self, *args)
        per_batch.append(out.double().sum().item())
        return out

    monkeypatch.setattr(torch.Tensor, "__float__", to_float)
    monkeypatch.setattr(validation.Validation, "_batch_losses", batch_losses)
    result = train(demo_session(tmp_path, validation_fraction=0.5, batch_size=1), 1, device=CPU)
    assert len(per_batch) == 8 and reads == [4, 8]  # two passes (steps 0 and 1), each read after its 4 batches
    total = 0.0
    for value in per_batch[:4]:
        total += value
    assert result.validation_losses[0] == (0, total / 4)

"""Non-finite values never reach a saved file: a NaN gradient with a finite loss is caught before the update (so
on_nonfinite='skip' really skips it), an update that makes the LoRA weights NaN stops the run, and neither the LoRA
nor the training state is ever written with NaN. (NaN in files that are loaded: tests/reliability/bad_input_cases.)"""
import pytest
import torch
from demo_setup import demo_session

from tightrope.training import distributed, trainer
from tightrope.training.lora.files import read_lora_file
from tightrope.training.state.resume import load_state
from tightrope.training.trainer import NonFiniteLossError, NonFiniteWeightsError, SaveTarget, train

CPU = torch.device("cpu")


def _poison_gradients_at(monkeypatch, step):
    """After the backward of `step` (1-based), one LoRA gradient holds an inf; the loss stays finite."""
    real, calls = distributed.all_reduce_gradients, []

    def all_reduce(params, loss):
        loss = real(params, loss)
        calls.append(1)
        if len(calls) == step:
            next(iter(params)).grad.view(-1)[0] = float("inf")
        return loss
    monkeypatch.setattr(distributed, "all_reduce_gradients", all_reduce)


def _poison_weights_at(monkeypatch, step):
    """The optimizer step of `step` (1-based) leaves one LoRA weight NaN, from finite gradients."""
    real = trainer.make_optimizer

    def make_optimizer(params, config, device):
        optimizer, calls = real(params, config, device), []
        real_step = optimizer.step

        def poisoned_step(*args, **kwargs):
            real_step(*args, **kwargs)
            calls.append(1)
            if len(calls) == step:
                with torch.no_grad():
                    next(iter(params.values())).view(-1)[0] = float("nan")
        optimizer.step = poisoned_step
        return optimizer
    monkeypatch.setattr(trainer, "make_optimizer", make_optimizer)


def _state_file(folder):
    (path,) = folder.rglob("*.state.safetensors")
    return path


def test_a_nonfinite_gradient_with_a_finite_loss_is_skipped(tmp_path, monkeypatch):
    session = demo_session(tmp_path, on_nonfinite="skip")
    save = SaveTarget(tmp_path / "out", "run", every=3)
    _poison_gradients_at(monkeypatch, 2)
    with pytest.warns(UserWarning, match=r"the gradients became NaN or infinite \(the loss was \d.*\) at step 2: step "
                                         "skipped"):
        result = train(session, 3, device=CPU, save=save)
    assert result.step == 3 and all(torch.isfinite(v).all() for v in result.lora_state.values())
    tensors, meta = read_lora_file(save.folder / "run_00001_.safetensors")  # read_lora_file checks: finite
    assert meta["tightrope.steps"] == "3" and load_state(_state_file(save.folder)).step == 3


def test_a_nonfinite_gradient_stops_with_on_nonfinite_stop(tmp_path, monkeypatch):
    session = demo_session(tmp_path)
    _poison_gradients_at(monkeypatch, 2)
    with pytest.raises(NonFiniteLossError, match=r"the gradients became NaN or infinite \(the loss was .*\) at step "
                                                 "2: training stopped and the LoRA of step 1 was kept"):
        train(session, 3, device=CPU, save=SaveTarget(tmp_path / "out", "run"))
    assert read_lora_file(tmp_path / "out" / "run_00001_.safetensors")[1]["tightrope.steps"] == "1"


@pytest.mark.parametrize("on_nonfinite", ["stop", "skip"])
def test_an_update_that_makes_the_weights_nonfinite_stops_and_saves_nothing_of_it(tmp_path, monkeypatch,
                                                                                 on_nonfinite):
    session = demo_session(tmp_path, on_nonfinite=on_nonfinite)
    save = SaveTarget(tmp_path / "out", "run", every=2)
    _poison_weights_at(monkeypatch, 3)
    with pytest.raises(NonFiniteWeightsError, match=rf"the optimizer step of step 3 made LoRA weights NaN or infinite "
                                                    rf"although its loss \(.*\) and gradients were finite: training "
                                                    rf"stopped .* the last LoRA saved is {save.folder}/run_00001_"
                                                    r"\.safetensors \(step 2\)\. Lower learning_rate"):
        train(session, 4, device=CPU, save=save)
    assert [p.name for p in save.folder.glob("run_*_.safetensors")] == ["run_00001_.safetensors"]
    state = load_state(_state_file(tmp_path / "out"))  # load_state checks: finite
    assert state.step == 2

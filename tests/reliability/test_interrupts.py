"""Nothing is lost: a stop request, Ctrl-C, an exception or OOM mid-step, a NaN loss, or a crash while writing leaves
the last completed step's LoRA and training state on disk, and the model as it was."""
import gc
import weakref

import pytest
import torch
from demo_setup import demo_session
from reliability_kit import assert_untouched, snapshot, strategy, train_node, world

from tightrope.nodes import host
from tightrope.training import atomic_write
from tightrope.training.lora_file import read_lora_file
from tightrope.training.resume_state import load_state, state_path
from tightrope.training.trainer import NonFiniteLossError, SaveTarget, TrainingOutOfMemoryError, train

CPU = torch.device("cpu")


def _patch_predict(model, at_call, effect):
    """model.predict runs `effect(pred)` on its `at_call`-th call (1-based), the real prediction otherwise."""
    calls, real = [], model.predict

    def predict(*args, **kwargs):
        calls.append(1)
        pred = real(*args, **kwargs)
        return effect(pred) if len(calls) == at_call else pred
    model.predict = predict
    return model


def _saved_step(folder, prefix="run", state_folder=None):
    """(step of the newest LoRA file, step of the state file, the two hold the same LoRA)."""
    newest = max(folder.glob(f"{prefix}_*_.safetensors"))
    tensors, meta = read_lora_file(newest)
    state, _ = load_state(state_path(state_folder or folder, prefix))
    same = all(torch.equal(tensors["diffusion_model." + k.replace(".default", "")], v)
               for k, v in state.lora_state.items())
    return int(meta["tightrope.steps"]), state.step, same


def _boom(pred):
    raise RuntimeError("boom in the forward")


@pytest.mark.parametrize("how", ["stop_request", "ctrl_c", "exception_in_forward"])
def test_interruption_keeps_the_last_completed_step(tmp_path, how):
    session = demo_session(tmp_path)
    before = snapshot(session.model.flux)
    reference = train(session, 2, device=CPU)  # what step 2 holds
    save = SaveTarget(tmp_path / "out", "run")
    if how == "stop_request":
        seen = []
        result = train(session, 5, device=CPU, save=save, should_stop=lambda: len(seen) >= 2,
                       progress=lambda d, t, loss: seen.append(d))
        assert result.interrupted and result.step == 2
    elif how == "ctrl_c":
        def ctrl_c(done, total, loss):
            if done == 2:
                raise KeyboardInterrupt
        with pytest.raises(KeyboardInterrupt):
            train(session, 5, device=CPU, save=save, progress=ctrl_c)
    else:
        _patch_predict(session.model, 3, _boom)
        with pytest.raises(RuntimeError, match="boom in the forward"):
            train(session, 5, device=CPU, save=save)
    assert _saved_step(save.folder) == (2, 2, True)
    state, _ = load_state(state_path(save.folder, "run"))
    assert all(torch.equal(state.lora_state[k], v) for k, v in reference.lora_state.items())
    assert not list(save.folder.glob("*.tmp")) and not list(save.folder.glob(".*"))
    assert_untouched(session.model.flux, before)


def test_nonfinite_loss_stops_and_keeps_the_last_good_lora(out):
    model, dataset, spec, strat = world(out)
    _patch_predict(model, 3, lambda pred: pred * float("nan"))
    with pytest.raises(NonFiniteLossError, match="the loss became nan at step 3: training stopped and the LoRA of "
                                                 "step 2 was kept.*on_nonfinite='skip'"):
        train_node(model, dataset, spec, strat, steps=4)
    assert _saved_step(out / "rt", "lora", host.state_dir() / "rt") == (2, 2, True)


def test_nonfinite_loss_skip_skips_only_that_step(out):
    model, dataset, spec, strat = world(out)
    _patch_predict(model, 2, lambda pred: pred * float("inf"))
    with pytest.warns(UserWarning, match="at step 2: step skipped"):
        session, _, _ = train_node(model, dataset, spec, strat, steps=3, on_nonfinite="skip")
    assert session.step == 3 and not torch.isfinite(torch.tensor(session.losses[1]))
    assert all(torch.isfinite(v).all() for v in session.lora_state.values())


def test_a_crash_while_writing_the_state_leaves_the_previous_one(tmp_path, monkeypatch):
    session = demo_session(tmp_path)
    save = SaveTarget(tmp_path / "out", "run", every=2)
    first = train(session, 2, device=CPU, save=save)
    real = atomic_write.save_file

    def crash_midway(tensors, path, metadata=None):
        if "state" not in str(path):
            return real(tensors, path, metadata=metadata)
        with open(path, "wb") as f:
            f.write(b"\x00" * 100)  # half a file, then the "power cut"
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(atomic_write, "save_file", crash_midway)
    with pytest.warns(UserWarning, match="could not save the LoRA of step 4"), \
            pytest.raises(OSError, match="No space left"):
        train(first, 2, device=CPU, save=save)
    state, _ = load_state(state_path(save.folder, "run"))  # still the complete file of step 2
    assert state.step == 2 and all(torch.equal(state.lora_state[k], v) for k, v in first.lora_state.items())
    assert not [p for p in save.folder.iterdir() if p.name.endswith(".tmp")]


def test_out_of_memory_frees_saves_suggests_a_strategy_and_the_process_goes_on(out, monkeypatch):
    model, dataset, spec, strat = world(out)
    before = snapshot(model.flux)
    held = []

    def oom(pred):
        big = torch.empty(1 << 20)  # stands for the step's activations
        held.append(weakref.ref(big))
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    _patch_predict(model, 3, oom)
    with pytest.raises(TrainingOutOfMemoryError) as caught:
        train_node(model, dataset, spec, strat, steps=4)
    msg = str(caught.value)
    assert isinstance(caught.value, torch.OutOfMemoryError)
    assert "out of memory on cpu in step 3 (CUDA out of memory. Tried to allocate 20.00 GiB)" in msg
    assert "step 2 are saved" in msg and "lora_00001_.safetensors" in msg and "lora.state.safetensors" in msg
    assert "offload_fraction=1.0, checkpoint='all'" in msg and "batch_size to 1" in msg and "--resume" in msg
    del caught
    gc.collect()
    assert held[0]() is None  # the failed step's tensors were released
    assert _saved_step(out / "rt", "lora", host.state_dir() / "rt") == (2, 2, True)
    assert_untouched(model.flux, before)
    model.predict = type(model).predict.__get__(model)  # the "GPU" has room again, with a lighter strategy
    host.set_resume(True)
    session, _, _ = train_node(model, dataset, spec, strategy(offload_fraction=1.0, checkpoint="all"), steps=4)
    assert session.step == 4 and len(session.losses) == 4
    assert_untouched(model.flux, before)

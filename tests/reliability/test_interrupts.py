"""Nothing is lost: a stop request, Ctrl-C, an exception or OOM mid-step, a NaN loss, or a crash while writing leaves
the last completed step's LoRA and training state on disk, and the model as it was."""
import errno
import gc
import os
import tempfile
import time
import weakref

import pytest
import torch
from demo_setup import demo_session
from reliability_kit import assert_untouched, resuming, snapshot, strategy, train_node, world

from tightrope.nodes import host
from tightrope.nodes.save_node import TightropeSaveLora
from tightrope.training.state import atomic_write
from tightrope.training.state.atomic_write import FileWriteError
from tightrope.training.lora.files import read_lora_file
from tightrope.training.lora.rescue import LoraNotSavedError
from tightrope.training.state.resume import load_state, state_path
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
    state = load_state(state_path(state_folder or folder, prefix))
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
    state = load_state(state_path(save.folder, "run"))
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


def _disk_full_for(monkeypatch, in_data: bytes):
    """The disk fills up halfway through writing a file whose bytes contain `in_data` (other writes succeed)."""
    real = atomic_write._write_all

    def write_all(fd, data):
        if in_data not in data[:100_000]:
            return real(fd, data)
        os.write(fd, data[:len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(atomic_write, "_write_all", write_all)


def test_disk_full_while_writing_the_state_names_the_file_and_what_was_kept(tmp_path, monkeypatch):
    session = demo_session(tmp_path)
    save = SaveTarget(tmp_path / "out", "run", every=2)
    first = train(session, 2, device=CPU, save=save)
    _disk_full_for(monkeypatch, b"tightrope-training-state")
    state_file = state_path(save.folder, "run")
    said = (rf"could not write '{state_file}' \(No space left on device\): free disk space there or choose another "
            rf"folder; the LoRA of step 4 was saved \({save.folder}/run_00002_.safetensors\), its training state "
            "was not")
    with pytest.warns(UserWarning, match=said) as warned, pytest.raises(FileWriteError, match=said):
        train(first, 2, device=CPU, save=save)
    assert not [w for w in warned if "could not save the LoRA" in str(w.message)]
    assert read_lora_file(save.folder / "run_00002_.safetensors")[1]["tightrope.steps"] == "4"
    state = load_state(state_file)  # still the complete file of step 2
    assert state.step == 2 and all(torch.equal(state.lora_state[k], v) for k, v in first.lora_state.items())
    assert sorted(p.name for p in save.folder.iterdir()) == ["run.state.safetensors", "run_00001_.safetensors",
                                                              "run_00002_.safetensors"]  # no temp file, no 3rd LoRA


def _writes_fail_in(monkeypatch, folder, error=errno.ENOSPC, *, all_but=None):
    """Writing any file into `folder` (or anywhere but under `all_but`) fails: disk full there, or no permission."""
    real = atomic_write._create_temp

    def create_temp(path):
        if path.parent == folder or all_but is not None and all_but not in path.parents:
            raise OSError(error, os.strerror(error))
        return real(path)
    monkeypatch.setattr(atomic_write, "_create_temp", create_temp)


def test_a_stop_whose_save_fails_keeps_the_lora_in_a_fallback_file(tmp_path, monkeypatch):
    session = demo_session(tmp_path)
    reference = train(session, 2, device=CPU)
    save = SaveTarget(tmp_path / "out", "sub/run")  # save_every 0: the stop is the only save
    _writes_fail_in(monkeypatch, save.folder / "sub")
    rescue = save.folder / "tightrope_rescue_run_step2_00001_.safetensors"

    def ctrl_c(done, total, loss):
        if done == 2:
            raise KeyboardInterrupt
    with pytest.warns(UserWarning, match=rf"could not write the LoRA of step 2 to '{save.folder}/sub/run_00001_"
                                         rf".safetensors' \(No space left on device\); the trained LoRA was kept in "
                                         rf"'{rescue}' instead"), pytest.raises(KeyboardInterrupt):
        train(session, 5, device=CPU, save=save, progress=ctrl_c)
    tensors, meta = read_lora_file(rescue)
    assert meta["tightrope.steps"] == "2"
    assert all(torch.equal(tensors["diffusion_model." + k.replace(".default", "")], v)
               for k, v in reference.lora_state.items())


def test_save_lora_node_keeps_the_lora_when_its_folder_is_not_writable(out, monkeypatch):
    session, _, _ = train_node(*world(out), steps=2)
    _writes_fail_in(monkeypatch, out / "final", errno.EACCES)
    with pytest.raises(LoraNotSavedError, match=rf"could not write the LoRA of step 2 to '{out}/final/lora_00001_"
                                                rf".safetensors' \(Permission denied\); the trained LoRA was kept in "
                                                rf"'{out}/tightrope_rescue_lora_step2_00001_.safetensors' instead .*"
                                                "make the folder writable"):
        TightropeSaveLora().save(session, "final/lora")
    tensors, _ = read_lora_file(out / "tightrope_rescue_lora_step2_00001_.safetensors")
    assert all(torch.equal(tensors["diffusion_model." + k.replace(".default", "")], v)
               for k, v in session.lora_state.items())


def test_with_the_whole_disk_full_the_fallback_goes_to_the_temp_folder(out, monkeypatch, tmp_path):
    session, _, _ = train_node(*world(out), steps=1)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "systemp"))  # gettempdir(): another file system
    (tmp_path / "systemp").mkdir()
    _writes_fail_in(monkeypatch, None, all_but=tmp_path / "systemp")
    with pytest.raises(LoraNotSavedError, match=rf"to '{out}/final/lora_00001_.safetensors' \(No space left on "
                                                rf"device\); the trained LoRA was kept in '{tmp_path}/systemp/"
                                                r"tightrope_rescue_lora_step1_00001_.safetensors'"):
        TightropeSaveLora().save(session, "final/lora")
    _writes_fail_in(monkeypatch, None, all_but=tmp_path / "nowhere")
    with pytest.raises(LoraNotSavedError, match=rf"and no copy could be kept in '{out}' \(No space left on device\)"
                                                rf" or '{tmp_path}/systemp' \(No space left on device\): free disk"):
        TightropeSaveLora().save(session, "final/lora")


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
    with resuming():
        session, _, _ = train_node(model, dataset, spec, strategy(offload_fraction=1.0, checkpoint="all"), steps=4)
    assert session.step == 4 and len(session.losses) == 4
    assert_untouched(model.flux, before)


def test_a_run_removes_the_temp_files_a_killed_run_left(tmp_path):
    session = demo_session(tmp_path)
    save = SaveTarget(tmp_path / "out", "sub/run")
    (save.folder / "sub").mkdir(parents=True)
    left = save.folder / "sub" / ".run_00003_.safetensors.k9x2_abc.tmp"  # kill -9 while writing: 0 bytes
    others = [save.folder / "sub" / "notes.tmp", save.folder / "sub" / ".tmpAbC123"]
    for path in [left, *others]:
        path.write_bytes(b"")
        os.utime(path, (time.time() - 60,) * 2)
    train(session, 1, device=CPU, save=save)
    assert not left.exists() and all(p.exists() for p in others)

"""Full-state resume: a run interrupted at step k and resumed gives the uninterrupted run's losses and LoRA, bit for
bit (CPU fp32, fixed seed), from the trainer, through the Train node, and through `tightrope run --resume`."""
import dataclasses
import json
import random

import pytest
import torch
from demo_setup import demo_session
from reliability_kit import lora, resuming, train_node, world
from safetensors.torch import load_file

from tightrope import cli
from tightrope.nodes import host
from tightrope.training.data.dataset import TrainingDataset
from tightrope.training.lora.layers import LoraError, LoraSpec
from tightrope.training.models.reference_flux import Flux, FluxParams
from tightrope.training.state.fingerprints import model_mismatch
from tightrope.training.state.resume import load_state, model_fingerprint, resume_session, state_path
from tightrope.training.trainer import SaveTarget, train

CPU = torch.device("cpu")


def _ctrl_c_at(step):
    def progress(done, total, loss):
        if done == step:
            raise KeyboardInterrupt
    return progress


def test_train_3_interrupt_resume_3_equals_train_6(tmp_path):
    session = demo_session(tmp_path, schedule="cosine", warmup_steps=2)  # the schedule must span the whole run
    session = session.advanced(lora=LoraSpec(rank=4, targets="attention_mlp", dropout=0.1))  # dropout: RNG per step
    whole = train(session, 6, device=CPU)
    save = SaveTarget(tmp_path / "out", "run")
    with pytest.raises(KeyboardInterrupt):
        train(session, 6, device=CPU, save=save, progress=_ctrl_c_at(3))
    path = state_path(save.folder, save.filename_prefix)
    state = load_state(path)
    assert (state.step, state.run_start, state.run_end) == (3, 0, 6)
    resumed, state = resume_session(path, session)
    assert resumed.step == 3 and resumed.losses == whole.losses[:3]
    done = train(resumed, 3, device=CPU, run_start=state.run_start)
    assert done.losses == whole.losses  # exactly: data order, noise, dropout, schedule and Adam state carry over
    assert done.lora_state.keys() == whole.lora_state.keys()
    assert all(torch.equal(done.lora_state[k], v) for k, v in whole.lora_state.items())
    for k, v in whole.optimizer_state["state"].items():
        assert all(torch.equal(done.optimizer_state["state"][k][n], t) for n, t in v.items())


def test_resume_leaves_the_process_random_state_alone(tmp_path):
    """Every draw of a step comes from (seed, step) (the test above proves resume exact with LoRA dropout on), so
    resuming sets no global RNG: the random state of the process (a ComfyUI server's, a script's) is as it was."""
    session = demo_session(tmp_path)
    save = SaveTarget(tmp_path / "out", "run")
    with pytest.raises(KeyboardInterrupt):
        train(session, 4, device=CPU, save=save, progress=_ctrl_c_at(2))
    torch.manual_seed(1234)
    random.seed(1234)
    before = torch.get_rng_state(), random.getstate()
    resumed, _ = resume_session(state_path(save.folder, "run"), session)
    assert resumed.step == 2
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]


def test_train_node_resumes_only_its_remaining_steps(out, monkeypatch):
    model, dataset, spec, strat = world(out)
    kw = dict(steps=6, save_every=2, schedule="cosine")
    with torch.inference_mode():  # as ComfyUI and the headless runner call nodes
        whole, _, _ = train_node(model, dataset, spec, strat, filename_prefix="rt/whole", **kw)
        calls = []
        monkeypatch.setattr(host, "interrupt_requested", lambda: len(calls) >= 3)
        monkeypatch.setattr(host, "progress_reporter", lambda total: lambda d, t, loss: calls.append((d, t)))
        notes = []
        monkeypatch.setattr(host, "notify", notes.append)
        with pytest.raises(KeyboardInterrupt):  # the node ends the prompt as interrupted, after saving
            train_node(model, dataset, spec, strat, **kw)
        assert calls == [(1, 6), (2, 6), (3, 6)]
        # the user is told which step was kept, and where (the last file the run saved)
        assert notes[-1].startswith("Train node ") and " interrupted at step 3: its LoRA is saved in '" in notes[-1]
        assert notes[-1].endswith(".safetensors'") and "rt/lora" in notes[-1]
        assert load_state(state_path(host.state_dir(), "rt/lora")).step == 3
        monkeypatch.setattr(host, "interrupt_requested", lambda: False)
        calls.clear()
        with resuming():
            resumed, _, report = train_node(model, dataset, spec, strat, **kw)
            assert calls == [(4, 6), (5, 6), (6, 6)]  # only what the node had left, on the node's own progress bar
            assert resumed.step == 6 and resumed.losses == whole.losses and "step 6" in report
            assert all(torch.equal(resumed.lora_state[k], v) for k, v in whole.lora_state.items())
            calls.clear()
            again, _, _ = train_node(model, dataset, spec, strat, **kw)  # finished: same outputs, no training
        assert calls == [(6, 6)] and again.step == 6 and again.losses == whole.losses  # its bar shown full, once


def test_a_stop_in_the_last_steps_validation_is_scored_on_resume(out, monkeypatch):
    """A stop while the run's last step was being validated saved that step: the state said finished, so --resume
    returned it with that validation loss missing for good (state file, report, plots; found by a helper). Now the
    resumed node scores it (no step trained) and saves it: the history equals an uninterrupted run's."""
    from tightrope.training.validation import Validation
    model, dataset, spec, strat = world(out)
    kw = dict(steps=4, validation_fraction=0.25, validation_every=2)
    with torch.inference_mode():
        whole, _, _ = train_node(model, dataset, spec, strat, filename_prefix="rt/whole", **kw)
        assert [s for s, _ in whole.validation_losses] == [0, 2, 4]
        real = Validation.score_if_due

        def stopped_at_the_end(self, step, *a):
            if step == 4:
                raise KeyboardInterrupt
            return real(self, step, *a)
        with monkeypatch.context() as m:
            m.setattr(Validation, "score_if_due", stopped_at_the_end)
            with pytest.raises(KeyboardInterrupt):
                train_node(model, dataset, spec, strat, **kw)
        path = state_path(host.state_dir(), "rt/lora")
        assert load_state(path).step == 4 and [s for s, _ in load_state(path).info["validation"]] == [0, 2]
        notes, calls = [], []
        monkeypatch.setattr(host, "notify", notes.append)
        monkeypatch.setattr(host, "progress_reporter", lambda total: lambda d, t, loss: calls.append((d, t)))
        with resuming():
            resumed, _, _ = train_node(model, dataset, spec, strat, **kw)
            assert resumed.validation_losses == whole.validation_losses and resumed.losses == whole.losses
            assert all(torch.equal(resumed.lora_state[k], v) for k, v in whole.lora_state.items())
            assert any("a stop left its validation loss unscored: scoring it" in n for n in notes) and calls == [(4, 4)]
            notes.clear()
            again, _, _ = train_node(model, dataset, spec, strat, **kw)  # now finished, scored: nothing to do
        assert again.validation_losses == whole.validation_losses and any("nothing to do" in n for n in notes)
        assert load_state(path).step == 4 and [s for s, _ in load_state(path).info["validation"]] == [0, 2, 4]


def test_comfyuis_interrupt_in_the_last_steps_validation_ends_the_prompt_as_interrupted(out, monkeypatch):
    """ComfyUI's interrupt raised inside the last step's validation (its ops check the flag, and clear it as they
    raise): the trainer dropped it and the run looked finished, so the node returned success, ComfyUI cached it and
    the step's validation loss was never scored (found by a helper in a real server). Now the node ends the prompt
    as interrupted, and queued again it scores that validation without training."""
    from tightrope.training.validation import Validation
    model, dataset, spec, strat = world(out)
    kw = dict(steps=4, validation_fraction=0.25, validation_every=2)
    notes = []
    monkeypatch.setattr(host, "notify", notes.append)
    with torch.inference_mode():
        whole, _, _ = train_node(model, dataset, spec, strat, filename_prefix="rt/whole", **kw)
        real = Validation.score_if_due

        def interrupted_at_the_end(self, step, *a):
            if step == 4:
                raise _HostInterrupt()
            return real(self, step, *a)
        with monkeypatch.context() as m:
            m.setattr(Validation, "score_if_due", interrupted_at_the_end)
            m.setattr(host, "interrupt_exceptions", lambda: (_HostInterrupt,))
            with pytest.raises(KeyboardInterrupt):  # headless, raise_interrupt is a Ctrl-C
                train_node(model, dataset, spec, strat, **kw)
        assert " interrupted at step 4: its LoRA is saved in '" in notes[-1]  # as any stop saves it
        with resuming():
            resumed, _, _ = train_node(model, dataset, spec, strat, **kw)
    assert resumed.validation_losses == whole.validation_losses
    assert any("a stop left its validation loss unscored: scoring it" in n for n in notes)


def test_resume_refuses_other_lora_settings(out, monkeypatch):
    model, dataset, spec, strat = world(out)
    monkeypatch.setattr(host, "interrupt_requested", lambda: True)
    with pytest.raises(KeyboardInterrupt):
        train_node(model, dataset, spec, strat, steps=3)
    monkeypatch.setattr(host, "interrupt_requested", lambda: False)
    train_node(model, dataset, spec, strat, steps=1, save_every=1)  # without --resume: a new run
    with resuming(), \
            pytest.raises(LoraError, match=r"lora\.state\.safetensors' was trained with LoRA rank=4 \(now 8\)"):
        train_node(model, dataset, lora(rank=8, alpha=4.0), strat, steps=3)


def _api_workflow(steps, prefix="rt/lora"):
    from reliability_kit import dataset_inputs, widgets
    from tightrope.nodes.strategy_node import TightropeMemoryStrategy
    d = dataset_inputs(folder="x")
    strat = {k: v[1]["default"] for k, v in TightropeMemoryStrategy.INPUT_TYPES()["required"].items()}
    return {
        "1": {"class_type": "TightropeDemoModel", "inputs": {"seed": 0}},
        "2": {"class_type": "TightropeDemoEncoders", "inputs": {"seed": 0}},
        "3": {"class_type": "TightropeDemoImages", "inputs": {"subfolder": "imgs", "count": 4, "size": 32, "seed": 0}},
        "4": {"class_type": "TightropeLoadDataset", "inputs": {**{k: v for k, v in d.items() if k not in
                                                                  ("vae", "clip", "folder")},
                                                               "folder": ["3", 0], "vae": ["2", 0], "clip": ["2", 1]}},
        "5": {"class_type": "TightropeLoraSetup", "inputs": {"rank": 4, "alpha": 4.0, "rslora": False, "dropout": 0.0,
                                                             "targets": "attention", "init": "default"}},
        "6": {"class_type": "TightropeMemoryStrategy", "inputs": strat | {"compute_dtype": "fp32"}},
        "7": {"class_type": "TightropeTrain", "inputs": widgets(steps=steps, save_every=2, filename_prefix=prefix)
              | {"model": ["1", 0], "dataset": ["4", 0], "lora": ["5", 0], "strategy": ["6", 0]}},
        "8": {"class_type": "TightropeSaveLora", "inputs": {"session": ["7", 0], "filename_prefix": "rt/final"}},
    }


def test_cli_ctrl_c_then_resume_equals_an_uninterrupted_run(tmp_path, monkeypatch, capsys):
    path = tmp_path / "w.json"
    path.write_text(json.dumps(_api_workflow(steps=4)))
    assert cli.main(["run", str(path), "--output-dir", str(tmp_path / "whole")]) == 0
    real = host.progress_reporter
    monkeypatch.setattr(host, "progress_reporter", lambda total: _ctrl_c_at(3))
    assert cli.main(["run", str(path), "--output-dir", str(tmp_path / "cut")]) == 130  # Ctrl-C at step 3
    assert "--resume" in capsys.readouterr().err
    monkeypatch.setattr(host, "progress_reporter", real)
    assert cli.main(["run", str(path), "--output-dir", str(tmp_path / "cut"), "--resume"]) == 0
    whole = load_file(tmp_path / "whole" / "rt" / "final_00001_.safetensors")
    resumed = load_file(tmp_path / "cut" / "rt" / "final_00001_.safetensors")
    assert whole.keys() == resumed.keys() and all(torch.equal(resumed[k], v) for k, v in whole.items())


def test_model_fingerprint_tells_other_models_from_the_same_one_in_another_dtype(tmp_path):
    flux = demo_session(tmp_path).model.flux
    saved = model_fingerprint(flux, "flux")
    assert model_mismatch(saved, model_fingerprint(flux.to(torch.bfloat16), "flux")) is None
    shallower = Flux(dataclasses.replace(FluxParams.tiny(), depth=1))
    assert "other layers" in model_mismatch(saved, model_fingerprint(shallower, "flux"))
    assert "sd3 model" in model_mismatch(saved, {**saved, "family": "sd3"})


def test_resume_with_changed_settings_or_data_warns_and_goes_on(tmp_path):
    session = demo_session(tmp_path)
    save = SaveTarget(tmp_path / "out", "run", every=1)
    train(session, 2, device=CPU, save=save)
    path = state_path(save.folder, "run")
    changed = session.advanced(config=dataclasses.replace(session.config, learning_rate=2e-3))
    with pytest.warns(UserWarning, match=r"changed training settings \(learning_rate: 0.001 -> 0.002\)"):
        resumed, state = resume_session(path, changed)
    assert resumed.step == 2 and state.run_start == 0
    context, pooled = session.dataset.text(0)
    other_data = TrainingDataset.from_tensors([session.dataset.latent(0)], [context], [pooled])
    with pytest.warns(UserWarning, match="different dataset"):
        resume_session(path, session.advanced(dataset=other_data))


def test_a_finished_run_resumed_with_changed_settings_says_they_took_no_effect(out, monkeypatch):
    """`tightrope run --resume` after editing a finished Train node's learning rate: the node returns its saved result
    (by design), and must say that the change took no effect, not that "the run goes on"; its session (so the Save
    LoRA metadata) names the learning rate it was trained with (found by a helper: it named the edited one)."""
    model, dataset, spec, strat = world(out)
    kw = dict(steps=3, learning_rate=1e-3)
    with torch.inference_mode(), resuming():
        first, _, _ = train_node(model, dataset, spec, strat, **kw)
        with pytest.warns(UserWarning, match=r"holds a finished run with other training settings \(learning_rate: "
                                             r"0.001 -> 0.002\): --resume returns its result") as caught:
            again, _, _ = train_node(model, dataset, spec, strat, **kw | dict(learning_rate=2e-3))
    assert not [w for w in caught if "the run goes on" in str(w.message)]
    assert again.step == 3 and again.losses == first.losses
    assert all(torch.equal(again.lora_state[k], v) for k, v in first.lora_state.items())
    assert again.config.learning_rate == 1e-3  # as trained: Save LoRA writes this in tightrope.training


def test_resume_with_another_global_batch_is_refused(tmp_path):
    """The world size may change between runs; the global batch may not (a step would mean other samples)."""
    from tightrope.training.train_config import ConfigError
    session = demo_session(tmp_path)
    train(session, 1, device=CPU, save=SaveTarget(tmp_path / "out", "run", every=1))
    path = state_path(tmp_path / "out", "run")
    assert load_state(path).info["layout"] == {"world_size": 1, "global_batch_size": 2}
    with pytest.raises(ConfigError, match="global batch_size of 2 .* set batch_size=2"):
        resume_session(path, session.advanced(config=dataclasses.replace(session.config, batch_size=4)))
    # another world size goes on, but its gradient sums add up in another order: said (found by a helper: 2 -> 1
    # processes resumed 2e-8 off, silently)
    state = load_state(path)
    state.info["layout"]["world_size"] = 2
    from tightrope.training.state import resume as resume_module
    with pytest.MonkeyPatch.context() as m:
        m.setattr(resume_module, "load_state", lambda p: state)
        with pytest.warns(UserWarning, match=r"changed training settings \(world size: 2 -> 1\)"):
            resume_session(path, session)


def test_fp16_resume_goes_on_at_the_loss_scale_of_the_uninterrupted_run(tmp_path, monkeypatch):
    """The fp16 loss scaler's scale moves with training (up every growth_interval steps, halved on an overflow, that
    step skipped): a resumed run starting again at the initial scale skips other steps than the uninterrupted one.
    A scaler that doubles every step from 2^16 reaches fp16's overflow within the run, so both moves happen."""
    from tightrope.memory.strategy import Strategy
    scales = []

    class Fast(torch.amp.GradScaler):
        def __init__(self, *a, **k):
            super().__init__(*a, init_scale=2.0 ** 16, growth_interval=1, **k)

        def update(self, *a, **k):
            super().update(*a, **k)
            scales.append(self.get_scale())
    monkeypatch.setattr(torch.amp, "GradScaler", Fast)
    session = demo_session(tmp_path, strategy=Strategy.of(compute_dtype="fp16"))
    whole = train(session, 8, device=CPU)
    whole_scales, scales[:] = list(scales), []
    assert any(b < a for a, b in zip(whole_scales, whole_scales[1:]))  # an overflow halved the scale
    save = SaveTarget(tmp_path / "out", "run")
    with pytest.raises(KeyboardInterrupt):
        train(session, 8, device=CPU, save=save, progress=_ctrl_c_at(4))
    resumed, state = resume_session(state_path(save.folder, "run"), session)
    done = train(resumed, 4, device=CPU, run_start=state.run_start)
    assert scales == whole_scales and done.losses == whole.losses
    assert all(torch.equal(done.lora_state[k], v) for k, v in whole.lora_state.items())


def test_resume_keeps_the_plan_of_an_auto_strategy(out, monkeypatch):
    """`auto` plans from measurements (free memory, timings) that differ from run to run: the resumed node trains
    with the interrupted run's plan (same request, same device), probing nothing, and equals an uninterrupted run."""
    from reliability_kit import strategy
    from tightrope.training import auto_plan
    model, dataset, spec, _ = world(out)
    auto = strategy(mode="auto", vram_budget_gb=4.0)
    kw = dict(steps=4, save_every=1)
    with torch.inference_mode():
        whole, _, _ = train_node(model, dataset, spec, auto, filename_prefix="rt/whole", **kw)
        path = state_path(host.state_dir(), "rt/lora")
        monkeypatch.setattr(host, "interrupt_requested", lambda: path.is_file() and load_state(path).step >= 2)
        with pytest.raises(KeyboardInterrupt):
            train_node(model, dataset, spec, auto, **kw)
        assert load_state(path).step == 2
        monkeypatch.setattr(host, "interrupt_requested", lambda: False)
        monkeypatch.setattr(auto_plan, "plan_for_session", lambda *a, **k: pytest.fail("planned again"))
        with resuming():
            resumed, _, report = train_node(model, dataset, spec, auto, **kw)
    assert resumed.step == 4 and resumed.losses == whole.losses and resumed.strategy == whole.strategy
    assert all(torch.equal(resumed.lora_state[k], v) for k, v in whole.lora_state.items())


def test_a_new_auto_plan_that_changes_the_numbers_is_said_or_trains_anew(out, monkeypatch):
    """Interrupted with token_chunks 2, resumed with an auto strategy whose plan has none: --resume went on silently,
    7e-9 off an uninterrupted run (found by a helper). Now headless warns; ComfyUI's resume widget (the very same run
    only) trains from the input and says why."""
    from reliability_kit import strategy
    from tightrope.memory.strategy import Strategy
    from tightrope.training import auto_plan
    model, dataset, spec, _ = world(out)
    kw = dict(steps=4, save_every=1)
    with torch.inference_mode():
        path = state_path(host.state_dir(), "rt/lora")
        monkeypatch.setattr(host, "interrupt_requested", lambda: path.is_file() and load_state(path).step >= 2)
        with pytest.raises(KeyboardInterrupt):
            train_node(model, dataset, spec, strategy(token_chunks=2, checkpoint="all"), **kw)
        monkeypatch.setattr(host, "interrupt_requested", lambda: False)
        monkeypatch.setattr(auto_plan, "plan_for_session",
                            lambda *a, **k: (Strategy.of(compute_dtype="fp32"), "planned"))
        auto = strategy(mode="auto", vram_budget_gb=4.0)
        saved = path.read_bytes()
        with resuming(), pytest.warns(UserWarning, match=r"changed training settings \(auto strategy's token_chunks: "
                                                         r"2 -> 1\): the run goes on, but will not match"):
            resumed, _, _ = train_node(model, dataset, spec, auto, **kw)
        assert resumed.step == 4 and len(resumed.losses) == 4
        path.write_bytes(saved)  # interrupted again; now queued again in ComfyUI
        notes = []
        monkeypatch.setattr(host, "notify", notes.append)
        monkeypatch.setattr(host, "resume_mode", lambda widget=True: "same run")
        anew, _, _ = train_node(model, dataset, spec, auto, **kw)
    assert anew.step == 4 and any("trains from its input, not from its saved state: auto strategy's token_chunks: "
                                  "2 -> 1; the file is replaced" in n for n in notes), notes


class _HostInterrupt(Exception):
    """Stands in for ComfyUI's InterruptProcessingException, which its ops raise inside a step."""


def test_an_interrupt_raised_inside_a_step_ends_the_node_as_interrupted(out, monkeypatch):
    """ComfyUI checks its interrupt flag before every op and raises mid-forward (taking the flag), so the Train node's
    between-steps check never saw it: the run ended by that exception, and the node never said where its LoRA was.
    Now the step in flight is dropped, the last completed step saved, and the node reports it and ends the prompt as
    interrupted; queued again it goes on to the uninterrupted LoRA."""
    from tightrope.memory.runtime import MemoryRuntime
    model, dataset, spec, strat = world(out)
    kw = dict(steps=5, save_every=0)
    with torch.inference_mode():
        whole, _, _ = train_node(model, dataset, spec, strat, filename_prefix="rt/whole", **kw)
        real_start_step, started, notes = MemoryRuntime.start_step, [], []

        def start_step(self, *args, **kwargs):
            started.append(1)
            real_start_step(self, *args, **kwargs)
            if len(started) == 4:  # in step 4, before its forward ends
                raise _HostInterrupt()
        monkeypatch.setattr(MemoryRuntime, "start_step", start_step)
        monkeypatch.setattr(host, "interrupt_exceptions", lambda: (_HostInterrupt,))
        monkeypatch.setattr(host, "notify", notes.append)
        with pytest.raises(KeyboardInterrupt):  # headless, the node ends the run as a Ctrl-C would
            train_node(model, dataset, spec, strat, **kw)
        assert " interrupted at step 3: its LoRA is saved in '" in notes[-1]
        assert load_state(state_path(host.state_dir(), "rt/lora")).step == 3
        monkeypatch.setattr(MemoryRuntime, "start_step", real_start_step)
        with resuming():
            resumed, _, _ = train_node(model, dataset, spec, strat, **kw)
    assert resumed.step == 5 and resumed.losses == whole.losses
    assert all(torch.equal(resumed.lora_state[k], v) for k, v in whole.lora_state.items())

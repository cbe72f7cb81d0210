"""A continued or resumed session whose optimizer or LoRA algorithm changed is refused before training, naming the
setting; a changed weight decay is applied; an update cut short by an error or a stop saves no weights of no step."""
import dataclasses
import json
import warnings

import pytest
import torch
from demo_setup import demo_session
from reliability_kit import train_node, world

from tightrope.training import trainer
from tightrope.training.lora.layers import LoraError
from tightrope.training.schedule_free import TRAIN_WEIGHTS
from tightrope.training.state.resume import NotThisRun, ResumeError, load_state, resume_session, state_path
from tightrope.training.train_config import ConfigError
from tightrope.training.trainer import SaveTarget, train

CPU = torch.device("cpu")


def _saved_run(tmp_path, **config):
    session = demo_session(tmp_path, **config)
    train(session, 1, device=CPU, save=SaveTarget(tmp_path / "out", "run", every=1))
    return session, state_path(tmp_path / "out", "run")


def test_resume_refuses_another_lora_algorithm(tmp_path):
    session, path = _saved_run(tmp_path)
    with pytest.raises(LoraError, match=r"run\.state\.safetensors' was trained with LoRA algorithm='lora' "
                                        r"\(now 'loha'\): set the LoRA Setup back"):
        resume_session(path, session.advanced(lora=dataclasses.replace(session.lora, algorithm="loha")))


def test_resume_refuses_another_optimizer(tmp_path):
    """Another optimizer's state loads without complaint and fails at its first step (a KeyError or TypeError deep in
    the optimizer): refused here instead, naming the setting."""
    session, path = _saved_run(tmp_path)
    changed = session.advanced(config=dataclasses.replace(session.config, optimizer="adafactor"))
    with pytest.raises(ResumeError, match=r"was trained with optimizer='adamw' \(now 'adafactor'\).*set optimizer "
                                          r"back to 'adamw' to resume"):
        resume_session(path, changed)


def test_a_continued_session_refuses_another_optimizer_before_training(out):
    model, dataset, spec, strat = world(out)
    first, _, _ = train_node(model, dataset, spec, strat, steps=1)
    calls = []
    real = trainer.train
    trainer.train = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        with pytest.raises(ConfigError, match=r"sets optimizer='adafactor', but its session was trained with "
                                              r"'adamw'.*set optimizer to 'adamw' to continue"):
            train_node(session=first, steps=1, optimizer="adafactor")
    finally:
        trainer.train = real
    assert calls == []


def test_a_continued_session_trains_with_its_new_weight_decay(tmp_path):
    """Loading an optimizer state restores its groups' hyperparameters: the new node's weight decay must win."""
    session = demo_session(tmp_path, weight_decay=0.0)
    first = train(session, 1, device=CPU)
    assert first.optimizer_state["param_groups"][0]["weight_decay"] == 0.0
    second = train(first.advanced(config=dataclasses.replace(first.config, weight_decay=0.5)), 1, device=CPU)
    assert second.optimizer_state["param_groups"][0]["weight_decay"] == 0.5


@pytest.mark.parametrize("every", [2, 0], ids=["saved every 2 steps", "no periodic save"])
def test_an_error_after_the_update_saves_nothing_under_the_previous_step(tmp_path, monkeypatch, every):
    """An out-of-memory error raised inside the optimizer's 3rd step, after it changed the weights: no file may hold
    step 3's weights labelled step 2 (a resume would apply step 3 twice). The periodic save of step 2 stays."""
    session = demo_session(tmp_path)
    two = train(session, 2, device=CPU)
    real = trainer.make_optimizer

    def make(*a, **k):
        opt, calls = real(*a, **k), []
        step = opt.step

        def failing(*x, **y):
            calls.append(1)
            out = step(*x, **y)
            if len(calls) == 3:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated, after the update)")
            return out
        opt.step = failing
        return opt
    monkeypatch.setattr(trainer, "make_optimizer", make)
    save = SaveTarget(tmp_path / "out", "run", every=every)
    kept = "the LoRA and training state of step 2 are saved" if every else \
        "step 3's update was cut short, so nothing new was saved"
    with pytest.raises(trainer.TrainingOutOfMemoryError, match=rf"in step 3 \(.*\); memory was freed and {kept}"):
        train(session, 4, device=CPU, save=save)
    path = state_path(save.folder, "run")
    if not every:
        assert not path.exists() and not list(save.folder.glob("*.safetensors"))
        return
    state = load_state(path)
    assert state.step == 2
    assert all(torch.equal(state.lora_state[k], v) for k, v in two.lora_state.items())
    assert {int(s["step"]) for s in state.optimizer_state["state"].values()} == {2}


def test_a_stop_inside_schedule_free_eval_keeps_the_exact_train_weights(tmp_path, monkeypatch):
    """schedulefree's eval() moves the weights one parameter at a time: a stop landing half-way (here during the
    save of step 2) must still leave, and let the failure save write, the exact train weights of step 2."""
    import schedulefree
    session = demo_session(tmp_path, optimizer="adamw_schedulefree")
    two = train(session, 2, device=CPU)
    real_eval, calls = schedulefree.AdamWScheduleFree.eval, []

    @torch.no_grad()
    def eval_cut(self):
        calls.append(1)
        if len(calls) == 1:  # one parameter moved, then the stop
            group = self.param_groups[0]
            p = group["params"][0]
            p.lerp_(self.state[p]["z"], 1 - 1 / group["betas"][0])
            raise KeyboardInterrupt
        return real_eval(self)
    monkeypatch.setattr(schedulefree.AdamWScheduleFree, "eval", eval_cut)
    save = SaveTarget(tmp_path / "out", "run", every=2)
    with pytest.raises(KeyboardInterrupt):
        train(session, 4, device=CPU, save=save)
    state = load_state(state_path(save.folder, "run"))
    assert state.step == 2
    for i, v in two.optimizer_state["state"].items():
        assert torch.equal(state.optimizer_state["state"][i][TRAIN_WEIGHTS], v[TRAIN_WEIGHTS])
    assert all(torch.equal(state.lora_state[k], v) for k, v in two.lora_state.items())


def test_an_auto_strategy_probes_the_model_only_after_the_cheap_input_checks(tmp_path, monkeypatch):
    """`auto` loads and runs the model to plan: a validation split that holds out nothing must fail before that."""
    from tightrope.training import auto_plan, training_run
    from tightrope.training.strategy_choice import AutoStrategy
    from tightrope.training.train_config import TrainConfig
    session = demo_session(tmp_path)
    monkeypatch.setattr(auto_plan, "plan_for_session", lambda *a, **k: pytest.fail("the probe ran first"))
    from tightrope.training.data.image_folder import DatasetError
    with pytest.raises(DatasetError, match=r"validation_fraction=0.01 of \d+ images holds out 0 images"):
        training_run.run_training_node(
            TrainConfig(validation_fraction=0.01, batch_size=2), 2, session=None, model=session.model,
            dataset=session.dataset, lora=session.lora, strategy=AutoStrategy(), device="cpu", save_dir=tmp_path / "o",
            filename_prefix="x", save_every=0, progress=None, should_stop=None)


def test_a_batch_larger_than_what_validation_leaves_names_validation_fraction(tmp_path):
    session = demo_session(tmp_path, validation_fraction=0.75, batch_size=2)  # 8 images: 2 left to train on
    from tightrope.training.data.image_folder import DatasetError
    with pytest.raises(DatasetError, match=r"batch_size=4 is larger than the 2 items \(after repeats\) left to train "
                                           r"on once validation_fraction=0.75 held out 6 of 8 images: lower "
                                           "validation_fraction or batch_size"):
        train(session.advanced(config=dataclasses.replace(session.config, batch_size=4)), 1, device=CPU)


def test_a_continued_node_holding_out_a_fraction_does_not_inherit_the_validation_dataset(tmp_path):
    """Node 1 validates on a second dataset; node 2, continuing, holds out validation_fraction of its own images and
    has no validation_dataset input: it validates on its held-out images (it used to fail with "disconnect
    validation_dataset", an input it does not have)."""
    from tightrope.training import training_run
    from tightrope.training.train_config import TrainConfig
    session = demo_session(tmp_path)
    common = dict(dataset=None, lora=None, strategy=None, device="cpu", save_dir=tmp_path / "o", filename_prefix="x",
                  save_every=0, progress=None, should_stop=None)
    first, _, _ = training_run.run_training_node(
        TrainConfig(batch_size=2), 1, session=None, model=session.model,
        **common | dict(dataset=session.dataset, lora=session.lora), validation_dataset=session.dataset)
    assert first.validation_dataset is session.dataset
    second, _, _ = training_run.run_training_node(TrainConfig(batch_size=2, validation_fraction=0.25), 1,
                                                  session=first, model=None, **common)
    assert second.step == 2 and second.validation_dataset is None and len(second.validation_losses) >= 1


def _as_before_timestep_ranges(path):
    """The state file as a version before timestep_min/max wrote it: its config without them."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    with safe_open(str(path), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    info = json.loads(meta["tightrope.resume_state"])
    for key in ("timestep_min", "timestep_max"):
        del info["config"][key]
    save_file(tensors, str(path), {**meta, "tightrope.resume_state": json.dumps(info)})


@pytest.mark.parametrize("before", [False, True], ids=["state with a range", "state from before ranges"])
def test_a_changed_timestep_range_is_a_changed_setting(tmp_path, before):
    """The resume check compares the range like any setting; a state file written before the range existed was
    trained on every timestep (0..1): resumed at 0..1 it is the same run, at another range it is not."""
    session, path = _saved_run(tmp_path)
    if before:
        _as_before_timestep_ranges(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "changed training settings" warning: the same run
        resume_session(path, session, same_run=True)
    ranged = session.advanced(config=dataclasses.replace(session.config, timestep_min=0.875))
    with pytest.raises(NotThisRun, match=r"timestep_min: 0\.0 -> 0\.875"):
        resume_session(path, ranged, same_run=True)
    with pytest.warns(UserWarning, match=r"changed training settings \(timestep_min: 0\.0 -> 0\.875\)"):
        resume_session(path, ranged)

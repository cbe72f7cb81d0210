"""Optimizers: each one steps, and a run interrupted at step k and resumed from its state file equals the
uninterrupted run bit for bit (CPU fp32); schedule-free's two weight sets; missing packages fail before training."""
import math
import sys

import pytest
import torch
from demo_setup import demo_session

from tightrope.nodes.train_node import TightropeTrain
from tightrope.training.lora.layers import LoraSpec
from tightrope.training.optimizer import (CHOICES, learning_rate_at, load_optimizer_state, make_optimizer,
                                          optimizer_class)
from tightrope.training.state.resume import load_state, resume_session, state_path
from tightrope.training.schedule_free import TRAIN_WEIGHTS, eval_weights, trained_states
from tightrope.training.train_config import OPTIMIZERS, ConfigError, TrainConfig
from tightrope.training.trainer import SaveTarget, train

CPU = torch.device("cpu")
# learning rates each optimizer is used with (Prodigy scales its own step size by lr: 1.0 is its normal value)
CPU_OPTIMIZERS = {"adamw": 1e-3, "adafactor": 1e-3, "prodigy": 1.0, "adamw_schedulefree": 1e-3}


def _needs(name):
    package = CHOICES[name].package
    if package:
        pytest.importorskip(package, reason=f"optimizer {name!r} needs `pip install {package}` (not installed here)")


def _stop_at(step):
    def progress(done, total, loss):
        if done == step:
            raise KeyboardInterrupt
    return progress


def test_every_optimizer_has_a_class_entry():
    assert set(CHOICES) == set(OPTIMIZERS)


@pytest.mark.parametrize("name", CPU_OPTIMIZERS)
def test_optimizer_steps_and_resumes_exactly(name, tmp_path):
    _needs(name)
    session = demo_session(tmp_path, optimizer=name, learning_rate=CPU_OPTIMIZERS[name], ema_decay=0.5)
    whole = train(session, 3, device=CPU)
    assert whole.lora_state.keys() and any(not torch.equal(v, torch.zeros_like(v)) for k, v in
                                           whole.lora_state.items() if ".lora_B." in k)  # it stepped (B starts at 0)
    save = SaveTarget(tmp_path / "out", "run")
    with pytest.raises(KeyboardInterrupt):
        train(session, 3, device=CPU, save=save, progress=_stop_at(2))  # (schedule-free: after 1 step x == y)
    path = state_path(save.folder, save.filename_prefix)
    assert load_state(path).step == 2
    resumed, state = resume_session(path, session)
    done = train(resumed, 1, device=CPU, run_start=state.run_start)
    assert done.losses == whole.losses
    for mine, theirs in ((done.lora_state, whole.lora_state), (done.ema_state, whole.ema_state)):
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], v) for k, v in theirs.items())
    for i, entry in whole.optimizer_state["state"].items():
        for key, value in entry.items():
            same = torch.equal(done.optimizer_state["state"][i][key], value) if isinstance(value, torch.Tensor) \
                else done.optimizer_state["state"][i][key] == value
            assert same, (i, key)
    assert done.optimizer_state["param_groups"] == whole.optimizer_state["param_groups"]


def test_schedule_free_sessions_hold_its_eval_weights(tmp_path):
    schedulefree = pytest.importorskip("schedulefree", reason="needs `pip install schedulefree` (not installed here)")
    result = train(demo_session(tmp_path, optimizer="adamw_schedulefree"), 2, device=CPU)
    # rebuild the optimizer at its train weights y and let the library itself compute the eval weights x
    names = list(result.lora_state)
    params = [torch.nn.Parameter(result.optimizer_state["state"][i][TRAIN_WEIGHTS].clone()) for i in range(len(names))]
    opt = schedulefree.AdamWScheduleFree(params, lr=1e-3)
    opt.load_state_dict(result.optimizer_state)
    for p in params:
        p.data.copy_(opt.state[p].pop(TRAIN_WEIGHTS))
    assert opt.param_groups[0]["train_mode"]
    opt.eval()
    assert all(torch.equal(result.lora_state[n], p.detach()) for n, p in zip(names, params))
    assert not all(torch.equal(result.lora_state[n], result.optimizer_state["state"][i][TRAIN_WEIGHTS])
                   for i, n in enumerate(names))  # x and y differ: the session does not hold the train weights


def test_eval_weights_restores_the_exact_train_weights_even_on_error():
    schedulefree = pytest.importorskip("schedulefree", reason="needs `pip install schedulefree` (not installed here)")
    p = torch.nn.Parameter(torch.randn(4, 3, generator=torch.Generator().manual_seed(0)))
    opt = schedulefree.AdamWScheduleFree([p], lr=0.1)
    opt.train()
    for _ in range(3):
        p.grad = torch.ones_like(p)
        opt.step()
    y = p.detach().clone()
    with pytest.raises(RuntimeError, match="mid-save"), eval_weights(opt):
        assert not torch.equal(p, y)  # the eval weights inside
        raise RuntimeError("mid-save")
    assert torch.equal(p, y) and opt.param_groups[0]["train_mode"]  # bit for bit, train mode again
    module = torch.nn.Module()
    module.w = p
    _, state = trained_states(module, opt)  # plain modules have no LoRA layers: only the optimizer part matters
    assert torch.equal(state["state"][0][TRAIN_WEIGHTS], y) and torch.equal(p, y)


@pytest.mark.parametrize("name", ["prodigy", "adamw_schedulefree", "adamw8bit"])
def test_a_missing_package_is_a_one_line_install_hint_before_training(name, tmp_path, monkeypatch):
    package = CHOICES[name].package
    monkeypatch.setitem(sys.modules, CHOICES[name].module, None)  # `import` now raises ImportError
    monkeypatch.setitem(sys.modules, package, None)
    with pytest.raises(ConfigError, match=rf"optimizer='{name}' needs the {package} package: `pip install "
                                          rf"{package}`.*or choose optimizer='adamw'"):
        optimizer_class(name, CPU)
    problem = TightropeTrain.VALIDATE_INPUTS(optimizer=name, device="cpu")
    assert f"pip install {package}" in problem and "\n" not in problem
    session = demo_session(tmp_path, optimizer=name)
    with pytest.raises(ConfigError, match=f"pip install {package}"):
        train(session, 1, device=CPU, save=SaveTarget(tmp_path / "out", "run"))
    assert not (tmp_path / "out").exists()  # nothing ran: no LoRA, no state file


def test_unknown_optimizer_and_schedule_free_with_a_schedule_are_config_errors():
    with pytest.raises(ConfigError, match="optimizer='lion' is not supported: choose one of adamw, adamw8bit"):
        TrainConfig(optimizer="lion")
    with pytest.raises(ConfigError, match="optimizer='lion' is not supported"):
        optimizer_class("lion", CPU)
    with pytest.raises(ConfigError, match="replaces the learning-rate schedule.*set schedule='constant'"):
        TrainConfig(optimizer="adamw_schedulefree", schedule="cosine")
    assert "set schedule='constant'" in TightropeTrain.VALIDATE_INPUTS(optimizer="adamw_schedulefree",
                                                                         schedule="cosine")


def test_warmup_reaches_the_learning_rate_and_cosine_decays_after_it():
    """The cosine used to start at the run's first step, during the warmup, so the set rate was never reached (a
    warmup of 100 of 1000 steps peaked at 0.976 of it, 500 of 1000 at 0.525)."""
    cfg = TrainConfig(learning_rate=1e-4, schedule="cosine", warmup_steps=100, min_lr_ratio=0.0)
    lrs = [learning_rate_at(cfg, s, 0, 1000) for s in range(1000)]
    assert max(lrs) == lrs[99] == lrs[100] == 1e-4 and lrs[0] == pytest.approx(1e-6)
    # 900 decay steps: step 550 is the middle (cos = 0), the last step, 999, one 900th before the minimum, which the
    # step after the run would have: the last step still updates (it once had lr 0, a wasted step every run)
    assert lrs[550] == pytest.approx(0.5e-4, rel=1e-12) and learning_rate_at(cfg, 1000, 0, 1000) == 0.0
    assert lrs[-1] == pytest.approx(1e-4 * 0.5 * (1 - math.cos(math.pi / 900)), rel=1e-9) and lrs[-1] > 0
    assert all(a <= b for a, b in zip(lrs[:100], lrs[1:101])) and all(a >= b for a, b in zip(lrs[100:], lrs[101:]))
    # a chained node after the warmup: its own cosine over its steps, to min_lr_ratio just after its last
    second = [learning_rate_at(cfg, s, 1000, 10) for s in range(1000, 1010)]
    assert second[0] == 1e-4 and second[-1] == pytest.approx(1e-4 * 0.5 * (1 - math.cos(math.pi / 10)), rel=1e-9)
    floor = TrainConfig(learning_rate=1e-4, schedule="cosine", min_lr_ratio=0.1)
    assert learning_rate_at(floor, 9, 0, 10) > 1e-5 and learning_rate_at(floor, 10, 0, 10) == pytest.approx(1e-5)
    # a run shorter than its warmup only warms up
    assert [learning_rate_at(cfg, s, 0, 4) for s in range(4)] == pytest.approx([1e-6, 2e-6, 3e-6, 4e-6])


def test_adafactor_steps_by_the_learning_rate_from_a_zero_weight():
    """LoRA's B starts at 0; PyTorch's Adafactor scaled its step by max(1e-3, RMS(B)), so at learning_rate 1e-4 B
    moved by 1e-7. A 1-D weight's first step is sign(grad) * lr exactly (v = grad^2 at step 1, the update's RMS is 1,
    so d=1 does not clip): every element moves by lr, to fp32 rounding. A 2-D weight's second moment is factored
    (rows x columns), so its elements differ, but the step's RMS is at most lr (d=1 clips at 1) and of its order."""
    g = torch.Generator().manual_seed(0)
    vector, matrix = torch.nn.Parameter(torch.zeros(8)), torch.nn.Parameter(torch.zeros(8, 4))
    optimizer = make_optimizer({"vector": vector, "matrix": matrix}, TrainConfig(learning_rate=1e-4, optimizer="adafactor"), CPU)
    vector.grad, matrix.grad = torch.randn(8, generator=g), torch.randn(8, 4, generator=g)
    optimizer.step()
    torch.testing.assert_close(vector.detach(), -1e-4 * vector.grad.sign(), rtol=1e-5, atol=0)
    rms = matrix.detach().pow(2).mean().sqrt().item()
    assert 0.3e-4 < rms <= 1e-4 * (1 + 1e-5)


@pytest.mark.parametrize("warmup,safeguard", [(0, False), (10, True)])
def test_prodigy_guards_its_step_size_estimate_during_a_warmup(warmup, safeguard):
    """Prodigy's README: use safeguard_warmup=True with a warmup, else its step-size estimate d overshoots."""
    _needs("prodigy")
    p = torch.nn.Parameter(torch.zeros(3))
    opt = make_optimizer({"p": p}, TrainConfig(optimizer="prodigy", learning_rate=1.0, warmup_steps=warmup), CPU)
    assert opt.param_groups[0]["safeguard_warmup"] is safeguard


def _dora_session(tmp_path, **config):
    session = demo_session(tmp_path, weight_decay=0.5, **config)
    return session.advanced(lora=LoraSpec(rank=4, targets="attention_mlp", algorithm="dora"))


def test_dora_magnitudes_are_never_decayed():
    """Weight decay pulls LoRA's A and B toward 0 (the base model); a DoRA magnitude starts at |W_i|, so decaying it
    shrank every adapted layer's output row by lr * weight_decay a step. With no gradient, AdamW moves a weight by
    its decay alone: the magnitude stays, lora_A shrinks by exactly (1 - lr * wd)."""
    a = torch.nn.Parameter(torch.ones(2, 3))
    m = torch.nn.Parameter(torch.full((2,), 5.0))
    names = {"layer.lora_A.default.weight": a, "layer.lora_magnitude_vector.default.weight": m}
    opt = make_optimizer(names, TrainConfig(learning_rate=0.1, weight_decay=0.5), CPU)
    a.grad, m.grad = torch.zeros_like(a), torch.zeros_like(m)
    opt.step()
    assert torch.equal(m, torch.full((2,), 5.0)) and torch.allclose(a, torch.full((2, 3), 0.95), rtol=0, atol=1e-7)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.5, 0.0]


def test_a_dora_run_resumes_exactly_with_its_undecayed_magnitudes(tmp_path):
    session = _dora_session(tmp_path)
    whole = train(session, 3, device=CPU)
    assert [g["weight_decay"] for g in whole.optimizer_state["param_groups"]] == [0.5, 0.0]
    save = SaveTarget(tmp_path / "out", "run")
    with pytest.raises(KeyboardInterrupt):
        train(session, 3, device=CPU, save=save, progress=_stop_at(2))
    resumed, state = resume_session(state_path(save.folder, save.filename_prefix), session)
    done = train(resumed, 1, device=CPU, run_start=state.run_start)
    assert done.losses == whole.losses and all(torch.equal(done.lora_state[k], v) for k, v in whole.lora_state.items())


def test_a_state_saved_with_one_param_group_is_regrouped_on_load(tmp_path):
    """States saved before magnitudes had a group of their own: each weight's moments follow it to its new index."""
    named = {n: torch.nn.Parameter(torch.randn(3, generator=torch.Generator().manual_seed(i)))
             for i, n in enumerate(["x.lora_A.default.weight", "x.lora_magnitude_vector.default.weight",
                                    "y.lora_A.default.weight", "y.lora_magnitude_vector.default.weight"])}
    old = torch.optim.AdamW(list(named.values()), lr=0.1, weight_decay=0.5)  # what the old code made
    for p in named.values():
        p.grad = p.detach() * 2
    old.step()
    moments = {n: old.state[p]["exp_avg"].clone() for n, p in named.items()}
    new = make_optimizer(named, TrainConfig(learning_rate=0.1, weight_decay=0.25), CPU)
    load_optimizer_state(new, old.state_dict(), list(named), 0.25)
    assert all(torch.equal(new.state[p]["exp_avg"], moments[n]) for n, p in named.items())
    assert [(len(g["params"]), g["weight_decay"]) for g in new.param_groups] == [(2, 0.25), (2, 0.0)]

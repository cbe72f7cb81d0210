"""What torchrun ranks must agree on before they train: whether and from which state a node resumes, and an `auto`
strategy's plan. Two ranks run as threads of this process (fake_ranks.py: their object collectives are real
exchanges, a collective one rank skips is an error, not a hang); the models are the demo's, training is left out."""
import re
import shutil

import pytest
import torch
from demo_setup import demo_session
from fake_ranks import run_ranks

from tightrope.demo.model import demo_model
from tightrope.memory import planner
from tightrope.memory.host_memory import HostNeeds
from tightrope.memory.plan_cost import predict
from tightrope.memory.profile import Profile
from tightrope.memory.strategy import Strategy
from tightrope.training import auto_plan, distributed, training_run
from tightrope.training.distributed import DistributedError
from tightrope.training.state.resume import ResumeError, load_state, state_path
from tightrope.training.strategy_choice import AutoStrategy

FP32 = Strategy.of(compute_dtype="fp32")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return demo_session(tmp_path_factory.mktemp("demo"))


def node(session, state_dir, *, resume, model=None, progress=None, should_stop=None):
    """The Train node "7" of a 2-step run, its state in `state_dir`."""
    return training_run.run_training_node(
        session.config, 2, session=None, model=model or session.model, dataset=session.dataset, lora=session.lora,
        strategy=FP32, device="cpu", save_dir=state_dir.parent / "loras", filename_prefix="x", save_every=0,
        progress=progress, should_stop=should_stop, resume=resume, state_dir=state_dir, node_id="7")


@pytest.fixture(scope="module")
def state_files(demo, tmp_path_factory):
    """The node's state file after its step 1 (stopped there) and after step 2 (finished), and a damaged one."""
    folder = tmp_path_factory.mktemp("states")
    run, done = folder / "run", []
    node(demo, run, resume="off", progress=lambda d, t, loss: done.append(d), should_stop=lambda: len(done) >= 1)
    files = {"step 1": folder / "step1.safetensors", "step 2": folder / "step2.safetensors",
             "damaged": folder / "damaged.safetensors"}
    shutil.copy(state_path(run, "x", "7"), files["step 1"])
    node(demo, run, resume="asked")
    shutil.copy(state_path(run, "x", "7"), files["step 2"])
    files["damaged"].write_bytes(files["step 2"].read_bytes()[:300])
    assert (load_state(files["step 1"]).step, load_state(files["step 2"]).step) == (1, 2)
    return files


class Trained(Exception):
    """Raised instead of training: which step a rank would train from, and how many steps."""


def outcome(result) -> tuple:
    """A rank's result, comparable: ("trains", from step, steps), ("finished", step) or (error type, message)."""
    kind, value = result
    if kind == "ok":
        return "finished", value[0].step
    return ("trains", *value.args) if isinstance(value, Trained) else (type(value).__name__, str(value))


def resume_on_two_ranks(monkeypatch, tmp_path, demo, state_files, files):
    """Rank r resumes node 7 with `files[r]` (a key of state_files, or None: no file) in its own --output-dir."""
    def fake_train(session, steps, **kw):
        raise Trained(session.step, steps)
    monkeypatch.setattr(training_run, "train", fake_train)
    dirs = [tmp_path / f"rank{rank}" for rank in range(2)]
    for folder, name in zip(dirs, files):
        if name is not None:
            state_path(folder, "x", "7").parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(state_files[name], state_path(folder, "x", "7"))
    models = [demo_model() for _ in dirs]  # a model each: the ranks must not patch one module at once
    return run_ranks(monkeypatch, 2, lambda rank: node(demo, dirs[rank], resume="asked", model=models[rank]))


def test_ranks_with_the_same_file_resume_the_same_step(monkeypatch, tmp_path, demo, state_files):
    results = resume_on_two_ranks(monkeypatch, tmp_path, demo, state_files, ["step 1", "step 1"])
    assert [outcome(r) for r in results] == [("trains", 1, 1)] * 2  # from step 1, the 1 step left
    finished = resume_on_two_ranks(monkeypatch, tmp_path / "b", demo, state_files, ["step 2", "step 2"])
    assert [outcome(r) for r in finished] == [("finished", 2)] * 2
    assert finished[0][1][2] == finished[1][1][2]  # the node's report


@pytest.mark.parametrize("files,problem", [
    (["step 2", None], "does not exist"),
    (["step 2", "step 1"], r"is not rank 0's \(it holds step 1\)"),
    (["step 2", "damaged"], r"cannot be used \(training state file '.*' could not be read"),
])
def test_a_rank_without_rank_0s_state_stops_every_rank(monkeypatch, tmp_path, demo, state_files, files, problem):
    """Rank 0 resumes step 2; rank 1's --output-dir (not shared, or a file not yet visible there, or damaged) has
    no such state: rank 1 says why, rank 0 stops with one line naming it. Before, rank 1 trained from step 0 or 1
    while rank 0 had finished, and its first collective waited forever."""
    (kind0, error0), (kind1, error1) = resume_on_two_ranks(monkeypatch, tmp_path, demo, state_files, files)
    assert kind0 == kind1 == "error" and type(error1) is ResumeError and type(error0) is DistributedError
    file = state_path(tmp_path / "rank1", "x", "7")
    ours = f"rank 1 cannot resume step 2 as rank 0 does: its training state file '{file}' "
    assert str(error1).startswith(ours) and re.match(problem, str(error1)[len(ours):])
    assert str(error1).endswith("; every rank reads the training state in its --output-dir: put that folder on a file "
                                "system every machine shares (or copy rank 0's file to every machine), or run without "
                                "--resume")
    assert str(error0).startswith("rank 1 failed (ResumeError: rank 1 cannot resume step 2 as rank 0 does")
    assert str(error0).endswith("so rank 0 stops too: see rank 1's output")


def test_rank_0_decides_to_start_anew_and_so_does_every_rank(monkeypatch, tmp_path, demo, state_files):
    results = resume_on_two_ranks(monkeypatch, tmp_path, demo, state_files, [None, "step 2"])
    assert [outcome(r) for r in results] == [("trains", 0, 2)] * 2


def test_a_damaged_file_on_rank_0_stops_every_rank(monkeypatch, tmp_path, demo, state_files):
    (_, error0), (_, error1) = resume_on_two_ranks(monkeypatch, tmp_path, demo, state_files, ["damaged", "step 2"])
    assert type(error0) is ResumeError and "could not be read" in str(error0)
    assert type(error1) is DistributedError
    assert str(error1).startswith("rank 0 failed (ResumeError: training state file ")
    assert str(error1).endswith("so rank 1 stops too: see rank 0's output")


# ------------------------------------------------------------------------------------------------ the auto plan
MiB = 1 << 20


def profile(activation_scale: int = 1, n: int = 4) -> Profile:
    """A probe's figures for 4 blocks of 64 MiB, in whole MiB (a real probe's timings would vary run to run)."""
    return Profile(device="cpu", batch=1, block_names=[f"blocks.{i}" for i in range(n)], block_types=["Block"] * n,
                   block_frozen=[64 * MiB] * n, block_packed=[64 * MiB] * n, block_trainable=[MiB] * n,
                   other_weight_bytes=8 * MiB, trainable_bytes=4 * MiB, trainable_numel=MiB,
                   act_full=[32 * MiB * activation_scale] * n, act_ckpt=[4 * MiB * activation_scale] * n,
                   act_shared=MiB, act_other=8 * MiB, fwd_s=[0.01] * n, bwd_s=[0.02] * n, other_s=0.01,
                   h2d_bytes_per_s=10e9)


def plan_on_two_ranks(monkeypatch, demo, probes, free):
    """Rank r plans `auto` with its own probe `probes[r]` and `free[r]` bytes of free device memory."""
    def rank() -> int:
        return distributed.current().rank
    monkeypatch.setattr(auto_plan, "probe_model", lambda *a, **k: probes[rank()])
    monkeypatch.setattr(planner, "auto_budget", lambda device: free[rank()])
    monkeypatch.setattr(planner, "reads_free_memory", lambda device: True)
    monkeypatch.setattr(auto_plan, "host_needs", lambda *a: HostNeeds(1 << 40, 0, 0, [0] * probes[0].n_blocks))
    sessions = [demo.advanced(model=demo_model()) for _ in range(2)]
    return run_ranks(monkeypatch, 2, lambda r: auto_plan.plan_for_session(sessions[r], AutoStrategy(),
                                                                          torch.device("cpu")))


def test_ranks_with_different_free_memory_train_one_plan(monkeypatch, demo):
    """Rank 0 has 2 GiB free, rank 1 300 MiB: alone, rank 0 would keep every block on the device and rank 1 offload
    most of them. Both train rank 0's plan for the smaller budget, with the same explanation."""
    alone = [planner.plan(profile(), budget).strategy for budget in (2048 * MiB, 300 * MiB)]
    assert alone[0] != alone[1]
    (kind0, plan0), (kind1, plan1) = plan_on_two_ranks(monkeypatch, demo, [profile()] * 2, [2048 * MiB, 300 * MiB])
    assert kind0 == kind1 == "ok" and plan0 == plan1
    assert plan0[0] == alone[1]
    assert "of your 300.0 MiB" in plan0[1]
    assert plan0[1].endswith("Planned by rank 0 for all 2 ranks, for the smallest budget.")


def test_a_plan_that_does_not_fit_one_ranks_own_probe_stops_every_rank(monkeypatch, demo):
    """Rank 1 measured more (twice the activations) than rank 0, who planned: each rank checks the plan on its own
    probe and budget, so rank 1 refuses it and rank 0 stops too, instead of rank 1 running out of memory."""
    chosen = planner.plan(profile(), 300 * MiB)
    assert chosen.predicted_peak_bytes <= 300 * MiB < predict(profile(2), chosen.strategy).peak_bytes
    (kind0, error0), (kind1, error1) = plan_on_two_ranks(monkeypatch, demo, [profile(), profile(2)],
                                                         [2048 * MiB, 300 * MiB])
    assert (kind0, kind1, type(error0), type(error1).__name__) == ("error", "error", DistributedError,
                                                                   "StrategyError")
    assert str(error1).startswith("rank 1: the plan rank 0 chose for every rank needs ")
    assert "of cpu by this rank's probe, more than its budget of 300.0 MiB: free that GPU" in str(error1)
    assert str(error0) == f"rank 1 failed (StrategyError: {error1}), so rank 0 stops too: see rank 1's output"

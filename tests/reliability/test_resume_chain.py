"""Resume of chained Train nodes, as in workflows/demo.json (node 7 trains, its session feeds node 8, both with one
filename_prefix): a stop at any step of either node, then --resume, gives the uninterrupted run's LoRA bit for bit
(CPU fp32); a finished run resumes to "nothing to do"; each node's state file names its node and run."""
import contextlib
import json
import os
import shutil
import signal
import warnings
from types import SimpleNamespace

import pytest
import torch
from reliability_kit import dataset_inputs, resuming, train_node, widgets, world
from safetensors.torch import load_file

from tightrope import cli
from tightrope.headless.stop_signals import polite_stops
from tightrope.nodes import host
from tightrope.nodes.strategy_node import TightropeMemoryStrategy
from tightrope.training import trainer, training_run
from tightrope.training.state.resume import ResumeError, load_state, session_digest, state_path

A, B = 3, 3  # steps of nodes 7 and 8; save_every=2: node 7 saves at step 2 and ends at 3, node 8 saves at 4 and 6
SHARED = dict(save_every=2, filename_prefix="rt/chain")
NODE_7 = dict(steps=A, schedule="constant", warmup_steps=2, unique_id="7")
NODE_8 = dict(steps=B, schedule="cosine", learning_rate=2e-3, unique_id="8")  # another schedule and rate than 7


def _chain(model, dataset, spec, strat, node_7=NODE_7, node_8=NODE_8):
    with torch.inference_mode():  # as ComfyUI and the headless runner call nodes
        first = train_node(model, dataset, spec, strat, **SHARED, **node_7)
        second = train_node(session=first[0], **SHARED, **node_8)
    return first, second


def _state(node):
    path = state_path(host.state_dir(), SHARED["filename_prefix"], node)
    return load_state(path) if path.is_file() else None


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@contextlib.contextmanager
def _no_resume_warnings():
    """Nothing changed between the runs: no "changed training settings", "another run" or other state warning."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        yield
    assert [str(w.message) for w in seen if "state" in str(w.message) or "resum" in str(w.message)] == []


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The demo world and the uninterrupted chain's outputs, state files kept in `states`."""
    out = tmp_path_factory.mktemp("whole")
    with host.headless(out):
        parts = world(out)
        first, second = _chain(*parts)
    return parts, first, second, out / ".tightrope_state"


def _stop_at(monkeypatch, step: int, kill: bool) -> None:
    """Ctrl-C after global step `step` (the trainer saves it), or a kill -9 there (nothing saved at the stop)."""
    offsets = iter([0, A])  # the global step each node's progress bar starts from; the nodes run in order

    def reporter(total):
        offset = next(offsets)

        def progress(done, _total, _loss):
            if offset + done == step:
                raise KeyboardInterrupt
        return progress
    monkeypatch.setattr(host, "progress_reporter", reporter)
    if kill:
        monkeypatch.setattr(trainer, "_save_after_failure", lambda *args: None)


# (how, global step of the stop, step of node 7's and node 8's state file left on disk)
STOPS = [("ctrl_c", 2, 2, None),   # in node 7, at one of its saves
         ("ctrl_c", 5, A, 5),      # in node 8, between its saves
         ("kill", 3, 2, None),     # in node 7 one step after its save: its state is older than the stop
         ("kill", 4, A, None),     # node 8's first step: it has no state, node 7's is of its finished run
         ("kill", 5, A, 4)]        # in node 8 right after its save


@pytest.mark.parametrize("how, step, state_7, state_8", STOPS, ids=[f"{s[0]}-at-{s[1]}" for s in STOPS])
def test_a_stop_at_any_step_of_a_chain_resumes_to_the_uninterrupted_lora(built, out, monkeypatch, how, step,
                                                                         state_7, state_8):
    parts, _, (whole, _, _), _ = built
    with monkeypatch.context() as m:
        _stop_at(m, step, kill=how == "kill")
        with pytest.raises(KeyboardInterrupt):
            _chain(*parts)
    assert (_state("7").step, getattr(_state("8"), "step", None)) == (state_7, state_8)
    with resuming(), _no_resume_warnings():
        _, (resumed, _, _) = _chain(*parts)
    assert resumed.step == A + B and resumed.losses == whole.losses  # exactly: every step's loss
    assert _equal(resumed.lora_state, whole.lora_state)
    for k, v in whole.optimizer_state["state"].items():
        assert _equal(resumed.optimizer_state["state"][k], v)


def test_a_finished_chain_resumes_to_its_outputs_without_training(built, out, monkeypatch, capsys):
    parts, first, second, states = built
    shutil.copytree(states, host.state_dir())
    calls = []
    monkeypatch.setattr(training_run, "train", lambda *a, **k: calls.append(a))
    with resuming(), _no_resume_warnings():
        again_first, again_second = _chain(*parts)
    assert calls == []  # no step trained
    for was, now in ((first, again_first), (second, again_second)):
        assert now[2] == was[2]  # the same report
        session, original = now[0], was[0]
        assert (session.step, session.losses, session.stats, session.saved, session.strategy) == \
            (original.step, original.losses, original.stats, original.saved, original.strategy)
        assert _equal(session.lora_state, original.lora_state)
    err = capsys.readouterr().err
    assert "Train node 7 had finished (step 3" in err and "Train node 8 had finished (step 6" in err
    assert err.count("nothing to do") == 2


def test_each_state_file_names_its_node_and_the_session_it_started_from(built):
    _, (first, _, _), _, states = built
    owner_7 = load_state(state_path(states, "rt/chain", "7")).info["owner"]
    owner_8 = load_state(state_path(states, "rt/chain", "8")).info["owner"]
    new_lora = session_digest(SimpleNamespace(step=0, lora_state=None))
    assert owner_7 == {"node": "7", "input_step": 0, "input": new_lora, "note": "", "plan": ""}
    assert owner_8 == {"node": "8", "input_step": A, "input": session_digest(first), "note": "", "plan": ""}


def test_a_state_file_of_another_node_is_refused(built, out):
    parts, _, _, states = built
    (host.state_dir() / "rt").mkdir(parents=True)
    shutil.copy(state_path(states, "rt/chain", "7"), state_path(host.state_dir(), "rt/chain", "7"))
    shutil.copy(state_path(states, "rt/chain", "7"), state_path(host.state_dir(), "rt/chain", "8"))  # renamed
    with resuming(), pytest.raises(ResumeError, match=r"chain\.node-8\.state\.safetensors' belongs to node 7, not "
                                                      r"to this node 8: it must not be resumed here; delete it"):
        _chain(*parts)


def test_a_state_file_of_another_run_of_the_node_is_ignored_with_a_warning(built, out):
    """Node 8's state is of a run whose node 7 trained other weights (here: another learning rate): node 8 must
    train from what node 7 gives now, not go on from the old run."""
    parts, _, (whole, _, _), states = built
    (host.state_dir() / "rt").mkdir(parents=True)
    shutil.copy(state_path(states, "rt/chain", "8"), state_path(host.state_dir(), "rt/chain", "8"))
    with resuming(), pytest.warns(UserWarning, match=r"chain\.node-8\.state\.safetensors' was saved by another run "
                                                     r"of this node: it went on from a session of step 3 with other LoRA "
                                                     r"weights, not from the session of step 3 this node gets now .*: "
                                                     r"it is ignored; this node trains from its input"):
        (first, _, _), (second, _, _) = _chain(*parts, node_7=NODE_7 | {"learning_rate": 3e-3})
    assert second.step == A + B and second.losses[:A] == first.losses and second.losses != whole.losses
    assert _state("8").info["owner"]["input"] == session_digest(first)


def test_resume_with_a_changed_setting_warns_for_that_node_only(built, out, monkeypatch):
    parts, _, _, _ = built
    with monkeypatch.context() as m:
        _stop_at(m, 5, kill=False)
        with pytest.raises(KeyboardInterrupt):
            _chain(*parts)
    with resuming(), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _chain(*parts, node_8=NODE_8 | {"learning_rate": 3e-3})
    changed = [str(w.message) for w in seen if "changed training settings" in str(w.message)]
    assert len(changed) == 1 and "chain.node-8.state" in changed[0] and "(learning_rate: 0.002 -> 0.003)" in changed[0]


def _api_chain() -> dict:
    d = {k: v for k, v in dataset_inputs(folder="x").items() if k not in ("vae", "clip", "folder")}
    strat = {k: v[1]["default"] for k, v in TightropeMemoryStrategy.INPUT_TYPES()["required"].items()}
    train = widgets(**SHARED)
    return {
        "1": {"class_type": "TightropeDemoModel", "inputs": {"seed": 0}},
        "2": {"class_type": "TightropeDemoEncoders", "inputs": {"seed": 0}},
        "3": {"class_type": "TightropeDemoImages", "inputs": {"subfolder": "imgs", "count": 4, "size": 32, "seed": 0}},
        "4": {"class_type": "TightropeLoadDataset", "inputs": d | {"folder": ["3", 0], "vae": ["2", 0],
                                                                   "clip": ["2", 1]}},
        "5": {"class_type": "TightropeLoraSetup", "inputs": {"rank": 4, "alpha": 4.0, "rslora": False, "dropout": 0.0,
                                                             "targets": "attention", "init": "default"}},
        "6": {"class_type": "TightropeMemoryStrategy", "inputs": strat | {"compute_dtype": "fp32"}},
        "7": {"class_type": "TightropeTrain", "inputs": train | {k: v for k, v in NODE_7.items() if k != "unique_id"}
              | {"model": ["1", 0], "dataset": ["4", 0], "lora": ["5", 0], "strategy": ["6", 0]}},
        "8": {"class_type": "TightropeTrain", "inputs": train | {k: v for k, v in NODE_8.items() if k != "unique_id"}
              | {"session": ["7", 0]}},
        "9": {"class_type": "TightropeSaveLora", "inputs": {"session": ["8", 0], "filename_prefix": "rt/final"}},
    }


def test_a_bad_input_in_a_later_node_exits_2_and_names_resume_for_the_nodes_that_finished(tmp_path, monkeypatch,
                                                                                           capsys):
    """Node 8 refused while it runs (bad input: exit 2, one line), after node 7 finished: a run again without
    --resume would train node 7 anew (found by a helper checking the docs), so the report says --resume uses it;
    and --resume, once fixed, does (node 7 trains no step)."""
    from tightrope.training.train_config import ConfigError
    path = tmp_path / "w.json"
    path.write_text(json.dumps(_api_chain()))
    real, calls = training_run.train, []

    def train(session, steps, **kw):
        calls.append(kw["save"].owner.node)
        if kw["save"].owner.node == "8":
            raise ConfigError("batch_size=64 is larger than the dataset: lower batch_size")
        return real(session, steps, **kw)
    with monkeypatch.context() as m:
        m.setattr(training_run, "train", train)
        assert cli.main(["run", str(path), "--output-dir", str(tmp_path / "o")]) == cli.EXIT_WORKFLOW_ERROR
    err = capsys.readouterr().err
    assert "error: node 8 'TightropeTrain' failed: ConfigError: batch_size=64" in err and "Traceback" not in err
    assert "training state kept for 1 Train node(s) (" in err
    assert "chain.node-7.state.safetensors (finished)): once fixed, run again with --resume to go on from it" in err
    calls.clear()
    with monkeypatch.context() as m:
        m.setattr(training_run, "train", lambda session, steps, **kw: (calls.append(kw["save"].owner.node),
                                                                        real(session, steps, **kw))[1])
        assert cli.main(["run", str(path), "--output-dir", str(tmp_path / "o"), "--resume"]) == 0
    assert calls == ["8"]


@pytest.mark.parametrize("change, message", [
    (lambda w: w["8"]["inputs"].update(optimizer="adafactor"),
     "Train node 8 sets optimizer='adafactor', but continues the session of Train node 7, trained with 'adamw', whose "
     "state cannot go on in another optimizer: set optimizer to 'adamw' in node 8"),
    (lambda w: (w["6"]["inputs"].update(optimizer_offload=True), w["7"]["inputs"].update(optimizer="adamw_schedulefree"),
                w["8"]["inputs"].update(optimizer="adamw_schedulefree", schedule="constant")),
     "Train node 7: optimizer='adamw_schedulefree' does not work with optimizer_offload=True"),
    (lambda w: w["6"]["inputs"].update(mode="auto", vram_budget_gb=0.0),
     "Train node 7 trains on device 'cpu' with an auto Memory Strategy whose vram_budget_gb=0 plans for the free GPU "
     "memory, which that device cannot say: set vram_budget_gb"),
])
def test_a_chain_no_single_node_can_check_is_refused_before_any_node_runs(tmp_path, monkeypatch, capsys, change,
                                                                         message):
    """A second Train node in another optimizer, or optimizer offload (given to node 7, inherited by node 8) with one
    that cannot step on the host: refused by `tightrope run` before node 7 trains (it used to fail after it; found by
    a helper checking the docs). Exit 2, one line per node, no traceback."""
    workflow = _api_chain()
    change(workflow)
    path = tmp_path / "w.json"
    path.write_text(json.dumps(workflow))
    calls = []
    monkeypatch.setattr(training_run, "train", lambda *a, **k: calls.append(a))
    assert cli.main(["run", str(path), "--output-dir", str(tmp_path / "o")]) == cli.EXIT_WORKFLOW_ERROR
    err = capsys.readouterr().err
    assert calls == [] and message in err and "Traceback" not in err
    if "offload" in message:  # node 8 trains with node 7's strategy: refused too
        assert "Train node 8: optimizer='adamw_schedulefree' does not work with optimizer_offload=True" in err


def test_a_run_that_fails_mid_node_names_the_state_it_kept(tmp_path, monkeypatch, capsys):
    """Node 7 fails at its third step (as a torchrun rank does when its peer is gone: a RuntimeError, exit 1, the
    traceback): its last completed step was saved, and the report says so and names --resume (found by a helper:
    the surviving rank reported only the bug)."""
    from tightrope.memory.runtime import MemoryRuntime
    path = tmp_path / "w.json"
    path.write_text(json.dumps(_api_chain()))
    real, calls = MemoryRuntime.start_step, []

    def start_step(self, *a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("Connection closed by peer")
        return real(self, *a, **k)
    monkeypatch.setattr(MemoryRuntime, "start_step", start_step)
    assert cli.main(["run", str(path), "--output-dir", str(tmp_path / "o")]) == cli.EXIT_FAILED
    err = capsys.readouterr().err
    assert "Traceback" in err and "RuntimeError: Connection closed by peer" in err
    assert f"chain.node-7.state.safetensors (step 2 of {A})): once fixed, run again with --resume" in err


def test_a_stop_report_counts_a_finished_node_and_keeps_stops_polite_while_it_reports(tmp_path, monkeypatch,
                                                                                     capsys):
    """--resume stopped as node 8 starts, node 7 finished in an earlier run: the report said nothing was saved, and
    a run without --resume then trained node 7 again (found by a helper). And while a stop is reported, a second
    signal still meets the polite handler, not the default one (which ended the process with -15)."""
    from tightrope.headless import stop_signals
    path = tmp_path / "w.json"
    path.write_text(json.dumps(_api_chain()))
    real, handlers = training_run.train, []

    def train(session, steps, **kw):
        if kw["save"].owner.node == "8":
            raise KeyboardInterrupt
        return real(session, steps, **kw)
    real_report = stop_signals.report_stop
    monkeypatch.setattr(stop_signals, "report_stop",
                        lambda *a, **k: (handlers.append(signal.getsignal(signal.SIGTERM)), real_report(*a, **k))[1])
    monkeypatch.setattr(training_run, "train", train)
    assert cli.main(["run", str(path), "--output-dir", str(tmp_path / "o")]) == 130
    for p in (tmp_path / "o").rglob("*.state.safetensors"):
        os.utime(p, (p.stat().st_atime, p.stat().st_mtime - 3600))  # node 7's: an earlier run's
    capsys.readouterr()
    assert cli.main(["run", str(path), "--output-dir", str(tmp_path / "o"), "--resume"]) == 130
    assert "Train nodes saved their last completed step: run again with --resume" in capsys.readouterr().err
    assert handlers and all(h not in (signal.SIG_DFL, signal.default_int_handler) and callable(h) and
                            h.__qualname__.startswith("polite_stops") for h in handlers)


def test_cli_ctrl_c_in_the_second_node_then_resume_twice(tmp_path, monkeypatch, capsys):
    """Through `tightrope run`, which gives each Train node its id: exact after a stop in node 8, then "nothing to
    do" on a finished run (no step trained, the same LoRA saved again)."""
    path = tmp_path / "w.json"
    path.write_text(json.dumps(_api_chain()))

    def run(folder, *extra):
        return cli.main(["run", str(path), "--output-dir", str(tmp_path / folder), *extra])
    assert run("whole") == 0
    with monkeypatch.context() as m:
        _stop_at(m, 5, kill=False)
        assert run("cut") == 130
    with _no_resume_warnings():
        assert run("cut", "--resume") == 0
    capsys.readouterr()
    calls = []
    monkeypatch.setattr(training_run, "train", lambda *a, **k: calls.append(a))
    assert run("cut", "--resume") == 0 and calls == []
    assert capsys.readouterr().err.count("nothing to do") == 2
    whole = load_file(tmp_path / "whole" / "rt" / "final_00001_.safetensors")
    for name in ("final_00001_", "final_00002_"):  # after the resume, and after the resume of the finished run
        assert _equal(load_file(tmp_path / "cut" / "rt" / f"{name}.safetensors"), whole)


def test_without_resume_an_interrupted_run_is_refused_before_any_node_trains(tmp_path, monkeypatch, capsys):
    """`tightrope run` again without --resume after a stop in node 8: it used to train node 7 anew and node 8 from
    the start, and node 8's first save replaced the interrupted run's state (its steps lost, silently; found by a
    helper driving the CLI). Now refused before any node runs, naming --resume; nothing on disk changes. A stop
    before any step completed says nothing was saved; --resume with no state says it trains from the start."""
    path = tmp_path / "w.json"
    path.write_text(json.dumps(_api_chain()))

    def run(folder, *extra):
        return cli.main(["run", str(path), "--output-dir", str(tmp_path / folder), *extra])
    with monkeypatch.context() as m:
        _stop_at(m, 5, kill=False)
        assert run("cut") == 130
    assert "Train nodes saved their last completed step: run again with --resume" in capsys.readouterr().err
    files = {p: p.read_bytes() for p in (tmp_path / "cut").rglob("*") if p.is_file()}
    calls = []
    with monkeypatch.context() as m:
        m.setattr(training_run, "train", lambda *a, **k: calls.append(a))
        assert run("cut") == cli.EXIT_WORKFLOW_ERROR
    err = capsys.readouterr().err
    assert calls == [] and "Traceback" not in err
    assert "error: Train node 8's run was interrupted at step 5 of 6 (saved in " in err
    assert "run again with --resume to go on from it, or delete that file to train from the start" in err
    assert {p: p.read_bytes() for p in (tmp_path / "cut").rglob("*") if p.is_file()} == files
    for p in (tmp_path / "cut").rglob("*.state.safetensors"):
        os.utime(p, (p.stat().st_atime, p.stat().st_mtime - 3600))  # written by an earlier process
    with monkeypatch.context() as m:  # a --resume stopped before its first new step: the interrupted state is kept
        m.setattr(training_run, "train", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
        assert run("cut", "--resume") == 130
    assert "Train nodes saved their last completed step: run again with --resume" in capsys.readouterr().err
    with _no_resume_warnings():
        assert run("cut", "--resume") == 0  # and --resume still goes on from it

    with monkeypatch.context() as m:
        _stop_at(m, 0, kill=False)
        m.setattr(training_run, "train", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
        assert run("early") == 130
    assert "no training step had completed, so nothing was saved to resume from" in capsys.readouterr().err
    other = tmp_path / "shared" / ".tightrope_state" / "another" / "run.node-3.state.safetensors"
    other.parent.mkdir(parents=True)
    shutil.copyfile(next((tmp_path / "cut").rglob("*.node-8.state.safetensors")), other)
    os.utime(other, (other.stat().st_atime, other.stat().st_mtime - 3600))
    with monkeypatch.context() as m:  # another workflow's interrupted state in the same output dir is not this one's
        m.setattr(training_run, "train", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
        assert run("shared") == 130
    assert "no training step had completed, so nothing was saved to resume from" in capsys.readouterr().err
    with monkeypatch.context() as m:
        m.setattr(training_run, "train", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
        assert run("fresh", "--resume") == 130
    assert "Train node 7: --resume found no saved state in " in capsys.readouterr().err


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_during_the_optimizer_step_waits_for_the_step_to_complete(built, out, monkeypatch, signum):
    """The signal arrives right after AdamW has changed the weights of global step 5, before the step is counted:
    without held_stops the save labels the updated weights step 4 and the resume applies step 5's update twice."""
    parts, _, (whole, _, _), _ = built
    real_step, updates = torch.optim.AdamW.step, []

    def step_then_signal(self, *args, **kwargs):
        result = real_step(self, *args, **kwargs)
        updates.append(1)
        if len(updates) == 5:
            os.kill(os.getpid(), signum)  # Python runs the handler at the next bytecode, still inside the update
        return result
    with monkeypatch.context() as m:
        m.setattr(torch.optim.AdamW, "step", step_then_signal)
        with polite_stops(), pytest.raises(KeyboardInterrupt):
            _chain(*parts)
    assert _state("8").step == 5  # the whole of step 5, labelled 5
    with resuming(), _no_resume_warnings():
        _, (resumed, _, _) = _chain(*parts)
    assert resumed.step == A + B and resumed.losses == whole.losses
    assert _equal(resumed.lora_state, whole.lora_state)

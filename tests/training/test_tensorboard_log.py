"""TensorBoard scalars: written and read back with TensorBoard's own reader when the package is installed (skipped
where it is not, as in CI); without it, asking for logs is a one-line error with the install command, before
training, from the trainer, the Train node's input check and `tightrope run --log-dir`."""
import sys

import pytest
import torch
from demo_setup import demo_session

from tightrope import cli
from tightrope.memory.strategy import Strategy
from tightrope.nodes import host
from tightrope.nodes.train_node import TightropeTrain
from tightrope.training.tensorboard_log import summary_writer_class
from tightrope.training.train_config import ConfigError
from tightrope.training.trainer import train

CPU = torch.device("cpu")
INSTALL = "which need the tensorboard package: `pip install tensorboard`"


@pytest.fixture
def no_tensorboard(monkeypatch):
    """`import torch.utils.tensorboard` fails, as it does where the tensorboard package is not installed."""
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)


def test_missing_tensorboard_is_refused_before_training(tmp_path, no_tensorboard):
    with pytest.raises(ConfigError, match=f"log_dir='{tmp_path / 'tb'}' asks for TensorBoard logs, {INSTALL}.*"
                                          "or leave log_dir empty"):
        summary_writer_class(tmp_path / "tb")
    session = demo_session(tmp_path)
    calls = []
    with pytest.raises(ConfigError, match=INSTALL):
        train(session, 1, device=CPU, log_dir=tmp_path / "tb", progress=lambda *a: calls.append(a))
    assert not calls and not (tmp_path / "tb").exists()  # not a step trained, not a file written
    inputs = {"log_dir": "tb", "device": "cpu", "optimizer": "adamw", "filename_prefix": "rt/lora"}
    problem = TightropeTrain.VALIDATE_INPUTS(**inputs)
    assert isinstance(problem, str) and "log_dir=" in problem and INSTALL in problem
    assert TightropeTrain.VALIDATE_INPUTS(**inputs | {"log_dir": ""}) is True  # no logs asked for: no check


def test_run_log_dir_without_tensorboard_exits_2_with_one_line(tmp_path, no_tensorboard, capsys):
    code = cli.main(["run", str(tmp_path / "w.json"), "--output-dir", str(tmp_path / "out"), "--log-dir", "tb"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert f"error: --log-dir='tb' asks for TensorBoard logs, {INSTALL}" in err and "run without --log-dir" in err


def test_the_node_log_dir_is_under_the_output_folder_and_run_log_dir_is_the_fallback(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with host.headless(tmp_path / "out"):
        assert host.tensorboard_dir("") is None
        assert host.tensorboard_dir("runs/a") == tmp_path / "out" / "runs" / "a"
        assert host.tensorboard_dir(str(tmp_path / "abs")) == tmp_path / "abs"
    with host.headless(tmp_path / "out", log_dir="cli_runs"):
        assert host.tensorboard_dir("") == tmp_path / "cli_runs"  # --log-dir is relative to where it was typed
        assert host.tensorboard_dir("runs/a") == tmp_path / "out" / "runs" / "a"  # the node's own wins
    assert host.tensorboard_dir("") is None  # gone with the run


def test_scalars_read_back_with_tensorboard(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (optional): the write path is untested")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    lines = []
    strategy = Strategy.of(compute_dtype="fp32", offload_fraction=1.0)  # streams weights: H2D is known
    session = train(demo_session(tmp_path, strategy=strategy, validation_fraction=0.25, validation_every=2,
                                 schedule="cosine"), 3, device=CPU, log_dir=tmp_path / "tb", notify=lines.append)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    f32 = lambda v: torch.tensor(v, dtype=torch.float32).item()  # noqa: E731  (event files store float32)
    assert set(scalars) == {"train/loss", "train/learning_rate", "validation/loss", "transfer/h2d_gb_per_s"}
    assert scalars["train/loss"] == [(i, f32(v)) for i, v in enumerate(session.losses)]
    assert [s for s, _ in scalars["train/learning_rate"]] == [0, 1, 2]
    assert scalars["train/learning_rate"][0][1] > scalars["train/learning_rate"][2][1]  # cosine decay
    assert scalars["validation/loss"] == [(s, f32(v)) for s, v in session.validation_losses]
    assert scalars["transfer/h2d_gb_per_s"] == [(i, f32(s["h2d_bytes"] / s["step_time_s"] / 1e9))
                                                 for i, s in enumerate(session.stats)]
    # peak VRAM is measured on CUDA only: on the CPU it is not written rather than written as 0
    assert lines == [f"validation loss at step {s}: {v:.4f}" for s, v in session.validation_losses]


def test_a_log_dir_that_cannot_be_written_is_refused_before_training(tmp_path, monkeypatch, capsys):
    """A log_dir under a file (or an unwritable folder) failed at the first scalar, after a step trained, with a
    traceback: now the node's input check and `tightrope run --log-dir` refuse it, naming the setting."""
    import types
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=object))
    (tmp_path / "afile").write_text("")
    with pytest.raises(ConfigError, match=r"log_dir='.*afile/tb' needs the folder '.*afile/tb', but '.*afile' is a "
                                          "file: move or rename that file, or set another log_dir"):
        summary_writer_class(tmp_path / "afile" / "tb")
    monkeypatch.setattr(host, "tensorboard_dir", lambda name: str(tmp_path / "afile" / name))
    inputs = {"log_dir": "tb", "device": "cpu", "optimizer": "adamw", "filename_prefix": "rt/lora"}
    problem = TightropeTrain.VALIDATE_INPUTS(**inputs)
    assert isinstance(problem, str) and "is a file" in problem and "set another log_dir" in problem
    code = cli.main(["run", str(tmp_path / "w.json"), "--output-dir", str(tmp_path / "out"), "--log-dir",
                     str(tmp_path / "afile" / "tb")])
    err = capsys.readouterr().err
    assert code == 2 and "--log-dir=" in err and "pass another --log-dir" in err and "Traceback" not in err

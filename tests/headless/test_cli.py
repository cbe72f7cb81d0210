import contextlib
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from tightrope import cli


@pytest.fixture
def fake_cli(monkeypatch, mappings):
    """main() with the fake nodes and a recorder instead of tightrope.nodes.host."""
    host_calls = []
    monkeypatch.setattr(cli, "load_node_mappings", lambda library=None: dict(mappings))
    monkeypatch.delenv("COMFYUI_DIR", raising=False)  # core nodes stay unknown: no ComfyUI is loaded
    monkeypatch.setattr(cli, "headless_host", lambda output_dir, resume, log_dir=None:
                        contextlib.nullcontext(host_calls.append((output_dir, resume, log_dir))))
    return host_calls


def _write(tmp_path, workflow, name="w.json"):
    path = tmp_path / name
    path.write_text(json.dumps(workflow))
    return str(path)


def test_run_succeeds_and_prints_the_output_nodes(tmp_path, ui_workflow, fake_cli, capsys):
    out_dir = tmp_path / "out"
    assert cli.main(["run", _write(tmp_path, ui_workflow), "--output-dir", str(out_dir), "--resume"]) == 0
    assert fake_cli == [(str(out_dir), True, None)] and out_dir.is_dir()
    captured = capsys.readouterr()
    assert "node 3 'Record':\n  text: sum=12" in captured.out and "text: size=4" in captured.out
    assert "ran 6 node(s)" in captured.out
    assert "[1/6] node 1 'Constant'" in captured.err  # progress goes to stderr


def test_log_dir_reaches_the_nodes(tmp_path, ui_workflow, fake_cli):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed: --log-dir is refused, as tested elsewhere")
    out_dir = tmp_path / "out"
    assert cli.main(["run", _write(tmp_path, ui_workflow), "--output-dir", str(out_dir), "--log-dir", "tb"]) == 0
    assert fake_cli == [(str(out_dir), False, "tb")]


def test_workflow_error_exits_2_with_a_message_and_no_traceback(tmp_path, fake_cli, capsys):
    path = _write(tmp_path, {"7": {"class_type": "KSampler", "inputs": {}}})
    assert cli.main(["run", path, "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "error: node 7 'KSampler' is a ComfyUI core node" in err and "Traceback" not in err
    assert cli.main(["run", str(tmp_path / "nope.json")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_an_empty_output_dir_is_refused_not_taken_for_the_working_directory(tmp_path, fake_cli, capsys,
                                                                            monkeypatch):
    """`--output-dir "$OUT"` with OUT unset wrote into whatever folder the shell was in."""
    monkeypatch.chdir(tmp_path)
    path = _write(tmp_path, {"1": {"class_type": "Constant", "inputs": {"value": 1}},
                             "2": {"class_type": "Record", "inputs": {"value": ["1", 0]}}})
    assert cli.main(["run", path, "--output-dir", " "]) == 2
    err = capsys.readouterr().err
    assert "error: --output-dir ' ' is empty: pass the folder the run writes into" in err and "Traceback" not in err
    assert fake_cli == [] and sorted(p.name for p in tmp_path.iterdir()) == [Path(path).name]


def test_node_failure_exits_1(tmp_path, fake_cli, capsys):
    path = _write(tmp_path, {"1": {"class_type": "Constant", "inputs": {"value": 1}},
                             "2": {"class_type": "Explode", "inputs": {"value": ["1", 0]}},
                             "3": {"class_type": "Record", "inputs": {"value": ["2", 0]}}})
    assert cli.main(["run", path, "--output-dir", str(tmp_path)]) == 1
    assert "error: node 2 'Explode' failed: RuntimeError: boom" in capsys.readouterr().err


def _failing_graph(tmp_path, mappings, error: Exception) -> str:
    """Constant -> Fail (raises `error`) -> Record, written as an API-format file."""
    class Fail:
        RETURN_TYPES, FUNCTION = ("INT",), "run"

        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {"value": ("INT", {"forceInput": True})}}

        def run(self, value):
            raise error
    mappings["Fail"] = Fail
    return _write(tmp_path, {"1": {"class_type": "Constant", "inputs": {"value": 1}},
                             "2": {"class_type": "Fail", "inputs": {"value": ["1", 0]}},
                             "3": {"class_type": "Record", "inputs": {"value": ["2", 0]}}})


def test_a_user_error_prints_one_line_and_no_traceback(tmp_path, mappings, monkeypatch, capsys):
    from tightrope.training.data.image_folder import DatasetError
    monkeypatch.setattr(cli, "headless_host", lambda output_dir, resume, log_dir=None: contextlib.nullcontext())
    monkeypatch.setattr(cli, "load_node_mappings", lambda library=None: mappings)
    path = _failing_graph(tmp_path, mappings, DatasetError("dataset folder 'x' does not exist: pass the folder"))
    assert cli.main(["run", path, "--output-dir", str(tmp_path)]) == cli.EXIT_WORKFLOW_ERROR  # bad input: 2
    err = capsys.readouterr().err
    assert "error: node 2 'Fail' failed: DatasetError: dataset folder 'x' does not exist: pass the folder" in err
    assert "Traceback" not in err
    assert cli.main(["run", path, "--output-dir", str(tmp_path), "--debug"]) == 2  # --debug: the traceback too
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "DatasetError" in err.split("error: node 2")[0]


def test_a_bug_still_prints_its_traceback(tmp_path, fake_cli, capsys):
    path = _write(tmp_path, {"1": {"class_type": "Constant", "inputs": {"value": 1}},
                             "2": {"class_type": "Explode", "inputs": {"value": ["1", 0]}},
                             "3": {"class_type": "Record", "inputs": {"value": ["2", 0]}}})
    assert cli.main(["run", path, "--output-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and 'raise RuntimeError("boom")' in err


def test_every_user_error_type_is_a_user_error():
    from tightrope.memory.strategy import StrategyError
    from tightrope.training.distributed import DistributedError
    from tightrope.training.input_checks import OutputPathError
    from tightrope.training.lora.targets import LoraError
    from tightrope.training.state.resume import ResumeError
    from tightrope.training.state.atomic_write import FileWriteError
    from tightrope.training.finite_check import NonFiniteDataError
    from tightrope.training.lora.rescue import LoraNotSavedError
    from tightrope.training.state.lock import StateLockedError
    from tightrope.training.trainer import NonFiniteLossError, NonFiniteWeightsError, TrainingOutOfMemoryError
    for kind in (StrategyError, DistributedError, OutputPathError, LoraError, ResumeError, NonFiniteLossError,
                 TrainingOutOfMemoryError, NonFiniteWeightsError, NonFiniteDataError, FileWriteError,
                 LoraNotSavedError, StateLockedError):
        assert issubclass(kind, cli.user_error_types()), kind
    assert not issubclass(RuntimeError, cli.user_error_types()) and not issubclass(ValueError, cli.user_error_types())
    # bad input (exit 2) is a user error; a run that failed (exit 1) is not bad input
    assert all(issubclass(kind, cli.user_error_types()) for kind in cli.bad_input_types())
    for kind in (StrategyError, DistributedError, OutputPathError, LoraError, ResumeError, NonFiniteDataError,
                 StateLockedError):
        assert issubclass(kind, cli.bad_input_types()), kind
    for kind in (NonFiniteLossError, NonFiniteWeightsError, TrainingOutOfMemoryError, FileWriteError,
                 LoraNotSavedError):
        assert not issubclass(kind, cli.bad_input_types()), kind


def test_ctrl_c_exits_130(tmp_path, api_workflow, fake_cli, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr("tightrope.headless.executor.run_workflow", interrupted)
    assert cli.main(["run", _write(tmp_path, api_workflow), "--output-dir", str(tmp_path)]) == 130
    assert "interrupted (Ctrl-C)" in capsys.readouterr().err


def test_usage_errors_exit_2(capsys):
    assert cli.main([]) == 2
    assert cli.main(["run"]) == 2
    assert "usage: tightrope" in capsys.readouterr().err


def test_bench_gets_all_remaining_arguments(monkeypatch):
    received = []
    fake_bench = types.ModuleType("tightrope.bench.cli")
    fake_bench.main = lambda argv: received.append(argv) or 3
    monkeypatch.setitem(sys.modules, "tightrope.bench.cli", fake_bench)
    assert cli.main(["bench", "--quick", "--help"]) == 3
    assert received == [["--quick", "--help"]]


def test_run_gives_the_nodes_the_real_host_for_the_run_only(tmp_path, api_workflow, mappings, monkeypatch):
    from tightrope.headless import executor
    from tightrope.nodes import host
    seen = []
    real_run = executor.run_workflow

    def run(*args, **kwargs):
        seen.append((host.output_dir(), host.run_dir(), host.resume_mode(), host.in_comfyui()))
        if len(seen) == 2:
            raise KeyboardInterrupt
        return real_run(*args, **kwargs)
    monkeypatch.setattr(executor, "run_workflow", run)
    monkeypatch.setattr(cli, "load_node_mappings", lambda library=None: dict(mappings))
    monkeypatch.delenv("COMFYUI_DIR", raising=False)  # core nodes stay unknown: no ComfyUI is loaded
    path = _write(tmp_path, api_workflow)
    assert cli.main(["run", path, "--output-dir", str(tmp_path / "o"), "--resume"]) == 0
    assert seen == [(tmp_path / "o", tmp_path / "o", "asked", False)]
    # after the run (and after one ended by Ctrl-C) nothing is left set: a later run or ComfyUI in this process
    # gets its own folders and no --resume it did not ask for
    assert host.output_dir() == Path("output") and host.resume_mode() == "off"
    assert cli.main(["run", path, "--output-dir", str(tmp_path / "p")]) == 130
    assert seen[1] == (tmp_path / "p", tmp_path / "p", "unasked", False)
    assert host.output_dir() == Path("output") and host.resume_mode() == "off"


def test_headless_blocks_nest_and_restore_the_host_however_they_end(tmp_path, monkeypatch):
    from tightrope.nodes import host
    monkeypatch.setitem(sys.modules, "folder_paths", types.ModuleType("folder_paths"))  # as inside ComfyUI
    assert host.in_comfyui()
    with pytest.raises(RuntimeError, match="node failed"):
        with host.headless(tmp_path / "a"):
            assert host.output_dir() == tmp_path / "a" and not host.in_comfyui() and host.resume_mode() == "unasked"
            with host.headless(tmp_path / "b", run_dir=tmp_path / "a", resume=True):
                assert (host.output_dir(), host.run_dir(), host.resume_mode()) == (tmp_path / "b", tmp_path / "a",
                                                                                  "asked")
            assert host.output_dir() == tmp_path / "a" and host.resume_mode() == "unasked"
            raise RuntimeError("node failed")
    # in ComfyUI the Train node's resume widget decides: go on only from the very same run, or train anew
    assert host.in_comfyui() and host.resume_mode() == "same run" and host.resume_mode(False) == "off"


def test_python_dash_m_tightrope_help():
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, "-m", "tightrope", "--help"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "usage: tightrope" in done.stdout and "run" in done.stdout and "bench" in done.stdout


def test_our_process_prefers_expandable_segments_unless_the_user_chose(monkeypatch):
    from tightrope import cli
    monkeypatch.setattr(cli.sys, "platform", "linux")
    env = {}
    assert cli.prefer_expandable_segments(env) and env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        env = {name: "backend:cudaMallocAsync"}
        assert not cli.prefer_expandable_segments(env) and env == {name: "backend:cudaMallocAsync"}
    monkeypatch.setattr(cli.sys, "platform", "win32")
    env = {}
    assert not cli.prefer_expandable_segments(env) and not env


def test_our_warnings_print_as_one_line_each(tmp_path):
    """A warning of Tightrope's own prints as `warning: <message>` on a line of its own, not Python's
    `<file>:<line>: UserWarning: ...` and the source line under it (found by helpers driving the CLI)."""
    from tightrope.nodes.strategy_node import TightropeMemoryStrategy
    sys.path.insert(0, str(Path(__file__).parents[1] / "reliability"))
    try:
        from test_stop_signals import WORKFLOW
    finally:
        sys.path.pop(0)
    strategy = {k: v[1]["default"] for k, v in TightropeMemoryStrategy.INPUT_TYPES()["required"].items()}
    workflow = json.loads(json.dumps(WORKFLOW))
    workflow["6"]["inputs"] |= {"steps": 2, "strategy": ["8", 0]}
    # activation offload with no block checkpointed: a warning
    workflow["8"] = {"class_type": "TightropeMemoryStrategy",
                     "inputs": strategy | {"activation_offload": True, "checkpoint": "off", "compute_dtype": "fp32"}}
    path = _write(tmp_path, workflow)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    done = subprocess.run([sys.executable, "-m", "tightrope", "run", path, "--output-dir", str(tmp_path / "o")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.replace("\r", "\n").splitlines()
    assert any(line.startswith("warning: activation_offload=True moves the inputs checkpointed blocks keep")
               for line in lines), done.stderr
    assert "UserWarning" not in done.stderr and "warnings.warn" not in done.stderr, done.stderr


def test_a_name_outside_the_consoles_code_page_does_not_fail_a_finished_run(tmp_path, ui_workflow, fake_cli,
                                                                            monkeypatch):
    """Windows (Python 3.12/3.13): stdout redirected to a file or a pipe is in the ANSI code page (cp1252 on Western
    systems), with errors='strict'; the summary naming an output folder (or a LoRA file) with a letter outside it,
    printed after every node ran, raised UnicodeEncodeError: exit 1 and a traceback after a successful run. stderr
    already escapes such letters (Python's default for it); stdout now does too."""
    import io
    raw = io.BytesIO()
    stdout = io.TextIOWrapper(raw, encoding="cp1252", errors="strict", write_through=True)
    monkeypatch.setattr(sys, "stdout", stdout)
    out_dir = tmp_path / "out_Łódź_日本"
    assert cli.main(["run", _write(tmp_path, ui_workflow), "--output-dir", str(out_dir)]) == 0
    printed = raw.getvalue().decode("cp1252")
    assert "ran 6 node(s)" in printed and "out_\\u0141ód\\u017a_\\u65e5\\u672c" in printed
    assert sys.stdout is stdout and stdout.errors == "strict"  # the caller's stream is as it was after main()

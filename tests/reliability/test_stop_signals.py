"""SIGTERM (docker stop, systemd, Kubernetes, SLURM), SIGHUP and SIGUSR1 stop `tightrope run` like Ctrl-C: the Train
node saves the LoRA and training state of the last completed step, and the process exits with 128 + the signal."""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import weakref

import pytest
import torch

from tightrope.headless.stop_signals import StopSignal, polite_stops, report_stop
from tightrope.training.lora.files import read_lora_file
from tightrope.training.state.resume import load_state

WORKFLOW = {  # the embedded demo, far more steps than the test waits for, no periodic save
    "1": {"class_type": "TightropeDemoModel", "inputs": {"seed": 0}},
    "2": {"class_type": "TightropeDemoEncoders", "inputs": {"seed": 0}},
    "3": {"class_type": "TightropeDemoImages", "inputs": {"subfolder": "images", "count": 4, "size": 32, "seed": 0}},
    "4": {"class_type": "TightropeLoadDataset",
          "inputs": {"folder": ["3", 0], "vae": ["2", 0], "clip": ["2", 1], "resolution": 32, "caption_dropout": 0.0,
                     "use_repeats": True, "strict": True}},
    "5": {"class_type": "TightropeLoraSetup",
          "inputs": {"rank": 4, "alpha": 4.0, "rslora": False, "dropout": 0.0, "targets": "attention",
                     "init": "default", "target_regex": "", "existing_lora": ""}},
    "6": {"class_type": "TightropeTrain",
          "inputs": {"steps": 100_000, "learning_rate": 1e-3, "optimizer": "adamw", "schedule": "constant",
                     "warmup_steps": 0, "batch_size": 2, "grad_accumulation": 1, "seed": 0,
                     "timestep_sampling": "logit_normal", "timestep_shift": 1.0, "guidance": 1.0, "save_every": 0,
                     "filename_prefix": "sig/lora", "device": "cpu", "on_nonfinite": "stop", "model": ["1", 0],
                     "dataset": ["4", 0], "lora": ["5", 0]}},
    "7": {"class_type": "TightropeSaveLora", "inputs": {"session": ["6", 0], "filename_prefix": "sig/final"}},
}


def _stderr_reader(proc):
    """All of the process's stderr so far (tqdm redraws its bar with '\\r', so read bytes, not lines)."""
    chunks = []

    def read():
        while data := os.read(proc.stderr.fileno(), 4096):
            chunks.append(data)
    threading.Thread(target=read, daemon=True).start()
    return lambda: b"".join(chunks).decode(errors="replace")


def test_sigterm_mid_training_saves_the_last_completed_step_and_exits_143(tmp_path):
    workflow, out = tmp_path / "w.json", tmp_path / "out"
    workflow.write_text(json.dumps(WORKFLOW))
    proc = subprocess.Popen([sys.executable, "-m", "tightrope", "run", str(workflow), "--output-dir", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, umask=0o022,
                            env=dict(os.environ, PYTHONWARNINGS="ignore"))
    try:
        stderr = _stderr_reader(proc)
        deadline = time.monotonic() + 120
        while max(map(int, re.findall(r"(\d+)/100000", stderr())), default=0) < 2:  # two steps done
            assert proc.poll() is None and time.monotonic() < deadline, stderr()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 143, stderr()
    assert "stopped by SIGTERM; Train nodes saved their last completed step: run again with --resume" in stderr()
    assert "Traceback" not in stderr()
    (lora_file,) = (out / "sig").glob("lora_*_.safetensors")
    (state_file,) = out.rglob("*.state.safetensors")
    tensors, meta = read_lora_file(lora_file)
    state = load_state(state_file)
    assert int(meta["tightrope.steps"]) == state.step >= 2
    assert all(torch.equal(tensors["diffusion_model." + k.replace(".default", "")], v)
               for k, v in state.lora_state.items())
    for path in (lora_file, state_file):  # the user's umask, like every other file they create
        assert path.stat().st_mode & 0o777 == 0o644
    assert not list(out.rglob("*.tmp")) and not (out / "sig" / "final_00001_.safetensors").exists()


@pytest.mark.parametrize("name", ["SIGTERM", "SIGHUP", "SIGUSR1"])
def test_each_polite_signal_raises_a_stop_and_the_handlers_are_restored(name):
    signum = getattr(signal, name)
    before = signal.getsignal(signum)
    with pytest.raises(StopSignal, match=f"stopped by {name}") as caught, polite_stops():
        signal.raise_signal(signum)
        time.sleep(1)  # the handler runs at the next bytecode; never reached
    assert isinstance(caught.value, KeyboardInterrupt) and signal.getsignal(signum) is before
    assert report_stop(caught.value) == 128 + signum


def test_windows_ctrl_break_and_closing_the_console_stop_politely(monkeypatch):
    """Windows has no SIGTERM/SIGHUP/SIGUSR1 a user sends; Ctrl-Break raises SIGBREAK, whose default ends the process
    with nothing saved. Linux has no SIGBREAK: SIGUSR2 stands in for it."""
    monkeypatch.setattr(signal, "SIGBREAK", signal.SIGUSR2, raising=False)

    def unhandled(*_):  # what Windows' default would do, as an error here instead of ending pytest
        raise AssertionError("SIGBREAK was not handled: the process would end with nothing saved")
    previous = signal.signal(signal.SIGUSR2, unhandled)
    try:
        with pytest.raises(StopSignal, match="stopped by SIGUSR2"), polite_stops():
            signal.raise_signal(signal.SIGUSR2)
            time.sleep(1)  # the handler runs at the next bytecode; never reached
        assert signal.getsignal(signal.SIGUSR2) is unhandled
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_a_second_signal_does_not_cut_the_save_short(capsys):
    saved = []
    with pytest.raises(StopSignal), polite_stops():
        try:
            signal.raise_signal(signal.SIGTERM)
        finally:  # the Train node saving after the first stop: a second SIGTERM arrives meanwhile
            signal.raise_signal(signal.SIGTERM)
            saved.append(True)
    assert saved == [True] and "SIGTERM again: still saving the last completed step" in capsys.readouterr().err


def test_no_handlers_outside_the_main_thread():
    before, seen = signal.getsignal(signal.SIGTERM), []

    def run():
        with polite_stops():
            seen.append(signal.getsignal(signal.SIGTERM))
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [before]


def test_ctrl_c_still_exits_130():
    assert report_stop(KeyboardInterrupt()) == 130


def test_a_stop_while_the_run_ends_waits_until_its_last_step_is_saved(tmp_path, monkeypatch):
    """SIGTERM arriving after the last step, while the runtime is undone (before the end-of-run state file, with
    save_every=0 the only record of the run): held until the state is written and the model undone, then raised."""
    from demo_setup import demo_session

    from tightrope.memory.runtime import MemoryRuntime
    from tightrope.training.state.resume import state_path
    from tightrope.training.trainer import SaveTarget, train
    real_undo = MemoryRuntime.undo

    def undo(self):
        os.kill(os.getpid(), signal.SIGTERM)  # its handler runs here, in the main thread
        real_undo(self)
    monkeypatch.setattr(MemoryRuntime, "undo", undo)
    save = SaveTarget(tmp_path / "out", "run")  # save_every=0: the Train node's default
    with polite_stops(), pytest.raises(StopSignal):
        train(demo_session(tmp_path), 3, device=torch.device("cpu"), save=save)
    assert load_state(state_path(save.folder, "run")).step == 3


def test_a_stop_while_the_batch_worker_starts_leaves_no_thread_behind(tmp_path, monkeypatch):
    """SIGTERM landing inside Thread.start of MicroBatches' worker (start waits for the thread: a handler can raise
    there) raised before the executor had registered the thread: nothing ever told it to end, and the process hung
    at exit after reporting the stop (found by a helper interrupting headless runs). Held until MicroBatches exists,
    so the run's `finally` closes it."""
    from demo_setup import demo_session

    from tightrope.training.trainer import train
    real_start = threading.Thread.start

    def start(self):
        real_start(self)
        if self.name.startswith("tightrope-batches"):
            os.kill(os.getpid(), signal.SIGTERM)  # its handler runs here, before start() returns
    monkeypatch.setattr(threading.Thread, "start", start)
    with polite_stops(), pytest.raises(StopSignal):
        train(demo_session(tmp_path), 3, device=torch.device("cpu"))
    workers = [t for t in threading.enumerate() if t.name.startswith("tightrope-batches")]
    for t in workers:
        t.join(timeout=10)
    left = [t for t in workers if t.is_alive()]
    for t in left:  # a regression: wake the orphan (its executor is gone), so the test process can still exit
        t._args[1].put(None)
    assert not left


def test_a_stop_during_a_periodic_save_writes_that_steps_lora_once(tmp_path, monkeypatch):
    """SIGTERM right after a periodic save wrote its LoRA file, before the run recorded it: the stop's own save wrote
    the step's LoRA again under the next counter (found by a helper: two files of step 2, later ones renumbered)."""
    from demo_setup import demo_session

    from tightrope.training import trainer
    from tightrope.training.state.resume import load_state, state_path
    real = trainer.save_lora_state

    def save_lora_state(*args, **kwargs):
        path = real(*args, **kwargs)
        if kwargs["metadata"]["tightrope.steps"] == "2":
            os.kill(os.getpid(), signal.SIGTERM)  # its handler runs before the file is recorded
        return path
    monkeypatch.setattr(trainer, "save_lora_state", save_lora_state)
    save = trainer.SaveTarget(tmp_path / "out", "run", every=1)
    with polite_stops(), pytest.raises(StopSignal):
        trainer.train(demo_session(tmp_path), 4, device=torch.device("cpu"), save=save)
    files = sorted((tmp_path / "out").glob("run_*.safetensors"))
    assert [read_lora_file(f)[1]["tightrope.steps"] for f in files] == ["1", "2"]
    assert load_state(state_path(save.folder, "run")).step == 2


def _swallowed_sigterm():
    """SIGTERM handled while Python runs a weakref finalizer (the memory runtime registers them on weight views and
    storages): the handler's StopSignal raises inside the finalizer, which prints it as "Exception ignored" and
    drops it."""
    victim = type("Victim", (), {})()
    weakref.finalize(victim, signal.raise_signal, signal.SIGTERM)
    del victim


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the swallowed stop
def test_a_stop_a_finalizer_swallowed_stops_the_run_before_its_next_step(tmp_path, monkeypatch):
    """Before: the run went on to its end, every later signal ignored as "still saving" (seen under torchrun:
    SIGKILL after the grace period, nothing saved). Now the stop is raised again before the next step, which saves
    the last completed step as any stop does."""
    from demo_setup import demo_session

    from tightrope.memory.runtime import MemoryRuntime
    from tightrope.training.state.resume import state_path
    from tightrope.training.trainer import SaveTarget, train
    real_start_step, started = MemoryRuntime.start_step, []

    def start_step(self, *args, **kwargs):
        started.append(1)
        if len(started) == 2:  # in step 2's forward, outside the held optimizer update
            _swallowed_sigterm()
        return real_start_step(self, *args, **kwargs)
    monkeypatch.setattr(MemoryRuntime, "start_step", start_step)
    save = SaveTarget(tmp_path / "out", "run")
    with polite_stops(), pytest.raises(StopSignal):
        train(demo_session(tmp_path), 6, device=torch.device("cpu"), save=save)
    assert len(started) == 2 and load_state(state_path(save.folder, "run")).step == 2


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the swallowed stop
def test_a_stop_a_finalizer_swallowed_stops_the_workflow_before_its_next_node():
    from tightrope.headless.executor import run_workflow
    from tightrope.headless.graph import Link, NodeSpec
    ran = []

    class Step:
        RETURN_TYPES, FUNCTION, OUTPUT_NODE = ("INT",), "run", True

        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {"value": ("INT", {})}}

        def run(self, value):
            ran.append(value)
            if value == 1:
                _swallowed_sigterm()
            return (value + 1,)

    graph = {"1": NodeSpec("Step", {"value": 1}), "2": NodeSpec("Step", {"value": Link("1", 0)})}
    with polite_stops(), pytest.raises(StopSignal):
        run_workflow(graph, {"Step": Step}, inference_mode=False)
    assert ran == [1]

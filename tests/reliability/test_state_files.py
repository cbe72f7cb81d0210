"""Where training state files live (never where a LoRA list shows them) and the lock that keeps a second run from
overwriting a running one's state."""
import os
import subprocess
import sys
import types

import pytest
import torch
from reliability_kit import train_node, world

from tightrope.nodes import host
from tightrope.training.state.lock import StateLockedError, state_lock
from tightrope.training.state.resume import load_state, state_path


@pytest.fixture
def comfyui(tmp_path, monkeypatch):
    """ComfyUI as the nodes see it: its folder_paths module, a progress bar, an interrupt flag that never fires and
    the exception its ops raise on one."""
    folders = types.ModuleType("folder_paths")
    folders.get_folder_paths = lambda kind: [str(tmp_path / "models" / kind)]
    folders.get_user_directory = lambda: str(tmp_path / "user")
    folders.get_output_directory = lambda: str(tmp_path / "output")
    folders.get_temp_directory = lambda: str(tmp_path / "temp")
    comfy = types.ModuleType("comfy")
    comfy.utils = types.ModuleType("comfy.utils")
    comfy.utils.ProgressBar = lambda total: types.SimpleNamespace(update_absolute=lambda done, total=None: None)
    comfy.model_management = types.ModuleType("comfy.model_management")
    comfy.model_management.processing_interrupted = lambda: False
    comfy.model_management.InterruptProcessingException = type("InterruptProcessingException", (Exception,), {})
    for name, module in (("folder_paths", folders), ("comfy", comfy), ("comfy.utils", comfy.utils),
                         ("comfy.model_management", comfy.model_management)):
        monkeypatch.setitem(sys.modules, name, module)
    return tmp_path


def test_in_comfyui_the_state_is_in_the_user_folder_not_among_the_loras(comfyui):
    with host.headless(comfyui / "build"):  # the demo world is built headless, then ComfyUI runs the node
        parts = world(comfyui / "build")
    assert host.in_comfyui() and host.state_dir() == comfyui / "user" / "tightrope_state"
    with torch.inference_mode():
        train_node(*parts, steps=1, save_every=1, unique_id="12")
    loras = sorted(p.relative_to(comfyui / "models" / "loras").as_posix()
                   for p in (comfyui / "models" / "loras").rglob("*") if p.is_file())
    assert loras == ["rt/lora_00001_.safetensors"]  # what LoraLoader lists: the LoRA only
    state = load_state(comfyui / "user" / "tightrope_state" / "rt" / "lora.node-12.state.safetensors")
    assert state.step == 1 and state.info["owner"]["node"] == "12"


def test_headless_the_state_is_in_a_hidden_folder_of_the_output_dir(out):
    assert host.state_dir() == out / ".tightrope_state" and host.loras_dir() == out
    with torch.inference_mode():
        train_node(*world(out), steps=1, save_every=1, unique_id="7")
    assert sorted(p.name for p in (out / "rt").iterdir()) == ["lora_00001_.safetensors"]
    assert load_state(out / ".tightrope_state" / "rt" / "lora.node-7.state.safetensors").step == 1


REFUSED = (r"another run is training into the training state file '.*\.tightrope_state/rt/lora\.node-7\.state"
           r"\.safetensors' \(it holds '.*lora\.node-7\.state\.safetensors\.lock'\): wait for it to finish, or give "
           r"this run another output folder \(`tightrope run --output-dir`\) or another filename_prefix")


def test_a_second_run_into_a_locked_state_file_is_refused_before_training(out):
    """flock locks belong to an open file, so a second open in this process stands for a second run."""
    parts = world(out)
    path = state_path(host.state_dir(), "rt/lora", "7")
    with state_lock(path), torch.inference_mode():
        with pytest.raises(StateLockedError, match=REFUSED):
            train_node(*parts, steps=1, unique_id="7")
        assert not (out / "rt").exists() and not path.exists()  # refused before any step or file
        train_node(*parts, steps=1, unique_id="8")  # another node's state is another file: not locked
    with torch.inference_mode():
        session, _, _ = train_node(*parts, steps=1, unique_id="7")  # the other run is over: the lock is free
    assert session.step == 1 and load_state(path).step == 1


@pytest.mark.skipif(os.name == "nt", reason="the holder process uses fcntl.flock (POSIX)")
def test_a_lock_held_by_another_process_refuses_and_is_freed_when_it_ends(out):
    parts = world(out)
    lock = state_path(host.state_dir(), "rt/lora", "7").with_suffix(".safetensors.lock")
    lock.parent.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys; f = open(sys.argv[1], 'a+b'); "
                               "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()",
                               str(lock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(StateLockedError, match=REFUSED), torch.inference_mode():
            train_node(*parts, steps=1, unique_id="7")
    finally:
        holder.communicate("", timeout=30)  # it exits: the OS frees its lock
    with torch.inference_mode():
        assert train_node(*parts, steps=1, unique_id="7")[0].step == 1


def test_the_lock_is_released_when_training_fails(out):
    model, dataset, spec, strat = world(out)

    def boom(*args, **kwargs):
        raise RuntimeError("boom in the forward")
    model.predict = boom
    with pytest.raises(RuntimeError, match="boom in the forward"), torch.inference_mode():
        train_node(model, dataset, spec, strat, steps=1, unique_id="7")
    with state_lock(state_path(host.state_dir(), "rt/lora", "7")):  # free again
        pass

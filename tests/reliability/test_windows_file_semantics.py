"""Windows file semantics, checked on Linux: Windows refuses to replace (os.replace) or delete a file that some
handle or memory mapping of this process still holds ("PermissionError: [WinError 5] Access is denied"). safetensors
(0.4+) reads a file by mapping all of it (torch.UntypedStorage.from_file) and the tensors it returns are views of
that mapping, alive as long as they are. Here os.replace fails, as on Windows, when its target is mapped
(/proc/self/maps), so a state file a resumed run still maps is found on Linux."""
import os

import pytest
import torch
from reliability_kit import resuming, train_node, world

from tightrope.nodes import host
from tightrope.training.state import atomic_write
from tightrope.training.state.resume import load_state, state_path

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps (Linux)")


def _mapped(path) -> bool:
    target = os.path.realpath(path)
    with open("/proc/self/maps") as f:
        return any(line.rstrip("\n").endswith(" " + target) for line in f)


@pytest.fixture
def windows_replace(monkeypatch):
    """os.replace in atomic_write refuses a mapped target, as Windows does; returns the refused targets."""
    refused, real = [], os.replace

    def replace(src, dst):
        if os.path.exists(dst) and _mapped(dst):
            refused.append(os.fspath(dst))
            raise PermissionError(13, "Access is denied (the file is mapped: Windows refuses to replace it)",
                                  os.fspath(dst))
        return real(src, dst)
    monkeypatch.setattr(atomic_write.os, "replace", replace)
    return refused


def test_load_state_leaves_no_mapping_of_the_state_file(tmp_path, out, monkeypatch):
    model, dataset, spec, strat = world(out)
    calls = []
    monkeypatch.setattr(host, "interrupt_requested", lambda: len(calls) >= 2)
    monkeypatch.setattr(host, "progress_reporter", lambda total: lambda d, t, loss: calls.append(d))
    with torch.inference_mode(), pytest.raises(KeyboardInterrupt):
        train_node(model, dataset, spec, strat, steps=4)
    path = state_path(host.state_dir(), "rt/lora")
    state = load_state(path)
    assert state.step == 2
    assert not _mapped(path), "the loaded state's tensors are views of a mapping of its file"


def test_a_resumed_train_node_can_save_its_state_again(out, monkeypatch, windows_replace):
    """Interrupted at step 2 of 6 (state saved), queued again: the resumed run saves its state at step 4 and 6 over the
    same file. On Windows the optimizer state, loaded as views of the file's mapping, kept it mapped: the first save
    failed with PermissionError."""
    model, dataset, spec, strat = world(out)
    calls = []
    monkeypatch.setattr(host, "interrupt_requested", lambda: len(calls) >= 2)
    monkeypatch.setattr(host, "progress_reporter", lambda total: lambda d, t, loss: calls.append(d))
    with torch.inference_mode():
        with pytest.raises(KeyboardInterrupt):
            train_node(model, dataset, spec, strat, steps=6, save_every=2)
        monkeypatch.setattr(host, "interrupt_requested", lambda: False)
        with resuming():
            resumed, _, _ = train_node(model, dataset, spec, strat, steps=6, save_every=2)
    assert windows_replace == []
    assert resumed.step == 6 and load_state(state_path(host.state_dir(), "rt/lora")).step == 6

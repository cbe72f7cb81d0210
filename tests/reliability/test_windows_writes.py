"""Writes as Windows treats them, simulated on Linux.

Windows without long paths enabled (its default) cannot create a file whose full path passes 259 characters, and
says so as if the folder were missing (FileNotFoundError: "[WinError 3] The system cannot find the path specified").
A deep ComfyUI folder (C:\\Users\\<name>\\...\\ComfyUI_windows_portable\\ComfyUI\\user\\tightrope_state\\) and a
long filename_prefix with subfolders get there. Simulated here: windows_short_paths() forced on, and os.open failing
on such paths as Windows fails. Every such write is refused naming the path and the two fixes.

A file another program holds open (an antivirus scanning the file just written, a viewer) cannot be replaced there
meanwhile: the rename is tried again for a few seconds, then refused naming that cause (before: 'make the folder
writable')."""
import errno
import os

import pytest
import torch

from tightrope.training.state import atomic_write
from tightrope.training.state.atomic_write import (LONG_PATHS_FIX, FileWriteError, OutputPathError,
                                                   atomic_save_file, user_output_path)
from tightrope.training.state.lock import state_lock

LONG = "x" * 120 + "/" + "y" * 100  # two folders' names: a path of more than 259 characters under any tmp_path


@pytest.fixture
def windows(monkeypatch):
    monkeypatch.setattr(atomic_write, "windows_short_paths", lambda: True, raising=False)
    real = os.open

    def windows_open(path, *args, **kwargs):
        if len(os.path.abspath(path)) > 259:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", os.fspath(path))
        return real(path, *args, **kwargs)
    monkeypatch.setattr(atomic_write.os, "open", windows_open)


def test_a_cache_entry_too_long_for_windows_names_its_path_and_the_fixes(tmp_path, windows):
    entry = tmp_path / "user" / "tightrope_cache" / "latents" / "ab" / ("ab" * 32 + ".safetensors")
    entry = tmp_path / LONG / entry.relative_to(tmp_path)
    with pytest.raises(FileWriteError) as caught:
        atomic_save_file({"latent": torch.zeros(2)}, entry)
    message = str(caught.value)
    assert f"could not write '{entry}' (its path, with its temp file's name, is longer than the 259 characters " \
        "Windows allows" in message
    assert "LongPathsEnabled" in message and "--user-directory" in message and caught.value.fix == LONG_PATHS_FIX
    assert not (tmp_path / ("x" * 120)).exists()  # nothing made: the folder neither
    atomic_save_file({"latent": torch.zeros(2)}, tmp_path / "short.safetensors")  # a short path is written


def test_a_state_file_too_long_for_windows_is_refused_before_training(tmp_path, windows):
    state = tmp_path / "user" / "tightrope_state" / LONG / "lora.node-7.state.safetensors"
    with pytest.raises(FileWriteError, match="LongPathsEnabled"), state_lock(state):
        pytest.fail("the lock was taken")
    with state_lock(tmp_path / "lora.node-7.state.safetensors"):
        pass


def test_a_filename_prefix_too_long_for_windows_is_refused_at_queue_time(tmp_path, windows):
    with pytest.raises(OutputPathError, match=r"y_00001_\.safetensors', whose path \(with its temp file's name\) is "
                                              r"longer than the 259 characters Windows allows"):
        user_output_path(tmp_path, "tightrope/" + LONG)
    assert user_output_path(tmp_path, "tightrope/lora") == tmp_path / "tightrope" / "lora"


def test_linux_and_windows_with_long_paths_have_no_such_limit(tmp_path):
    assert not atomic_write.windows_short_paths()
    atomic_save_file({"a": torch.zeros(1)}, tmp_path / LONG / "lora.safetensors")


# --- a file in use: Windows refuses to replace it while another program (an antivirus scan, a viewer) holds it open


def _replace_refused(monkeypatch, times: int) -> list:
    """os.replace refuses as Windows does while the target is held open, `times` times; retries made instant."""
    monkeypatch.setattr(atomic_write, "_IN_USE_RETRIES", (0.0,) * 7, raising=False)
    refused, real = [], os.replace

    def replace(src, dst):
        if len(refused) < times:
            refused.append(dst)
            raise PermissionError(13, "The process cannot access the file because it is being used by another "
                                      "process", os.fspath(dst))
        return real(src, dst)
    monkeypatch.setattr(atomic_write.os, "replace", replace)
    return refused


def test_a_file_held_open_for_a_moment_is_replaced_once_it_is_free(tmp_path, monkeypatch):
    target = tmp_path / "lora.state.safetensors"
    atomic_save_file({"a": torch.zeros(1)}, target)
    refused = _replace_refused(monkeypatch, 3)
    atomic_save_file({"a": torch.ones(1)}, target)
    assert len(refused) == 3 and sorted(os.listdir(tmp_path)) == ["lora.state.safetensors"]


def test_a_file_held_open_for_good_names_the_cause(tmp_path, monkeypatch):
    target = tmp_path / "lora.state.safetensors"
    atomic_save_file({"a": torch.zeros(1)}, target)
    _replace_refused(monkeypatch, 100)
    with pytest.raises(FileWriteError, match="another program holds it open and Windows cannot replace a file in use"):
        atomic_save_file({"a": torch.ones(1)}, target)
    assert sorted(os.listdir(tmp_path)) == ["lora.state.safetensors"]  # the old file, no temp file

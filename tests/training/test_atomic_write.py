"""Crash-safe safetensors writes and output names that never overwrite and never leave the output folder."""
import errno
import os
import stat
import time

import pytest
import torch
from safetensors.torch import load_file

from tightrope.training.state import atomic_write
from tightrope.training.state.atomic_write import (FileWriteError, atomic_save_file, next_counter, next_free_path,
                                             remove_stale_temporaries, safe_output_path)


def test_write_and_read_back(tmp_path):
    path = atomic_save_file({"a": torch.arange(6.0).reshape(2, 3).t()}, tmp_path / "d" / "x.safetensors",
                            {"k": "v"})
    assert torch.equal(load_file(path)["a"], torch.arange(6.0).reshape(2, 3).t())  # non-contiguous is fine
    assert os.listdir(tmp_path / "d") == ["x.safetensors"]


@pytest.mark.parametrize("crash_in", ["os.replace", "write"])
def test_a_crash_keeps_the_previous_file_and_leaves_no_temp(tmp_path, monkeypatch, crash_in):
    path = tmp_path / "x.safetensors"
    atomic_save_file({"a": torch.ones(3)}, path)
    before = path.read_bytes()

    def crash(*args, **kwargs):
        if crash_in == "write":  # half of the file written, then the disk is full
            os.write(args[0], args[1][:10])
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(*((atomic_write.os, "replace") if crash_in == "os.replace" else (atomic_write, "_write_all")),
                        crash)
    with pytest.raises(FileWriteError, match=rf"could not write '{path}' \(No space left on device\): free disk "
                                             "space there") as caught:
        atomic_save_file({"a": torch.zeros(3)}, path)
    assert caught.value.errno == errno.ENOSPC and isinstance(caught.value, OSError)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["x.safetensors"]


def test_an_unwritable_folder_names_the_file(tmp_path, monkeypatch):
    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")
    monkeypatch.setattr(atomic_write.os, "open", denied)  # as root, chmod cannot make a folder unwritable
    with pytest.raises(FileWriteError, match=r"could not write '.*x.safetensors' \(Permission denied\): make the "
                                             "folder writable"):
        atomic_save_file({"a": torch.ones(1)}, tmp_path / "x.safetensors")


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_files_get_the_mode_of_the_users_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        path = atomic_save_file({"a": torch.ones(1)}, tmp_path / "x.safetensors")
        png = tmp_path / "x.png"
        png.write_bytes(b"")  # any file the user creates, as PIL writes a PNG
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == stat.S_IMODE(png.stat().st_mode) == 0o666 & ~umask


def test_stale_temporaries_of_killed_writers_are_removed(tmp_path):
    fcntl = pytest.importorskip("fcntl", reason="POSIX file locks (on Windows an open file cannot be deleted)")

    def make(name, age_s):
        p = tmp_path / name
        p.write_bytes(b"")
        os.utime(p, (time.time() - age_s,) * 2)
        return p
    killed = make(".lora_00003_.safetensors.x7k2_q9z.tmp", 60)  # left by kill -9 (the 0-byte file of mkstemp)
    recent = make(".lora_00004_.safetensors.0a1b2c3d.tmp", 0)  # written since this run started
    live = make(".lora.state.safetensors.9f8e7d6c.tmp", 60)   # another run is writing it right now
    foreign = [make(".tmp9Z0HPn", 60), make("notes.tmp", 60), make(".x.safetensors.tmp", 60),
               make("lora_00001_.safetensors", 60)]
    with open(live, "rb") as writer:
        fcntl.flock(writer.fileno(), fcntl.LOCK_EX)  # what atomic_save_file holds while it writes
        removed = remove_stale_temporaries(tmp_path, older_than=time.time() - 30)
    assert removed == [killed]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in [recent, live, *foreign])
    assert remove_stale_temporaries(tmp_path / "missing", older_than=time.time()) == []


def test_a_writer_holds_the_lock_that_protects_its_temp_file(tmp_path, monkeypatch):
    seen = []

    def write_all(fd, data):
        (tmp,) = tmp_path.glob(".x.safetensors.*.tmp")
        os.utime(tmp, (0, 0))  # as old as can be: only the lock protects it
        seen.append(remove_stale_temporaries(tmp_path, older_than=time.time()))
        os.write(fd, data)
    monkeypatch.setattr(atomic_write, "_write_all", write_all)
    path = atomic_save_file({"a": torch.ones(2)}, tmp_path / "x.safetensors")
    assert seen == [[]] and torch.equal(load_file(path)["a"], torch.ones(2))


def test_no_overwrite_mode(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"old")
    with pytest.raises(FileExistsError):
        atomic_save_file({"a": torch.ones(1)}, path, overwrite=False)
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["x.safetensors"]
    atomic_save_file({"a": torch.ones(1)}, tmp_path / "y.safetensors", overwrite=False)
    assert sorted(os.listdir(tmp_path)) == ["x.safetensors", "y.safetensors"]


def test_input_errors(tmp_path):
    with pytest.raises(TypeError, match=r"metadata\['steps'\] = 3 \(int\).*str\(\)"):
        atomic_save_file({"a": torch.ones(1)}, tmp_path / "x.safetensors", {"steps": 3})
    with pytest.raises(ValueError, match="'.*x.pt' does not end in .safetensors"):
        atomic_save_file({"a": torch.ones(1)}, tmp_path / "x.pt")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("prefix,why", [
    ("..", "'..'"), ("../x", "'..'"), ("a/../../x", "'..'"), ("a/../b", "'..'"), ("..\\x", "'..'"),
    ("a/.../x", "'..'"), ("/etc/x", "absolute"), ("\\x", "absolute"), ("C:\\x", "':'"),
    ("C:x", "':'"), ("\\\\server\\share\\x", "absolute"), ("a\0b", "'\\x00'"), ("a:b", "':'"),
    ("", "empty"), ("  ", "empty"), ("tightrope/", "ends in a folder"),
    # Windows device names, in any case, with any extension (the state file adds '.node-<id>.state.safetensors')
    ("tightrope/CON", "'CON', a name Windows reserves"), ("nul/x", "'nul', a name Windows"),
    ("a/Aux.v2/x", "'Aux.v2', a name Windows"), ("lpt1", "'lpt1', a name Windows"), ("com\u00b9/x", "a name Windows"),
])
def test_unsafe_prefixes_are_rejected(tmp_path, prefix, why):
    with pytest.raises(ValueError, match="filename_prefix=") as e:
        safe_output_path(tmp_path, prefix)
    assert why in str(e.value)


def test_safe_prefixes_stay_inside(tmp_path):
    assert safe_output_path(tmp_path, "tightrope/my_lora") == tmp_path / "tightrope" / "my_lora"
    assert safe_output_path(tmp_path, "./a//b") == tmp_path / "a" / "b"
    assert safe_output_path(tmp_path, "v1.2_lora") == tmp_path / "v1.2_lora"
    for name in ("console", "nul_lora", "com10", "lpt", "auxiliary/con_x", "my.con"):  # not device names
        assert safe_output_path(tmp_path, name) == tmp_path.joinpath(*name.split("/"))


def test_next_free_path_counts_like_comfyui(tmp_path):
    first = next_free_path(tmp_path, "tightrope/my_lora")
    assert first == tmp_path / "tightrope" / "my_lora_00001_.safetensors" and first.parent.is_dir()
    first.write_bytes(b"1")
    (tmp_path / "tightrope" / "my_lora_00007_.safetensors").write_bytes(b"7")
    (tmp_path / "tightrope" / "my_lora_x_00042_.safetensors").write_bytes(b"other prefix")
    (tmp_path / "tightrope" / "my_lora_00050_.png").write_bytes(b"other extension")
    assert next_free_path(tmp_path, "tightrope/my_lora").name == "my_lora_00008_.safetensors"
    assert next_free_path(tmp_path, "tightrope/my_lora", ext=".png").name == "my_lora_00051_.png"
    with pytest.raises(ValueError, match="filename_prefix='../x'"):
        next_free_path(tmp_path, "../x")


def test_the_counter_sees_a_name_in_another_unicode_normal_form(tmp_path):
    """macOS's HFS+ stores 'café' decomposed (NFD) and opens it under either form: a prefix typed composed (NFC)
    counted no file, so the next LoRA's name was the existing file's (the save then retried 100 times, then failed:
    'could not find a free file name')."""
    import unicodedata
    (tmp_path / unicodedata.normalize("NFD", "café_00001_.safetensors")).write_bytes(b"1")
    assert next_counter(tmp_path, unicodedata.normalize("NFC", "café")) == 2

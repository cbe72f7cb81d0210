"""Crash-safe safetensors writes and output names that never overwrite and never leave the output folder."""
import os

import pytest
import torch
from safetensors.torch import load_file

from tightrope.training import atomic_write
from tightrope.training.atomic_write import atomic_save_file, next_free_path, safe_output_path


def test_write_and_read_back(tmp_path):
    path = atomic_save_file({"a": torch.arange(6.0).reshape(2, 3).t()}, tmp_path / "d" / "x.safetensors",
                            {"k": "v"})
    assert torch.equal(load_file(path)["a"], torch.arange(6.0).reshape(2, 3).t())  # non-contiguous is fine
    assert os.listdir(tmp_path / "d") == ["x.safetensors"]


@pytest.mark.parametrize("crash_in", ["os.replace", "save_file"])
def test_a_crash_keeps_the_previous_file_and_leaves_no_temp(tmp_path, monkeypatch, crash_in):
    path = tmp_path / "x.safetensors"
    atomic_save_file({"a": torch.ones(3)}, path)
    before = path.read_bytes()

    def crash(*args, **kwargs):
        if crash_in == "save_file":  # a half-written temp file, then the crash
            with open(args[1], "wb") as f:
                f.write(b"\x00" * 10)
        raise OSError("disk full")
    if crash_in == "os.replace":
        monkeypatch.setattr(atomic_write.os, "replace", crash)
    else:
        monkeypatch.setattr(atomic_write, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        atomic_save_file({"a": torch.zeros(3)}, path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["x.safetensors"]


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
])
def test_unsafe_prefixes_are_rejected(tmp_path, prefix, why):
    with pytest.raises(ValueError, match="filename_prefix=") as e:
        safe_output_path(tmp_path, prefix)
    assert why in str(e.value)


def test_safe_prefixes_stay_inside(tmp_path):
    assert safe_output_path(tmp_path, "tightrope/my_lora") == tmp_path / "tightrope" / "my_lora"
    assert safe_output_path(tmp_path, "./a//b") == tmp_path / "a" / "b"
    assert safe_output_path(tmp_path, "v1.2_lora") == tmp_path / "v1.2_lora"


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

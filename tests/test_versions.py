"""The oldest Python, torch and peft Tightrope runs on (versions.py): refused at import in one line naming what is
installed and what is needed. Found by running the suite on each: peft 0.13 trains a LoKr at another scale than the
file it saves says; torch 2.6 breaks per-block compile and FSDP sharding (tests/memory/test_compile_steps.py,
tests/memory/test_sharding.py fail there)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tightrope import versions

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("python,torch_version,peft_version,expected", [
    ((3, 9, 18), "2.13.0", "0.21.2", ["Python 3.9.18 (needs 3.10 or newer)"]),
    ((3, 11, 7), "2.6.0+cu124", "0.21.2", ["torch 2.6.0+cu124 (needs 2.7 or newer: update ComfyUI's torch)"]),
    ((3, 11, 7), "2.13.0+cpu", "0.13.0", ["peft 0.13.0 (needs 0.18 or newer: pip install -U 'peft>=0.18')"]),
    ((3, 11, 7), None, None, ["no torch (needs torch 2.7 or newer: ComfyUI's own, or `pip install torch`)",
                              "no peft (needs peft 0.18 or newer: pip install 'peft>=0.18')"]),
])
def test_too_old_versions_are_named_with_what_is_needed(python, torch_version, peft_version, expected):
    assert versions.problems(python, torch_version, peft_version) == expected


@pytest.mark.parametrize("python,torch_version,peft_version", [
    ((3, 10, 13), "2.7.0", "0.18.0"), ((3, 13, 0), "2.15.0+cu132", "0.21.2"),
    ((3, 12, 1), "2.8.0a0+git1234", "0.18.1.dev0"),
])
def test_supported_versions_pass(python, torch_version, peft_version):
    assert versions.problems(python, torch_version, peft_version) == []


def test_the_package_refuses_an_old_peft_at_import(tmp_path):
    """As ComfyUI imports the node pack: a peft 0.13 first on the path (its metadata only: an old peft may not even
    import) stops the import with one line naming it, before any node module imports peft."""
    dist = tmp_path / "peft-0.13.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: peft\nVersion: 0.13.0\n")
    (tmp_path / "tightrope").symlink_to(ROOT)
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", "import tightrope"], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "tightrope.versions.UnsupportedVersionError: Tightrope cannot run with peft 0.13.0 (needs 0.18 or newer: "
        "pip install -U 'peft>=0.18')")

"""Where ComfyUI is, for the integration tests: COMFYUI_DIR (its source dir) and its python, COMFYUI_PYTHON (default
$COMFYUI_DIR/../venv/bin/python), both read by tests/helpers/comfy_runner.py; tests that need it are skipped when
COMFYUI_DIR is unset. Also the environment of a `python -m tightrope` subprocess in ComfyUI's python."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from comfy_runner import COMFYUI_DIR, SKIP_REASON, comfy_python, run_in_comfyui  # noqa: F401 (tests import them here)

REPO = Path(__file__).resolve().parents[2]
needs_comfyui = pytest.mark.skipif(not COMFYUI_DIR, reason=SKIP_REASON)


def tightrope_env(tmp_path: Path) -> dict:
    """The environment of a `python -m tightrope` subprocess in ComfyUI's python: this checkout importable as
    `tightrope` (a link in tmp_path/pythonpath), ComfyUI named by COMFYUI_DIR."""
    pythonpath = tmp_path / "pythonpath"
    if not pythonpath.exists():
        pythonpath.mkdir()
        (pythonpath / "tightrope").symlink_to(REPO, target_is_directory=True)
    return {**os.environ, "PYTHONPATH": str(pythonpath), "COMFYUI_DIR": os.path.abspath(COMFYUI_DIR),
            "PYTHONUNBUFFERED": "1"}


def run_on_tiny_flux(tmp_path: Path, runner: str):
    """`runner` in ComfyUI's python (comfy_runner.run_in_comfyui) with ARGS = (a tiny random Flux checkpoint, a LoRA
    folder), this checkout importable: the value it passed to result(), printed."""
    from tightrope.demo.tiny_checkpoint import make_tiny_checkpoint
    ckpt = make_tiny_checkpoint(tmp_path / "tiny_flux.safetensors", seed=3)
    r, _ = run_in_comfyui(tmp_path, runner, ckpt, tmp_path / "loras", env=tightrope_env(tmp_path))
    print(f"\n{json.dumps(r, indent=1)}")
    return r


def run_headless_batch(comfyui_python: str, tmp: Path, runs: list[dict], names, timeout: int) -> dict:
    """`tightrope run` for each of `runs` in one ComfyUI process (headless_batch.py): {name: (exit code, log text)}
    in the order of `names`."""
    import subprocess
    (tmp / "runs.json").write_text(json.dumps(runs))
    proc = subprocess.run([comfyui_python, str(Path(__file__).with_name("headless_batch.py")), str(tmp / "runs.json")],
                          env=tightrope_env(tmp), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    codes = json.loads((tmp / "runs.json.codes").read_text())
    return {name: (code, (tmp / f"{name}.log").read_text(errors="replace")) for name, code in zip(names, codes)}

"""Where ComfyUI is: COMFYUI_DIR (its source dir) and its python, COMFYUI_PYTHON (default
$COMFYUI_DIR/../venv/bin/python). Tests that need it are skipped when COMFYUI_DIR is unset."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
COMFYUI_DIR = os.environ.get("COMFYUI_DIR")
SKIP_REASON = "COMFYUI_DIR not set (path to a ComfyUI source dir)"
needs_comfyui = pytest.mark.skipif(not COMFYUI_DIR, reason=SKIP_REASON)


def comfy_python() -> str:
    py = os.environ.get("COMFYUI_PYTHON") or os.path.join(COMFYUI_DIR, "..", "venv", "bin", "python")
    if not os.path.exists(py):
        pytest.fail(f"ComfyUI's python not found at {py}; set COMFYUI_PYTHON")
    return py


def tightrope_env(tmp_path: Path) -> dict:
    """The environment of a `python -m tightrope` subprocess in ComfyUI's python: this checkout importable as
    `tightrope` (a link in tmp_path/pythonpath), ComfyUI named by COMFYUI_DIR."""
    pythonpath = tmp_path / "pythonpath"
    if not pythonpath.exists():
        pythonpath.mkdir()
        (pythonpath / "tightrope").symlink_to(REPO, target_is_directory=True)
    return {**os.environ, "PYTHONPATH": str(pythonpath), "COMFYUI_DIR": os.path.abspath(COMFYUI_DIR),
            "PYTHONUNBUFFERED": "1"}

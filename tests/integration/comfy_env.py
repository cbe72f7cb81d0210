"""Where ComfyUI is, for the integration tests: COMFYUI_DIR (its source dir) and its python, COMFYUI_PYTHON (default
$COMFYUI_DIR/../venv/bin/python), both read by tests/helpers/comfy_runner.py; tests that need it are skipped when
COMFYUI_DIR is unset. Also the environment of a `python -m tightrope` subprocess in ComfyUI's python."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from comfy_runner import COMFYUI_DIR, SKIP_REASON, comfy_python  # noqa: F401 (the integration tests import them here)

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

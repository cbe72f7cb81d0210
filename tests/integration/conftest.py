"""Fixtures for the ComfyUI integration tests: a real ComfyUI server on the CPU with this repo as a custom node.

Needs a ComfyUI checkout: COMFYUI_DIR=/path/to/ComfyUI (its source dir); its python is COMFYUI_PYTHON (default
$COMFYUI_DIR/../venv/bin/python). Tests that need it are skipped, with the reason printed, when COMFYUI_DIR is unset.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # comfy_env, comfy_websocket, tiny_models, api_graph
from comfy_env import COMFYUI_DIR, REPO, SKIP_REASON, comfy_python  # noqa: E402
from tiny_models import CHECKPOINTS, write_taef1  # noqa: E402

from tightrope.bench.comfy_server import Server  # noqa: E402

if not COMFYUI_DIR:
    print("skipping the ComfyUI integration tests: set COMFYUI_DIR to a ComfyUI source dir to run them")


def _ensure_requirements(py: str) -> None:
    if subprocess.run([py, "-c", "import peft, safetensors, PIL, tqdm"], capture_output=True).returncode == 0:
        return
    print(f"\ninstalling Tightrope's requirements into ComfyUI's python ({py} -m pip install -q -r requirements.txt)")
    proc = subprocess.run([py, "-m", "pip", "install", "-q", "-r", str(REPO / "requirements.txt")],
                          capture_output=True, text=True)
    if proc.returncode:
        pytest.fail(f"pip install -r requirements.txt into ComfyUI's python failed:\n{proc.stdout}\n{proc.stderr}")


@pytest.fixture(scope="session")
def comfy_server(tmp_path_factory):
    if not COMFYUI_DIR:
        pytest.skip(SKIP_REASON)
    py = comfy_python()
    _ensure_requirements(py)
    base = tmp_path_factory.mktemp("comfyui")
    (base / "custom_nodes").mkdir()
    (base / "custom_nodes" / "tightrope").symlink_to(REPO, target_is_directory=True)
    for sub in ("output", "input", "models/diffusion_models", "models/loras", "models/vae_approx"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    write_taef1(base / "models" / "vae_approx")
    server = Server(os.path.abspath(COMFYUI_DIR), base, python=py)
    try:
        server.wait_ready(timeout=180)
        yield server
    finally:
        server.stop()
        print(f"\nComfyUI server log: {server.log_path}")


@pytest.fixture(scope="session")
def checkpoint(comfy_server):
    """checkpoint(family) -> (file name in diffusion_models, UNETLoader weight_dtype); written on first use."""
    def ensure(family: str) -> tuple[str, str]:
        name, write, weight_dtype = CHECKPOINTS[family]
        path = comfy_server.base / "models" / "diffusion_models" / name
        if not path.exists():
            write(path.with_suffix(".tmp"))
            os.replace(path.with_suffix(".tmp"), path)
        return name, weight_dtype
    return ensure


@pytest.fixture(scope="session")
def comfyui_python():
    """ComfyUI's python, with Tightrope's requirements (for `python -m tightrope run --comfyui` subprocesses)."""
    if not COMFYUI_DIR:
        pytest.skip(SKIP_REASON)
    py = comfy_python()
    _ensure_requirements(py)
    return py

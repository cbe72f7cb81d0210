"""A test script run inside ComfyUI's own python (a subprocess, no server), for tests that compare with ComfyUI's
code. COMFYUI_DIR names ComfyUI's source dir, COMFYUI_PYTHON its python (default $COMFYUI_DIR/../venv/bin/python);
tests that need it are skipped when COMFYUI_DIR is unset.

The script runs after PREAMBLE, which makes ComfyUI importable on the CPU and gives it: ARGS (the arguments after
ComfyUI's dir), torch, mm (comfy.model_management), comfy.sd, comfy.utils, load_file/save_file, `Collect` (a logging
handler keeping WARNING+ messages, e.g. ComfyUI's "lora key not loaded") and `result(value)`, which hands a JSON value
back to the test. A script that starts with TRAIN_TINY also has `train_tiny(patcher, strategy, prefix, loras)`: 3
steps at lr 1e-2 (seed 0, LoRA rank 4) on two random Flux-sized latents with demo conditioning, as a node runs them
(under inference mode); it returns the session."""
from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tightrope.bench import comfy_server

COMFYUI_DIR = os.environ.get("COMFYUI_DIR")
SKIP_REASON = "COMFYUI_DIR not set (path to a ComfyUI source dir)"

PREAMBLE = textwrap.dedent("""
    import json, logging, sys
    comfy_dir, *ARGS = sys.argv[1:]
    sys.path.insert(0, comfy_dir)
    import torch
    from comfy.cli_args import args
    args.cpu = True
    import comfy.model_management as mm
    import comfy.sd, comfy.utils
    from safetensors.torch import load_file, save_file

    class Collect(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.messages = []
        def emit(self, record):
            self.messages.append(record.getMessage())

    def result(value):
        print("RESULT " + json.dumps(value))
""")


TRAIN_TINY = textwrap.dedent("""
    from pathlib import Path
    from tightrope.demo.conditioning import demo_conditioning
    from tightrope.training.data.builder import dataset_from_conditioning
    from tightrope.training.lora.layers import LoraSpec
    from tightrope.training.train_config import TrainConfig
    from tightrope.training.training_run import run_training_node

    def train_tiny(patcher, strategy, prefix, loras):
        g = torch.Generator().manual_seed(0)
        cond = demo_conditioning(patcher, "a red circle", 8, 0)
        data = dataset_from_conditioning({"samples": torch.randn(2, 16, 8, 8, generator=g)}, cond)
        with torch.inference_mode():
            return run_training_node(TrainConfig(learning_rate=1e-2, seed=0), 3, session=None, model=patcher,
                                     dataset=data, lora=LoraSpec(rank=4), strategy=strategy, device="cpu",
                                     save_dir=Path(loras), filename_prefix=prefix, save_every=0, progress=None,
                                     should_stop=None)[0]
""")


def comfy_python() -> str:
    try:
        return comfy_server.comfy_python(COMFYUI_DIR)
    except RuntimeError as e:
        pytest.fail(str(e))


def run_in_comfyui(tmp_path: Path, script: str, *args, env: dict | None = None) -> tuple[Any, str]:
    """Run PREAMBLE + `script` (dedented) in ComfyUI's python with `args` (as strings), in tmp_path: the value it
    passed to result(), and its stderr."""
    runner = tmp_path / "runner.py"
    runner.write_text(PREAMBLE + textwrap.dedent(script))
    proc = subprocess.run([comfy_python(), str(runner), os.path.abspath(COMFYUI_DIR), *map(str, args)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"ComfyUI runner failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(lines[-1][len("RESULT "):]), proc.stderr

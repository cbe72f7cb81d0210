"""workflows/demo_features.json, run as a user runs it (`tightrope run WORKFLOW --output-dir DIR`, in-process through
cli.main): masks drawn by the Demo Images node and cached with the latents, a LoKr file with the keys ComfyUI's LoKr
adapter reads, its EMA as a second file, validation losses in the run's log, and the plots."""
import contextlib
import io
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tightrope.cli import main
from tightrope.headless.ui_format import widget_values_by_name
from tightrope.nodes.train_node import TightropeTrain
from tightrope.training.lora.files import read_lora_file

WORKFLOW = Path(__file__).resolve().parents[2] / "workflows" / "demo_features.json"


def _widgets(node_type: str) -> list:
    return next(n["widgets_values"] for n in json.loads(WORKFLOW.read_text())["nodes"] if n["type"] == node_type)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo_features")
    log = io.StringIO()
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        code = main(["run", str(WORKFLOW), "--output-dir", str(out)])
    return code, out, log.getvalue()


def test_the_workflow_turns_the_features_on():
    """What the other tests rely on is in the file: masks drawn and read, LoKr, validation, EMA, EMA saved."""
    assert _widgets("TightropeDemoImages")[-1] is True and _widgets("TightropeLoadDataset")[-3] == "mask_files"
    assert _widgets("TightropeLoraSetup")[-1] == "lokr" and _widgets("TightropeSaveLora")[1] is True  # save_ema
    node = next(n for n in json.loads(WORKFLOW.read_text())["nodes"] if n["type"] == "TightropeTrain")
    problems = []
    train = widget_values_by_name(node, TightropeTrain, str(node["id"]), problems)
    assert not problems
    assert {k: train[k] for k in ("steps", "ema_decay", "loss", "huber_delta", "validation_fraction",
                                  "validation_every")} == dict(steps=40, ema_decay=0.9, loss="mse", huber_delta=1.0,
                                                                validation_fraction=0.25, validation_every=10)


def test_runs_and_reports_validation_losses(run):
    code, _, log = run
    assert code == 0, log
    steps = [int(s) for s in re.findall(r"validation loss at step (\d+): \d+\.\d+", log)]
    assert steps == [0, 10, 20, 30, 40], log[-3000:]  # every 10 steps, at the first and the last


def test_masks_are_drawn_and_cached_with_the_latents(run):
    _, out, _ = run
    images = out / "tightrope_demo_masked_images"
    assert len(list(images.glob("*.mask.png"))) == len(list(images.glob("*.txt"))) == 16
    cached = list((out / ".tightrope_cache" / "latents").rglob("*.safetensors"))
    assert len(cached) == 16
    for path in cached:
        with safe_open(str(path), "pt") as f:
            assert {"latent", "mask"} <= set(f.keys())


def test_writes_a_lokr_file_with_comfyui_keys_and_its_ema(run):
    _, out, log = run
    lokr, ema = out / "tightrope" / "demo_features_lokr_00001_.safetensors", \
        out / "tightrope" / "demo_features_lokr_ema_00001_.safetensors"
    assert str(lokr) in log and str(ema) in log
    tensors, meta = read_lora_file(lokr)
    ema_tensors, ema_meta = read_lora_file(ema)
    modules = {k.rsplit(".", 1)[0] for k in tensors}
    assert modules and all(k.startswith("diffusion_model.") for k in tensors)
    for m in modules:  # ComfyUI's LoKr adapter: w1 (or w1_a/w1_b), w2 (or w2_a/w2_b), alpha; nothing LoRA-shaped
        suffixes = {k[len(m) + 1:] for k in tensors if k.rsplit(".", 1)[0] == m}
        assert "alpha" in suffixes and suffixes & {"lokr_w1", "lokr_w1_a"} and suffixes & {"lokr_w2", "lokr_w2_a"}
        assert suffixes <= {"alpha", "lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b"}
    assert meta["tightrope.algorithm"] == "lokr" and meta["tightrope.steps"] == "40"
    assert ema_tensors.keys() == tensors.keys() and ema_meta["tightrope.ema_decay"] == "0.9"
    trained = [k for k in tensors if not k.endswith(".alpha")]
    assert any(not torch.equal(ema_tensors[k], tensors[k]) for k in trained)  # an average, not a copy


def test_writes_the_plots(run):
    _, out, _ = run
    assert sorted(p.name for p in (out / "tightrope").glob("demo_features_*.png")) == \
        ["demo_features_loss_00001_.png", "demo_features_memory_00001_.png"]

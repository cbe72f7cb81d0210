"""The demo's loss curve against a committed golden file, so a numerics change that moves every run alike is caught
(a changed objective, timestep sampling, LoRA init or optimizer step passes every self-consistency test).

The run is workflows/demo.json's first Train node (same model, dataset, LoRA and strategy), cut to 20 steps, fp32 on
the CPU, no periodic save. TIGHTROPE_WRITE_GOLDEN=1 rewrites the golden file from this run instead of comparing:
    TIGHTROPE_WRITE_GOLDEN=1 pytest tests/workflows/test_golden_losses.py

Tolerance. On one machine the run is bit-for-bit deterministic; measured on the 2-core AMD EPYC (AVX2) it was made
on: OMP_NUM_THREADS=1 vs 2 gave identical losses (relative difference 0), and ATEN_CPU_CAPABILITY=default (ATen's
non-vectorised kernels, standing in for a CPU with other vector units and so another reduction order; also with
MKL_ENABLE_INSTRUCTIONS=SSE4_2) moved the losses by at most 2.5e-7 relative, 2 fp32 ulps. RTOL = 1e-4 is 400 times
that, room for rounding differences to grow over 20 AdamW steps on other CPUs, BLAS builds and torch versions.
A real numerics change lands far outside it (measured, and checked below on the first 4 steps, which a 4-step run
reproduces exactly): timestep_shift 1.0 -> 1.1 moves the losses by up to 6.3e-2, a flow-matching target scaled by
1.01 by 2.7e-3 to 3.8e-3 on each step, 27 to 38 times RTOL.
"""
import json
import os
from pathlib import Path

import pytest

from tightrope import NODE_CLASS_MAPPINGS
from tightrope.headless import load_workflow, run_workflow
from tightrope.headless.graph import Link
from tightrope.nodes import host
from tightrope.training import trainer

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parent / "golden" / "demo_losses.json"
STEPS = 20
RTOL = 1e-4  # argued in the module docstring


def _demo_losses(out: Path, steps: int = STEPS, **train_inputs) -> list[float]:
    graph = load_workflow(ROOT / "workflows" / "demo.json", NODE_CLASS_MAPPINGS)
    graph = {k: v for k, v in graph.items() if v.class_type != "TightropePlots" and k != "8"}  # node 7 only
    graph["7"].inputs.update(steps=steps, save_every=0, device="cpu", **train_inputs)
    graph["9"].inputs["session"] = Link("7", 0)
    with host.headless(out):
        results = run_workflow(graph, NODE_CLASS_MAPPINGS)
    return results["7"][0].losses


def _max_relative_difference(losses: list[float], golden: list[float]) -> float:
    assert len(losses) == len(golden)
    return max(abs(a - b) / abs(b) for a, b in zip(losses, golden))


def test_demo_losses_match_the_golden_curve(tmp_path):
    losses = _demo_losses(tmp_path)
    if os.environ.get("TIGHTROPE_WRITE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps({"steps": STEPS, "losses": losses}, indent=1) + "\n")
    golden = json.loads(GOLDEN.read_text())["losses"]
    assert len(golden) == STEPS and _max_relative_difference(losses, golden) <= RTOL, (losses, golden)


@pytest.mark.parametrize("change", ["timestep_shift", "loss_target"])
def test_a_numerics_change_is_far_outside_the_tolerance(change, tmp_path, monkeypatch):
    if change == "timestep_shift":
        losses = _demo_losses(tmp_path, steps=4, timestep_shift=1.1)
    else:
        objective = trainer.flow_matching_loss
        monkeypatch.setattr(trainer, "flow_matching_loss",
                            lambda pred, x0, noise, **kw: objective(pred, x0 * 1.01, noise, **kw))
        losses = _demo_losses(tmp_path, steps=4)
    assert _max_relative_difference(losses, json.loads(GOLDEN.read_text())["losses"][:4]) > 10 * RTOL

"""The quick benchmark suite end to end on a tiny grid: every configuration reaches the JSON, markdown and charts."""
import json

import pytest
import torch
from PIL import Image

from tightrope.bench.cli import main
from tightrope.bench.grid import BenchConfig, quick_grid, with_references
from tightrope.bench.suite import run_suite
from tightrope.memory.strategy import Strategy


def test_quick_suite_writes_every_configuration(tmp_path):
    base = Strategy.of(compute_dtype="fp32")
    grid = with_references([BenchConfig(base, 1, 64), BenchConfig(base.replace(offload_fraction=1.0,
                                                                                   checkpoint="all"), 1, 64),
                            BenchConfig(base.replace(checkpoint="all", activation_offload=True), 2, 64)])
    assert len(grid) == 4  # the offloading config got its offload-0 twin
    result, paths = run_suite("tiny", "cpu", steps=1, warmup=0, grid=grid, out_dir=str(tmp_path),
                              budgets=[10 << 20, 64 << 20], log=lambda _: None)
    assert set(paths) == {"json", "md", "frontier", "offload", "planner"}
    data = json.loads((tmp_path / "bench-tiny.json").read_text())
    assert [c["name"] for c in data["configs"]] == [c.name for c in grid]
    markdown = (tmp_path / "bench-tiny.md").read_text()
    for c in grid:
        assert f"| {c.name} |" in markdown
    for c in data["configs"]:
        assert c["step_s"] > 0 and c["model_flops"] > 0 and c["mfu"] > 0
    offloaded = next(c for c in data["configs"] if c["strategy"]["offload_fraction"] == 1.0)
    assert offloaded["h2d_bytes"] > 0 and offloaded["bound_s"] > 0
    assert len(data["planner"]) == 2 and data["profile"]["batch"] == 1
    for name in ("frontier", "offload", "planner"):
        img = Image.open(tmp_path / f"{name}-tiny.png")
        assert img.size[0] >= 600 and img.convert("L").getextrema()[0] < 128


def test_quick_grid_is_small_and_referenced():
    grid = quick_grid()
    assert 8 <= len(grid) <= 16 and len({c.name for c in grid}) == len(grid)
    twins = {c.name for c in grid}
    assert all(c.twin_without_offload().name in twins for c in grid)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_without_cuda_is_a_clear_error(tmp_path, capsys):
    assert main(["--device", "cuda", "--model", "tiny", "--out", str(tmp_path)]) == 2
    assert "CUDA is not available" in capsys.readouterr().err

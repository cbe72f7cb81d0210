"""scripts/gpu_session.sh: the GPU measurements in parts of one device call each. Without CUDA each command says so
in one line and the part exits 0, leaving only its archive in $OUT (few files come back from a device call)."""
import os
import subprocess
import sys
import tarfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_session.sh"


def _run(part, out):
    env = {**os.environ, "OUT": str(out), "PY": sys.executable}
    return subprocess.run(["bash", str(SCRIPT), part], capture_output=True, text=True, env=env, timeout=300)


def test_without_cuda_a_part_runs_its_commands_and_leaves_one_archive(tmp_path):
    proc = _run("bench", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "gpu-bench: no CUDA device here" in proc.stdout
    assert "tightrope bench --host-memory --device cuda: no CUDA device here" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.tgz"]
    with tarfile.open(tmp_path / "bench.tgz") as tar:
        assert [m.name for m in tar.getmembers()] == ["."]  # nothing measured, nothing written


def test_an_unknown_part_is_refused_with_the_parts_named(tmp_path):
    proc = _run("everything", tmp_path)
    assert proc.returncode == 2
    assert "unknown part 'everything': give check, bench or default" in proc.stderr

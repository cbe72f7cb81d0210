"""scripts/gpu_session.sh: the GPU measurements in parts of one device call each. Without CUDA each command says so
in one line and the part exits 0. A part writes straight into $OUT/<part>/: a call killed at the device tool's limit
still brings back what its commands saved (they used to write to a temporary folder archived only at the end)."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_session.sh"


def _run(part, out):
    env = {**os.environ, "OUT": str(out), "PY": sys.executable}
    return subprocess.run(["bash", str(SCRIPT), part], capture_output=True, text=True, env=env, timeout=300)


def test_without_cuda_a_part_runs_its_commands_and_writes_nothing(tmp_path):
    proc = _run("bench", tmp_path)
    assert proc.returncode == 0, proc.stderr
    host, bench = proc.stdout.index("--host-memory --device cuda: no CUDA"), proc.stdout.index("gpu-bench: no CUDA")
    assert host < bench  # issue 13's figures first: a call cut short loses the planner's, which ran before
    assert [p.name for p in tmp_path.iterdir()] == ["bench"] and not any((tmp_path / "bench").iterdir())


def test_a_killed_part_keeps_what_its_command_saved(tmp_path):
    """The device tool kills a call at its limit (SIGKILL to the whole group): the files written so far stay."""
    fake = tmp_path / "fakepy"
    fake.write_text("#!/usr/bin/env bash\nout=${@: -1}\necho '{\"sections\": {}}' > \"$out/gpu-check.json\"\n"
                    "sleep 60\n")
    fake.chmod(0o755)
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PY": str(fake)}
    proc = subprocess.Popen(["bash", str(SCRIPT), "check"], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    saved = tmp_path / "out" / "check" / "gpu-check.json"
    deadline = time.monotonic() + 30
    while not saved.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert saved.read_text() == '{"sections": {}}\n'


def test_an_unknown_part_is_refused_with_the_parts_named(tmp_path):
    proc = _run("everything", tmp_path)
    assert proc.returncode == 2
    assert "unknown part 'everything': give check, bench or default" in proc.stderr


def test_a_peft_wheel_carried_in_whl_is_used_before_the_machines(tmp_path):
    """The GPU image's peft has a version nobody recorded; one below Tightrope's floor stops the import, and the
    machine has no network. A wheel carried in .whl/ is installed offline and put first on the path. (A stand-in
    checkout here: its `python -m tightrope` prints which peft it sees.)"""
    import shutil
    import zipfile
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, repo / "scripts" / "gpu_session.sh")
    (repo / "__init__.py").write_text("")
    (repo / "__main__.py").write_text("import importlib.metadata, peft\n"
                                      "print('peft', importlib.metadata.version('peft'), peft.__file__)\n")
    (repo / ".whl").mkdir()
    info = "peft-0.99.0.dist-info"
    with zipfile.ZipFile(repo / ".whl" / "peft-0.99.0-py3-none-any.whl", "w") as wheel:
        wheel.writestr("peft/__init__.py", "__version__ = '0.99.0'\n")
        wheel.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: peft\nVersion: 0.99.0\n")
        wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                        "Tag: py3-none-any\n")
        wheel.writestr(f"{info}/RECORD", "")
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PY": sys.executable}
    proc = subprocess.run(["bash", str(repo / "scripts" / "gpu_session.sh"), "check"], capture_output=True,
                          text=True, env=env, timeout=300)
    assert "== peft from peft-0.99.0-py3-none-any.whl (carried in .whl/), not the machine's" in proc.stdout, \
        proc.stdout + proc.stderr
    seen = next(line for line in proc.stdout.splitlines() if line.startswith("peft "))
    assert seen.startswith("peft 0.99.0 ") and "/site/peft/" in seen, seen

"""`tightrope bench --host-memory` without ComfyUI: the server and dynamic-VRAM parts are skipped with the reason
printed and written, and the report holds the headless and the 2-rank tables (the measuring children are replaced by
fixed rows); the dynamic-VRAM part's own report."""
import json

import pytest

from tightrope.bench import host_memory, host_memory_dynamic, host_memory_ranks, host_memory_server

W = 1 << 30
MiB = 1 << 20
HEADLESS = [{"offload": f, "weights_bytes": W, "peak_above_loaded_w": 0.3 + f / 4, "slots_w": f / 4,
             "host_beyond_slots_w": 0.3, "after_vs_loaded": 0.004, "after_last_vs_loaded": 0.005,
             "growth_per_run_bytes": MiB // 10, "loaded": {"anon": 1000 * MiB, "file": 300 * MiB, "malloc_in_use": 0},
             "after": [{"anon": 1001 * MiB, "file": 313 * MiB, "malloc_in_use": MiB // 5}]} for f in (0.0, 0.5, 1.0)]
RANKS = [{"offload": 1.0, "ranks": 2, "shared": s, "loaded_w": 2.0, "weights_w": 1.02 if s else 2.0,
          "step_beyond_slots_w": 1.3 if s else 2.3, "after_w": 1.05 if s else 2.05, "slots_w": 0.4} for s in (0, 1)]


def test_without_comfyui_dir_the_server_part_is_skipped_with_its_reason(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("COMFYUI_DIR", raising=False)
    monkeypatch.setattr(host_memory, "measure", lambda: HEADLESS)
    monkeypatch.setattr(host_memory_ranks, "measure", lambda offload, env: RANKS)
    monkeypatch.setattr(host_memory_server, "measure", lambda *a: (_ for _ in ()).throw(AssertionError("ran")))
    assert host_memory.main(["--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"skipping the ComfyUI server part: {host_memory_server.SKIP_REASON}" in out
    assert "skipping the ComfyUI dynamic-VRAM part: COMFYUI_DIR is not set" in out
    assert not (tmp_path / "host_memory_dynamic.md").exists()
    text = (tmp_path / "host_memory.md").read_text()
    assert f"Skipped: {host_memory_server.SKIP_REASON}" in text
    assert "| 1 | +0.55 W | 0.25 W | +0.30 W | +0.40 % | +0.50 % | +0.1 MiB | +1.0 / +13.0 / +0.2 |" in text
    assert "| 1 | one per rank | 2.00 W | 2.00 W | 2.30 W | 2.05 W |" in text
    assert "| 1 | one, shared | 2.00 W | 1.02 W | 1.30 W | 1.05 W |" in text
    assert "offload adds +0.00 W at 0.5, +0.00 W at 1" in text


def test_server_rows_are_reported_per_training_prompt():
    loaded = {"RssAnon": 1000 * MiB, "RssFile": 100 * MiB}
    row = {"offload": 1.0, "loaded_above_started_w": 1.0, "loaded": loaded,
           "runs": [{"plateau_above_loaded_w": 0.37, "peak_above_loaded_w": 0.38, "after_vs_loaded": 0.012,
                     "after": {"RssAnon": 1012 * MiB, "RssFile": 113 * MiB}},
                    {"plateau_above_loaded_w": 0.38, "peak_above_loaded_w": 0.39, "after_vs_loaded": 0.013,
                     "after": {"RssAnon": 1013 * MiB, "RssFile": 113 * MiB}}]}
    lines = host_memory_server.markdown([row])
    assert "| 1 | +1.00 W | 1 | +0.37 W | +0.38 W | +1.20 % | +12.0 / +13.0 |" in lines
    assert "| 1 | +1.00 W | 2 | +0.38 W | +0.39 W | +1.30 % | +13.0 / +13.0 |" in lines


def test_the_sampling_control_is_a_row_of_its_own_and_its_prompt_samples_with_the_loaded_model():
    loaded = {"RssAnon": 1000 * MiB, "RssFile": 100 * MiB}
    run = {"plateau_above_loaded_w": 0.01, "peak_above_loaded_w": 0.02, "after_vs_loaded": 0.02,
           "after": {"RssAnon": 1020 * MiB, "RssFile": 106 * MiB}}
    train_row = {"offload": 1.0, "loaded_above_started_w": 1.0, "loaded": loaded, "runs": [run]}
    lines = host_memory_server.markdown([train_row, {**train_row, "offload": None}])
    assert "| 1 | +1.00 W | 1 | +0.01 W | +0.02 W | +2.00 % | +20.0 / +6.0 |" in lines
    assert "| control | +1.00 W | 1 | +0.01 W | +0.02 W | +2.00 % | +20.0 / +6.0 |" in lines
    assert "Control: a server whose prompts sample" in lines[2]
    load, _ = host_memory_server.prompts("model.safetensors", 1.0)
    control = host_memory_server.sample(load, seed=3)
    assert control["1"] is load["1"]  # the loader node of the load prompt: ComfyUI's cache keeps the model
    assert control["5"]["inputs"]["model"] == ["1", 0] and control["5"]["inputs"]["seed"] == 3
    assert not any(node["class_type"] == "TightropeTrain" for node in control.values())


def test_the_dynamic_vram_part_reports_both_paths_in_files_of_its_own(tmp_path, monkeypatch):
    monkeypatch.setenv("COMFYUI_DIR", str(tmp_path))
    loaded = {"rss": 2000 * MiB, "anon": 300 * MiB, "file": 1700 * MiB}
    rows = [{"mode": m, "weights_bytes": W, "loaded": loaded, "peak_above_loaded_w": w, "reloads": n,
             "torch": "2.13.0+cpu"} for m, w, n in (("tightrope", 0.36, 0), ("reload", 2.0, 1))]
    monkeypatch.setattr(host_memory_dynamic, "measure", lambda model: rows)
    monkeypatch.setattr(host_memory, "measure", lambda: (_ for _ in ()).throw(AssertionError("ran the headless part")))
    assert host_memory.main(["--dynamic-only", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "host_memory_dynamic.md").read_text()
    assert "| Tightrope: the copy shares the mapped weights | 0 | +0.36 W | 300 / 1700 |" in text
    assert "first (Tightrope before session 6) | 1 | +2.00 W | 300 / 1700 |" in text
    assert "the reload adds +1.64 W" in text
    assert json.loads((tmp_path / "host_memory_dynamic.json").read_text())["rows"] == rows


def test_server_only_measures_the_server_at_the_width_asked_into_its_own_files(tmp_path, monkeypatch):
    """--server-only --hidden-size 2048: one server per offload asked for, the model 2048 wide (16 heads of 128), W
    counted from that model (the reference Flux's fp32 parameters: 4x MODEL's blocks, so about 4x its W)."""
    calls = []

    def fake_measure(params, offloads, weights, control=False):
        calls.append((params.hidden_size, params.num_heads, offloads, weights, control))
        return []

    monkeypatch.setenv("COMFYUI_DIR", str(tmp_path))
    monkeypatch.setattr(host_memory_server, "measure", fake_measure)
    monkeypatch.setattr(host_memory_server, "environment", lambda: {"comfyui": "0.33.0", "torch": "x"})
    assert host_memory.main(["--server-only", "--hidden-size", "2048", "--offloads", "1.0", "--server-control",
                             "--out", str(tmp_path)]) == 0
    (hidden, heads, offloads, weights, control), = calls
    assert (hidden, heads, offloads, control) == (2048, 16, (1.0,), True)
    written = json.loads((tmp_path / "host_memory_server_h2048.json").read_text())["weights_bytes"]
    assert written == weights and 3.8 < weights / 1384034560 < 4.1  # 1384034560: MODEL's W (hidden 1024)
    text = (tmp_path / "host_memory_server_h2048.md").read_text()
    assert "--server-only --hidden-size 2048 --offloads 1 --server-control" in text


def test_server_only_refuses_a_width_comfyui_cannot_detect_and_a_missing_comfyui(monkeypatch, capsys):
    with pytest.raises(SystemExit) as e:
        host_memory.main(["--server-only", "--hidden-size", "2000"])
    assert e.value.code == 2 and "--hidden-size 2000: give a positive multiple of 128" in capsys.readouterr().err
    monkeypatch.delenv("COMFYUI_DIR", raising=False)
    assert host_memory.main(["--server-only"]) == 2
    assert f"--server-only needs a ComfyUI: {host_memory_server.SKIP_REASON}" in capsys.readouterr().err


def test_the_bench_modules_import_without_posix_only_modules(monkeypatch, capsys):
    """Windows has no `resource`: importing bench/runtime_overhead (also by `tightrope bench --host-memory`, which
    then says it is Linux only) failed with ModuleNotFoundError; `--overhead` now refuses in one line."""
    import subprocess
    import sys
    code = ("import sys, tightrope, tightrope.memory.runtime; sys.modules['resource'] = None; "  # libraries first
            "import tightrope.bench.host_memory, tightrope.bench.runtime_overhead; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
    from tightrope.bench import runtime_overhead
    monkeypatch.setattr(sys, "platform", "win32")
    assert runtime_overhead.main([]) == 2
    assert "error: the runtime-overhead benchmark reads peak RSS with getrusage, which Windows lacks" in \
        capsys.readouterr().err

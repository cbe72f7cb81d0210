"""`tightrope bench --host-memory --device cuda` (bench/host_memory_cuda.py): the headless child's new figures on
the CPU device (its GPU figures need a GPU: `make gpu-check`'s companion command), the no-CUDA line, the report."""
import json

import torch

from tightrope.bench import host_memory, host_memory_cuda
from tightrope.training.models.reference_flux import Flux

W = 1 << 30
MiB = 1 << 20


def test_the_child_reports_one_host_copy_and_no_pinning_on_the_cpu_at_the_width_asked():
    """Through the command line of the child process: --device and --hidden-size reach it. The weights stream from
    the model's own storages (no host copy), nothing is page-locked off CUDA, and the slots are host memory here."""
    row, = host_memory.measure("cpu", 256, (1.0,))
    with torch.device("meta"):
        weights = sum(p.numel() * p.element_size() for p in Flux(host_memory._params(256)).parameters())
    assert weights < row["weights_bytes"] < 1.05 * weights  # the frozen weights plus the bench model's fp32 LoRA
    assert row["host_copy_bytes"] == 0 and row["pinned_in_place_bytes"] == 0
    assert row["slot_bytes"] == row["device_slot_bytes"] > 0
    assert row["device_peak_reserved_bytes"] == 0 and row["host_allocator"] is None
    assert len(row["after"]) == host_memory.RUNS


def test_without_cuda_the_command_says_so_in_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(host_memory, "measure", lambda *a: (_ for _ in ()).throw(AssertionError("measured")))
    assert host_memory.main(["--device", "cuda", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("tightrope bench --host-memory --device cuda: no CUDA device here") and "\n" not in out
    assert list(tmp_path.iterdir()) == []


def test_the_report_gives_each_row_in_w_and_what_offload_adds():
    def row(offload, peak, pinned, pool):
        return {"offload": offload, "weights_bytes": W, "peak_above_loaded_w": peak, "pinned_in_place_bytes": pinned,
                "host_copy_bytes": 0, "after_vs_loaded": 0.003, "after_last_vs_loaded": 0.004,
                "device_peak_reserved_bytes": 3 * W, "host_allocator": pool}
    rows = [row(0.0, 0.05, 0, None), row(1.0, 0.08, W - 4096,
                                         {"allocated_bytes.current": 2 * MiB, "allocated_bytes.peak": 64 * MiB})]
    result = {"date": "2026-11-23", "device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130", "cuda": "13.0",
              "hidden_size": 2048, "runs": 3, "rows": rows}
    text = host_memory_cuda.markdown(result, (0.0, 1.0))
    assert "`tightrope bench --host-memory --device cuda --hidden-size 2048 --offloads 0 1`" in text
    assert "| 0 | +0.05 W | 0.00 W | 0.00 W | +0.30 % | +0.40 % | 3.00 GiB | not reported |" in text
    assert "| 1 | +0.08 W | 1.00 W | 0.00 W | +0.30 % | +0.40 % | 3.00 GiB | 2 / 64 MiB |" in text
    assert "Offload adds +0.03 W at 1 to the peak of offload 0 (+0.05 W; target <= +0.1 W at 1.0)" in text


def test_rows_are_saved_as_they_come_and_a_failed_child_is_a_row(tmp_path, monkeypatch):
    """The GPU call has a time limit: each row is written as soon as it is measured, and a child that fails or hangs
    (given up after its timeout) is reported in its row while the next offload still runs."""
    good = {"offload": 0.0, "weights_bytes": W, "peak_rss_bytes": 3 * W, "loaded_rss_bytes": 2 * W,
            "slot_bytes": 0, "after_rss_bytes": 2 * W, "after": [{"rss": 2 * W}, {"rss": 2 * W}],
            "pinned_in_place_bytes": 0, "host_copy_bytes": 0, "device_peak_reserved_bytes": W,
            "host_allocator": {"allocated_bytes.current": 0, "reserved_bytes.current": 8 * MiB,
                               "allocated_bytes.peak": MiB, "reserved_bytes.peak": 32 * MiB}}
    seen = []

    def child(cmd, **kwargs):
        offload = float(cmd[cmd.index("--child") + 1])
        seen.append((offload, kwargs["timeout"], sorted(p.name for p in tmp_path.rglob("*.json"))))
        if offload == 0.5:
            raise host_memory.subprocess.TimeoutExpired(cmd, kwargs["timeout"])
        if offload == 1.0:
            return host_memory.subprocess.CompletedProcess(cmd, 1, "", "CUDA error: an illegal memory access")
        return host_memory.subprocess.CompletedProcess(cmd, 0, json.dumps(good) + "\n", "")

    monkeypatch.setattr(host_memory.subprocess, "run", child)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(host_memory_cuda, "resolve_device", lambda name: torch.device("cuda", 0))
    monkeypatch.setattr(host_memory_cuda, "out_dir", lambda out, device: tmp_path)
    assert host_memory_cuda.main(str(tmp_path), 256, (0.0, 0.5, 1.0), host_memory.measure, 3) == 1
    assert [s[:2] for s in seen] == [(0.0, host_memory_cuda.CHILD_TIMEOUT_S)] * 1 + [
        (0.5, host_memory_cuda.CHILD_TIMEOUT_S), (1.0, host_memory_cuda.CHILD_TIMEOUT_S)]
    assert seen[0][2] == [] and seen[1][2] == ["host_memory_cuda_h256.json"]  # row 1 on disk before child 2 ran
    (saved,) = tmp_path.rglob("host_memory_cuda_h256.json")
    rows = json.loads(saved.read_text())["rows"]
    assert [r["offload"] for r in rows] == [0.0, 0.5, 1.0] and rows[0]["peak_above_loaded_w"] == 1.0
    assert rows[1] == {"offload": 0.5, "failed": True, "error": f"no result within {host_memory_cuda.CHILD_TIMEOUT_S} s"}
    assert rows[2]["failed"] and "illegal memory access" in rows[2]["error"]
    text = next(tmp_path.rglob("host_memory_cuda_h256.md")).read_text()
    assert "| 0 | +1.00 W |" in text and "8 / 32 MiB |" in text  # the pool: reserved bytes where torch has them
    assert "Offload 0.5 failed: no result within" in text and "Offload 1 failed: exit 1:" in text

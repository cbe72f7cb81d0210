"""Host-memory benchmark on a GPU (`tightrope bench --host-memory --device cuda`): the pinned figures of issue 13.

On a GPU, offloaded weights are page-locked where they already are (memory/host_pinning.py: cudaHostRegister on the
model's own storages), not copied into pinned buffers of torch's caching host allocator, which rounds each one up to a
power of two and keeps it for the life of the process (Flux-dev's 22 GB would hold ~38 GB). This measures it, with
bench/host_memory.py's headless child: one fresh process per offload fraction, a Flux-shaped model of fp32 weights
built on the host (hidden `--hidden-size`, default 2048: W ~ 5.3 GB), CUDA initialised and warmed up before the
loaded level is read, then RUNS times two training steps on the GPU, undo and the Train node's trim.

Per row: peak RSS above the loaded level (in W); host bytes page-locked in place and host copies made; RSS after the
first and last run vs loaded; the device's peak reserved; what the caching host allocator holds at the end (where
this torch reports it). Targets: offload 1.0 adds <= +0.1 W to offload 0's peak; after a run, RSS within 2 % of the
loaded level; the host allocator holds no weight-sized buffer.
"""
from __future__ import annotations

import datetime

import torch

from .gpu_run import out_dir, resolve_device
from .report import save_cpu_result

DEFAULT_HIDDEN = 2048
CHILD_TIMEOUT_S = 150  # one child builds ~5 GB of weights and trains RUNS x 2 steps: well under a minute on an H100


def main(out: str | None, hidden_size: int | None, offloads: tuple[float, ...], measure, runs: int) -> int:
    """`measure(device, hidden_size, offloads)`: bench/host_memory.py's rows (one child process each), `runs` per
    child."""
    if not torch.cuda.is_available():
        print(f"tightrope bench --host-memory --device cuda: no CUDA device here (torch {torch.__version__}): "
              "nothing to measure; without --device it measures on the CPU")
        return 0
    hidden = hidden_size or DEFAULT_HIDDEN
    device = resolve_device("cuda")
    folder = out_dir(out, device)
    result = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "cuda": torch.version.cuda,
              "device": torch.cuda.get_device_name(device), "hidden_size": hidden, "runs": runs, "rows": []}

    def save(rows: list[dict]) -> None:  # after every row: a call stopped at its time limit keeps the rows done
        result["rows"] = rows
        save_cpu_result(f"host_memory_cuda_h{hidden}", result, markdown(result, offloads), str(folder))

    measure("cuda", hidden, offloads, on_row=save, timeout_s=CHILD_TIMEOUT_S, keep_going=True)
    return 1 if any(r.get("failed") for r in result["rows"]) else 0


def markdown(result: dict, offloads: tuple[float, ...]) -> str:
    failed = [r for r in result["rows"] if r.get("failed")]
    rows = [r for r in result["rows"] if not r.get("failed")]
    w = rows[0]["weights_bytes"] if rows else 1
    gib = float(1 << 30)
    lines = [f"# Host memory above the loaded model, training on {result['device']} ({result['date']})", "",
             f"Command: `tightrope bench --host-memory --device cuda --hidden-size {result['hidden_size']} --offloads "
             f"{' '.join(f'{f:g}' for f in offloads)}`; torch {result['torch']}, CUDA {result['cuda']}. Model: "
             f"hidden {result['hidden_size']}, W = {w / 2**20:.0f} MiB of fp32 weights on the host. One fresh process "
             f"per row; CUDA warmed up before the loaded level; {result['runs']} runs of 2 training steps, each "
             "followed by undo and the Train node's trim.", "",
             "| offload | peak above loaded | page-locked in place | host copies | after run 1 vs loaded | after run "
             f"{result['runs']} vs loaded | device peak reserved | host allocator at the end (current / peak) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        h = r.get("host_allocator")
        pool = "not reported" if h is None else (f"{_pool(h, 'current') / 2**20:.0f} / "
                                                 f"{_pool(h, 'peak') / 2**20:.0f} MiB")
        lines.append(f"| {r['offload']:g} | +{r['peak_above_loaded_w']:.2f} W | "
                     f"{r['pinned_in_place_bytes'] / w:.2f} W | {r['host_copy_bytes'] / w:.2f} W | "
                     f"{100 * r['after_vs_loaded']:+.2f} % | {100 * r['after_last_vs_loaded']:+.2f} % | "
                     f"{r['device_peak_reserved_bytes'] / gib:.2f} GiB | {pool} |")
    base = next((r for r in rows if r["offload"] == 0), None)
    if base is not None:
        lines += ["", "Offload adds " + ", ".join(
            f"{r['peak_above_loaded_w'] - base['peak_above_loaded_w']:+.2f} W at {r['offload']:g}"
            for r in rows if r is not base) + f" to the peak of offload 0 (+{base['peak_above_loaded_w']:.2f} W; "
            "target <= +0.1 W at 1.0). After a run: target within 2 % of the loaded RSS."]
    lines += [f"\nOffload {r['offload']:g} failed: {r['error'].splitlines()[0]}" for r in failed]
    return "\n".join(lines) + "\n"


def _pool(stats: dict, which: str) -> int:
    """Bytes the caching host allocator holds, in use and cached (see host_memory._host_allocator)."""
    return max(stats.get(f"reserved_bytes.{which}") or 0, stats.get(f"allocated_bytes.{which}") or 0)


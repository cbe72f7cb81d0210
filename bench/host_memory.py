"""Host-memory benchmark (CPU): how much host RAM a training run adds above the loaded model, as multiples of W.

Three parts, one fresh process (or server) per configuration, the same Flux-shaped model (W ~ 1.4 GB of fp32
weights, so fixed per-process costs do not dominate):
- headless: for offload 0 / 0.5 / 1.0, a process builds the model, resets its peak-RSS mark (/proc/self/clear_refs),
  then three times trains two steps under the MemoryRuntime, undoes it and trims as the Train node does, and reports
  its peak RSS (VmHWM) and its RSS after each run, both against the loaded model (after run 1 and after run 3: a
  one-time cost of the first run is told apart from a per-run growth). On the CPU device the offload slots
  (prefetch_depth + 1 blocks) are the simulated device memory, so they are reported apart: "host beyond the slots"
  is what the run adds to host memory on a GPU machine, plus the step's activations, gradients and AdamW state (the
  same in every configuration: compare with offload 0). Targets: offload 1.0 host beyond the slots <= +0.1 W above
  offload 0's; after a run, RSS back within 2 % of the loaded model.
- inside a real ComfyUI server (bench/host_memory_server.py), when COMFYUI_DIR is set; skipped with the reason
  printed otherwise.
- 2 local ranks under torchrun, offload 1.0, PSS summed over the ranks (bench/host_memory_ranks.py): the host copies
  of the weights, one per rank vs one shared; target <= 1.1 W.
- a MODEL as ComfyUI's dynamic VRAM holds it, emulated on the CPU, when COMFYUI_DIR is set
  (bench/host_memory_dynamic.py; its own files, host_memory_dynamic.json/.md).

    tightrope bench --host-memory [--out DIR] [--skip-server] [--skip-ranks] [--skip-dynamic] [--dynamic-only]
    tightrope bench --host-memory --server-only [--hidden-size N] [--offloads F ...] [--server-control]

`--server-only` measures the server part alone, at another width if asked (hidden 2048: W ~ 5.5 GB), into
`host_memory_server_h<N>.json/.md`: what a server keeps after a prompt is a fixed amount (code pages, Python objects,
heap pages), so its share of W is measured at more than one W.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

from ..memory.host_memory import release_freed_host_memory
from ..memory.runtime import MemoryRuntime
from ..memory.strategy import Strategy
from ..training.models.reference_flux import Flux, FluxParams
from . import host_memory_cuda, host_memory_dynamic, host_memory_ranks, host_memory_server
from .models import build_bench_model
from .proc_memory import process_memory, status_bytes
from .runtime_overhead import CHILD_ENV
from .report import save_cpu_result

# ~1.4 GB of fp32 weights (the size of the issue's own measurement), activations kept small (one 128 px sample, 16
# text tokens): the weights dominate. Widths ComfyUI's UNETLoader detects (hidden a multiple of 128, head dim 128)
# and the demo encoders feed (context 64, pooled 32), so the server part trains the same model.
MODEL = dict(params=FluxParams(vec_in_dim=32, context_in_dim=64, hidden_size=1024, num_heads=8, depth=4,
                               depth_single_blocks=12, axes_dim=(16, 56, 56), guidance_embed=True),
             txt_len=16, batch=1, resolution=128)
OFFLOADS = (0.0, 0.5, 1.0)
RUNS = 3  # runs per process: a one-time cost of the first run (code pages, first-use objects) is not a leak


def child(offload: float, device: str = "cpu", hidden_size: int | None = None) -> dict:
    """In a fresh process: build, reset the peak mark, then RUNS times: train two steps with `offload`, undo, free
    the optimizer and trim as the Train node does; RSS figures after each run. On CUDA the context, cuBLAS and the
    attention kernels are warmed up before the loaded level is read (per-process costs, not the run's)."""
    params = _params(hidden_size)
    bench = build_bench_model("host-memory", params=params, txt_len=MODEL["txt_len"], init_device="cpu")
    model, dev = bench.model, torch.device(device)
    inputs, target = bench.make_inputs(MODEL["batch"], MODEL["resolution"], device=dev)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if dev.type == "cuda":
        _warm_up(dev)
    gc.collect()
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    loaded, after, pinned, reserved = process_memory(), [], 0, 0
    for _ in range(RUNS):
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
        with MemoryRuntime(model, Strategy.of(offload_fraction=offload, compute_dtype="fp32"), dev) as rt:
            slots = rt.offload.slot_bytes() if rt.offload else 0
            pinned = rt.offload.pinned_bytes() if rt.offload else 0
            copies = rt.offload.host_copy_bytes() if rt.offload else 0
            for _ in range(2):
                F.mse_loss(model(**inputs), target).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
                reserved = max(reserved, torch.cuda.max_memory_reserved(dev))
        del opt, rt
        gc.collect()
        release_freed_host_memory()  # what the Train node does once train() has returned (training_run.py)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        after.append(process_memory())
    return {"offload": offload, "weights_bytes": weights, "loaded_rss_bytes": loaded["rss"], "loaded": loaded,
            "peak_rss_bytes": status_bytes("VmHWM"), "after_rss_bytes": after[0]["rss"], "after": after,
            "slot_bytes": slots if dev.type == "cpu" else 0,  # host memory only when the "device" is the CPU
            "device_slot_bytes": slots, "pinned_in_place_bytes": pinned, "host_copy_bytes": copies,
            "device_peak_reserved_bytes": reserved, "host_allocator": _host_allocator(dev)}


def _params(hidden_size: int | None) -> FluxParams:
    if hidden_size is None or hidden_size == MODEL["params"].hidden_size:
        return MODEL["params"]
    return dataclasses.replace(MODEL["params"], hidden_size=hidden_size, num_heads=hidden_size // 128)


def _warm_up(dev: torch.device) -> None:
    x = torch.randn(256, 256, device=dev, requires_grad=True)
    q = x.view(1, 1, 256, 256)
    (x @ x).sum().add(F.scaled_dot_product_attention(q, q, q).sum()).backward()
    torch.cuda.synchronize(dev)
    del x, q
    torch.cuda.empty_cache()


def _host_allocator(dev: torch.device) -> dict | None:
    """What torch's caching host allocator holds (pinned buffers, rounded to powers of two and kept for the life of
    the process) at the end, where this torch reports it."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if dev.type != "cuda" or stats is None:
        return None
    try:
        s = stats()
    except RuntimeError:  # a torch whose host allocator keeps no statistics
        return None
    # "reserved_bytes.*" is the pool (in use + cached) where torch reports it; "allocated_bytes.*" meant in use only
    # before torch counted cached blocks there too (PR #164412): both are kept, the report reads the larger
    return {k: s.get(k) for k in ("allocated_bytes.current", "allocated_bytes.peak", "reserved_bytes.current",
                                  "reserved_bytes.peak", "num_host_alloc")}


def measure(device: str = "cpu", hidden_size: int | None = None, offloads=OFFLOADS, *, on_row=None,
            timeout_s: float | None = None, keep_going: bool = False) -> list[dict]:
    """One child process per offload fraction. `on_row(rows)` after each row (a caller saves as it goes);
    `keep_going`: a child that fails or outlasts `timeout_s` is a row {"offload", "failed", "error"}, not an error."""
    rows = []
    for offload in offloads:
        cmd = [sys.executable, "-m", "tightrope.bench.host_memory", "--child", str(offload), "--device", device,
               "--hidden-size", str(_params(hidden_size).hidden_size)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env={**os.environ, **CHILD_ENV},
                                  timeout=timeout_s)
            error = None if proc.returncode == 0 else f"exit {proc.returncode}:\n{proc.stderr[-2000:]}"
        except subprocess.TimeoutExpired:
            error = f"no result within {timeout_s:g} s"
        if error is not None:
            if not keep_going:
                raise RuntimeError(f"host-memory child (offload {offload}) failed ({error})")
            rows.append({"offload": offload, "failed": True, "error": error})
            if on_row:
                on_row(rows)
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        w = r["weights_bytes"]
        r["peak_above_loaded_w"] = (r["peak_rss_bytes"] - r["loaded_rss_bytes"]) / w
        r["slots_w"] = r["slot_bytes"] / w
        r["host_beyond_slots_w"] = r["peak_above_loaded_w"] - r["slots_w"]
        r["after_vs_loaded"] = r["after_rss_bytes"] / r["loaded_rss_bytes"] - 1
        r["after_last_vs_loaded"] = r["after"][-1]["rss"] / r["loaded_rss_bytes"] - 1
        r["growth_per_run_bytes"] = (r["after"][-1]["rss"] - r["after"][0]["rss"]) / (len(r["after"]) - 1)
        rows.append(r)
        if on_row:
            on_row(rows)
    return rows


def server_only(hidden_size: int, offloads: tuple[float, ...], control: bool, out: str | None) -> int:
    """The server part alone, for a model `hidden_size` wide (head dim 128, MODEL's depths)."""
    if not os.environ.get("COMFYUI_DIR"):
        print(f"error: --server-only needs a ComfyUI: {host_memory_server.SKIP_REASON}", file=sys.stderr)
        return 2
    params = _params(hidden_size)
    with torch.device("meta"):
        weights = sum(p.numel() * p.element_size() for p in Flux(params).parameters())
    result = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "device": "cpu",
              "hidden_size": hidden_size, "weights_bytes": weights, "server_env": host_memory_server.environment()}
    result["server"] = host_memory_server.measure(params, offloads, weights, control=control)
    text = "\n".join([f"# Host memory inside a real ComfyUI server, hidden {hidden_size} (CPU, {result['date']})", "",
                      f"Command: `tightrope bench --host-memory --server-only --hidden-size {hidden_size} --offloads "
                      f"{' '.join(f'{f:g}' for f in offloads)}{' --server-control' if control else ''}`. Model: "
                      f"hidden {hidden_size}, {params.depth} double + {params.depth_single_blocks} single blocks, "
                      f"W = {weights / 2**20:.0f} MiB of fp32 weights.", "",
                      *host_memory_server.markdown(result["server"], result["server_env"])])
    save_cpu_result(f"host_memory_server_h{hidden_size}", result, text + "\n", out)
    return 0


def markdown(result: dict) -> str:
    rows = result["rows"]
    lines = [f"# Host memory above the loaded model (CPU, {result['date']})", "",
             f"torch {result['torch']}, {result['device']}, {os.cpu_count()} cores. Model: hidden "
             f"{MODEL['params'].hidden_size}, {MODEL['params'].depth} double + {MODEL['params'].depth_single_blocks} "
             f"single blocks, W = {rows[0]['weights_bytes'] / 2**20:.0f} MiB of fp32 weights.", "",
             "## Headless", "", f"One fresh process per row; {RUNS} runs of 2 training steps (batch 1, 128 px), each "
             "followed by the Train node's trim; peak: VmHWM over the runs. After a run: RSS vs loaded; of what run 1 "
             "left, the anonymous and file-backed (library code) parts and the bytes malloc still has handed out, "
             "in MiB.", "",
             "| offload | peak above loaded | device slots (simulated) | host beyond the slots | after run 1 vs loaded "
             f"| after run {RUNS} vs loaded | growth per run | run 1 left: anon / file / malloc in use |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        first, loaded = r["after"][0], r["loaded"]
        malloc = ("n/a" if first["malloc_in_use"] is None else
                  f"{(first['malloc_in_use'] - loaded['malloc_in_use']) / 2**20:+.1f}")
        lines.append(f"| {r['offload']:g} | +{r['peak_above_loaded_w']:.2f} W | {r['slots_w']:.2f} W | "
                     f"+{r['host_beyond_slots_w']:.2f} W | {100 * r['after_vs_loaded']:+.2f} % | "
                     f"{100 * r['after_last_vs_loaded']:+.2f} % | {r['growth_per_run_bytes'] / 2**20:+.1f} MiB | "
                     f"{(first['anon'] - loaded['anon']) / 2**20:+.1f} / "
                     f"{(first['file'] - loaded['file']) / 2**20:+.1f} / {malloc} |")
    base = rows[0]["host_beyond_slots_w"]
    lines += ["", "Host beyond the slots includes the step's own activations, LoRA gradients and AdamW state, the same "
              f"for every row (offload 0: +{base:.2f} W); offload adds "
              + ", ".join(f"{r['host_beyond_slots_w'] - base:+.2f} W at {r['offload']:g}" for r in rows[1:])
              + " (target <= +0.1 W at 1.0). After a run: target within 2 % of the loaded RSS (worst row: run 1 "
              f"{100 * max(r['after_vs_loaded'] for r in rows):+.2f} %, run {RUNS} "
              f"{100 * max(r['after_last_vs_loaded'] for r in rows):+.2f} %). The file-backed part is libtorch code "
              "the first backward ran (clean pages, shared, made once per process).", ""]
    if result.get("server"):
        server = {r["offload"]: r for r in result["server"]}
        lines += host_memory_server.markdown(result["server"], result.get("server_env")) + [""]
        if 0.0 in server:
            def plateau(r):
                return max(run["plateau_above_loaded_w"] for run in r["runs"])
            lines += ["The server trains on the CPU device too, so its plateau includes the same simulated device "
                      "slots as the headless rows; beyond them, offload adds " + ", ".join(
                          f"{plateau(server[h['offload']]) - h['slots_w'] - plateau(server[0.0]):+.2f} W at "
                          f"{h['offload']:g}" for h in rows[1:] if h["offload"] in server)
                      + " to the plateau of offload 0 (target <= +0.1 W at 1.0).", ""]
    else:
        lines += ["## Inside a real ComfyUI server", "", f"Skipped: {result.get('server_skipped')}", ""]
    if result.get("ranks"):
        lines += host_memory_ranks.markdown(result["ranks"]) + [""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tightrope bench --host-memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", metavar="DIR", help="output folder (default benchmarks/results/cpu-<date>)")
    ap.add_argument("--skip-server", action="store_true", help="leave out the ComfyUI server part")
    ap.add_argument("--skip-ranks", action="store_true", help="leave out the 2-rank torchrun part")
    ap.add_argument("--server-control", action="store_true",
                    help="also a server whose prompts sample instead of training (ComfyUI's own after-prompt RSS)")
    ap.add_argument("--skip-dynamic", action="store_true", help="leave out the ComfyUI dynamic-VRAM part")
    ap.add_argument("--dynamic-only", action="store_true", help="only the ComfyUI dynamic-VRAM part")
    ap.add_argument("--server-only", action="store_true", help="only the ComfyUI server part (needs COMFYUI_DIR)")
    ap.add_argument("--hidden-size", type=int, default=None,
                    help="with --server-only (default 1024) or --device cuda (default 2048): the model's width, a "
                         "multiple of 128 (2048: W ~ 5.5 GB)")
    ap.add_argument("--offloads", type=float, nargs="+", default=list(OFFLOADS),
                    help="with --server-only or --device cuda: the offload fractions, one process each")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: the headless part on the GPU, pinned in place (bench/host_memory_cuda.py)")
    ap.add_argument("--child", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--rank-child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.hidden_size is not None and (args.hidden_size <= 0 or args.hidden_size % 128):
        ap.error(f"--hidden-size {args.hidden_size}: give a positive multiple of 128 (ComfyUI detects Flux widths "
                 "by head dim 128)")
    if args.child is not None:
        print(json.dumps(child(args.child, args.device, args.hidden_size)))
        return 0
    if args.rank_child:
        host_memory_ranks.rank_child(MODEL, float(args.rank_child[0]), args.rank_child[1] == "share")
        return 0
    if not os.path.exists("/proc/self/clear_refs"):
        print("error: the host-memory benchmark reads peak RSS from /proc (Linux only)", file=sys.stderr)
        return 2
    if args.device == "cuda" and args.child is None:
        return host_memory_cuda.main(args.out, args.hidden_size, tuple(args.offloads), measure, RUNS)
    if args.dynamic_only:
        return host_memory_dynamic.main(args.out, MODEL)
    if args.server_only:
        return server_only(args.hidden_size or MODEL["params"].hidden_size, tuple(args.offloads), args.server_control,
                           args.out)
    date = datetime.date.today().isoformat()
    result = {"date": date, "torch": torch.__version__, "device": "cpu", "rows": measure()}
    weights = result["rows"][0]["weights_bytes"]
    if args.skip_server:
        result["server_skipped"] = "--skip-server"
    elif not os.environ.get("COMFYUI_DIR"):
        result["server_skipped"] = host_memory_server.SKIP_REASON
        print(f"skipping the ComfyUI server part: {host_memory_server.SKIP_REASON}")
    else:
        result["server_env"] = host_memory_server.environment()
        result["server"] = host_memory_server.measure(MODEL["params"], OFFLOADS, weights,
                                                      control=args.server_control)
    if not args.skip_ranks:
        result["ranks"] = host_memory_ranks.measure(1.0, CHILD_ENV)
    save_cpu_result("host_memory", result, markdown(result), args.out)
    return 0 if args.skip_dynamic else host_memory_dynamic.main(args.out, MODEL)


if __name__ == "__main__":
    sys.exit(main())

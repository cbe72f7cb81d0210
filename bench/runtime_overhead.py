"""Runtime overhead benchmark (CPU): does the MemoryRuntime cost anything when it does nothing, and does
checkpointing really halve memory?

1. Overhead: MemoryRuntime at offload 0 / checkpoint off vs a plain PyTorch loop on the same model, inputs and
   steps (AdamW included). Repetitions interleave the two (alternating which goes first) so drift and noise hit
   both; the figure is the median of per-repetition time ratios. Target <= 1.05x.
2. Peak memory: a reference Flux large enough for activations to dominate, one training step with checkpoint off
   and with checkpoint all, each in its own subprocess reading its peak RSS (getrusage ru_maxrss), so the two
   peaks never mix; a third subprocess builds the same model and inputs without a step (the baseline: interpreter,
   torch, weights). Target: checkpoint-all peak <= 0.5x the checkpoint-off peak. The children run with glibc's
   mmap threshold fixed (CHILD_ENV), so that freed tensors leave the RSS as they would leave a GPU allocator's
   "allocated" count.

    python -m tightrope.bench.runtime_overhead [--out DIR] [--reps N] [--steps N]
    tightrope bench --runtime-overhead
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from ..memory.runtime import MemoryRuntime
from ..memory.strategy import Strategy
from ..training.models.reference_flux import FluxParams
from .models import build_bench_model
from .report import save_cpu_result

# step ~0.1 s on one thread: long enough to time, short enough for many repetitions
OVERHEAD_MODEL = dict(params=FluxParams(vec_in_dim=64, context_in_dim=128, hidden_size=256, num_heads=2, depth=2,
                                        depth_single_blocks=4, axes_dim=(16, 56, 56), guidance_embed=True),
                      txt_len=64, batch=1, resolution=256)
# activations dominate: 6 x (1024 image + 256 text) tokens at hidden 512 through 8 blocks (~2 GB saved for
# backward without checkpointing) against ~170 MB of fp32 weights. Enough blocks that one block's recompute (the
# transient peak under checkpointing) is a small part of the whole.
RSS_MODEL = dict(params=FluxParams(vec_in_dim=64, context_in_dim=64, hidden_size=512, num_heads=4, depth=2,
                                   depth_single_blocks=6, axes_dim=(16, 56, 56), guidance_embed=True),
                 txt_len=256, batch=6, resolution=512)
# glibc raises its mmap threshold after large frees and then keeps freed tensors in the heap, so RSS would measure
# the allocator's caching, not live memory; a fixed threshold returns every large tensor to the OS when freed
CHILD_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def _build(spec: dict):
    bench = build_bench_model("overhead", params=spec["params"], txt_len=spec["txt_len"], init_device="cpu")
    inputs, target = bench.make_inputs(spec["batch"], spec["resolution"])
    return bench, inputs, target


def _steps(model, inputs, target, opt, n: int, rt: MemoryRuntime | None) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        if rt:
            rt.start_step()
        loss = F.mse_loss(model(**inputs), target)
        loss.backward()
        if rt:
            rt.end_step()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def measure_overhead(reps: int = 9, steps: int = 5, threads: int = 1) -> dict:
    """Single-threaded by default: on a small shared CPU two intra-op threads make times swing several-fold."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _overhead(reps, steps, threads)
    finally:
        torch.set_num_threads(before)


def _overhead(reps: int, steps: int, threads: int) -> dict:
    bench, inputs, target = _build(OVERHEAD_MODEL)
    model = bench.model
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    strategy = Strategy.of(compute_dtype="fp32")
    _steps(model, inputs, target, opt, 2, None)  # warm-up: allocator, kernels, optimizer state
    plain, managed, apply_s = [], [], []
    for rep in range(reps):
        for which in ((0, 1) if rep % 2 == 0 else (1, 0)):
            if which == 0:
                plain.append(_steps(model, inputs, target, opt, steps, None))
            else:
                t0 = time.perf_counter()
                with MemoryRuntime(model, strategy, "cpu") as rt:
                    apply_s.append(time.perf_counter() - t0)
                    managed.append(_steps(model, inputs, target, opt, steps, rt))
    ratios = [m / p for m, p in zip(managed, plain)]
    return {"model": _describe(OVERHEAD_MODEL, bench), "strategy": strategy.to_flat(), "reps": reps,
            "steps_per_rep": steps, "threads": threads,
            "plain_step_s_median": statistics.median(plain) / steps,
            "runtime_step_s_median": statistics.median(managed) / steps,
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "apply_undo_s_median": statistics.median(apply_s), "target_ratio": 1.05}


def _describe(spec: dict, bench) -> dict:
    p = spec["params"]
    n_img, n_txt = bench.tokens(spec["resolution"])
    return {"hidden": p.hidden_size, "heads": p.num_heads, "double_blocks": p.depth,
            "single_blocks": p.depth_single_blocks, "batch": spec["batch"], "resolution": spec["resolution"],
            "tokens_per_sample": n_img + n_txt, "params": bench.total_params, "lora_params": bench.lora_params}


def rss_child(mode: str) -> dict:
    """Run in a fresh process: build, then (unless mode == 'baseline') one training step; report peak RSS."""
    bench, inputs, target = _build(RSS_MODEL)
    model = bench.model
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    t0 = time.perf_counter()
    if mode != "baseline":
        with MemoryRuntime(model, Strategy.of(compute_dtype="fp32", checkpoint=mode), "cpu"):
            _steps(model, inputs, target, opt, 1, None)
    # POSIX only, so imported here: `tightrope bench --host-memory` imports this module, and on Windows it says
    # "Linux only" instead of failing with ModuleNotFoundError
    import resource
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"mode": mode, "peak_rss_bytes": peak if sys.platform == "darwin" else peak * 1024,  # macOS: bytes
            "step_s": time.perf_counter() - t0,
            "model": _describe(RSS_MODEL, bench)}


def measure_rss() -> dict:
    out = {}
    for mode in ("baseline", "off", "all"):
        proc = subprocess.run([sys.executable, "-m", "tightrope.bench.runtime_overhead", "--rss-child", mode],
                              capture_output=True, text=True, check=False, env={**os.environ, **CHILD_ENV})
        if proc.returncode != 0:
            raise RuntimeError(f"RSS child '{mode}' failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
        out[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    base, off, ckpt = (out[m]["peak_rss_bytes"] for m in ("baseline", "off", "all"))
    return {"children": out, "model": out["off"]["model"], "rss_ratio_all_vs_off": ckpt / off,
            "step_memory_ratio_all_vs_off": (ckpt - base) / max(off - base, 1), "target_ratio": 0.5}


def markdown(result: dict) -> str:
    o, r = result["overhead"], result["rss"]
    c = r["children"]
    mib = 1 << 20
    return "\n".join([
        f"# Runtime overhead (CPU, {result['date']})", "",
        f"torch {result['torch']}, {os.cpu_count()} cores.", "",
        "## 1. MemoryRuntime (offload 0, checkpoint off) vs plain PyTorch", "",
        f"Model: {o['model']}; {o['reps']} interleaved repetitions of {o['steps_per_rep']} steps, "
        f"{o['threads']} thread(s).", "",
        "| plain s/step | runtime s/step | ratio (median) | min | max | apply+undo s | target |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        f"| {o['plain_step_s_median']:.4f} | {o['runtime_step_s_median']:.4f} | {o['ratio_median']:.3f} | "
        f"{o['ratio_min']:.3f} | {o['ratio_max']:.3f} | {o['apply_undo_s_median']:.4f} | <= {o['target_ratio']} |",
        "", "## 2. Peak RSS, checkpoint all vs off (one subprocess each)", "",
        f"Model: {r['model']}.", "",
        "| baseline (no step) MiB | checkpoint off MiB | checkpoint all MiB | all / off | step memory all / off | "
        "target |", "| --- | --- | --- | --- | --- | --- |",
        f"| {c['baseline']['peak_rss_bytes'] / mib:.0f} | {c['off']['peak_rss_bytes'] / mib:.0f} | "
        f"{c['all']['peak_rss_bytes'] / mib:.0f} | {r['rss_ratio_all_vs_off']:.3f} | "
        f"{r['step_memory_ratio_all_vs_off']:.3f} | <= {r['target_ratio']} |", "",
        "step memory = peak RSS minus the baseline (interpreter, torch, weights, inputs).", ""])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tightrope bench --runtime-overhead", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", metavar="DIR", help="output folder (default benchmarks/results/cpu-<date>)")
    ap.add_argument("--reps", type=int, default=9, help="interleaved repetitions (default 9)")
    ap.add_argument("--steps", type=int, default=5, help="steps per repetition (default 5)")
    ap.add_argument("--rss-child", choices=("baseline", "off", "all"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rss_child:
        print(json.dumps(rss_child(args.rss_child)))
        return 0
    if sys.platform == "win32":
        print("error: the runtime-overhead benchmark reads peak RSS with getrusage, which Windows lacks: run it on "
              "Linux or macOS", file=sys.stderr)
        return 2
    date = datetime.date.today().isoformat()
    result = {"date": date, "torch": torch.__version__, "overhead": measure_overhead(args.reps, args.steps),
              "rss": measure_rss()}
    save_cpu_result("runtime_overhead", result, markdown(result), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

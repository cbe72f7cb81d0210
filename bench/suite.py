"""The benchmark suite: probe, strategy/batch/resolution grid, planner check, report.

Order of a run:
  1. Build the model (random weights, LoRA), measure H2D bandwidth and the device's peak FLOP/s.
  2. Probe it at the primary batch/resolution (memory/probe.py): the profile gives every grid point a predicted
     peak and step time, and the planner its input.
  3. Measure every grid configuration (bench/measure.py), then the physical bound of each from its offload-0 twin.
  4. Planner check: plan for each budget (CUDA: 8/12/16/24 GiB; CPU: fractions of the no-offload peak), run the
     plan, record predicted vs measured.
  5. Write JSON, markdown and PNGs (bench/report.py).
"""
from __future__ import annotations

import datetime
import os
import platform
import time
from typing import Any, Callable

import torch

from ..memory.plan_cost import predict
from ..memory.planner import format_bytes, plan
from ..memory.probe import measure_h2d_bandwidth, probe_model
from ..memory.strategy import StrategyError
from . import report
from .flops import device_peak_flops, forward_flops, step_flops
from .grid import BenchConfig, full_grid, quick_grid, strategy_label
from .measure import add_bounds, fits, run_config, skip_word, skipped
from .models import build_bench_model

GiB = 1 << 30
CUDA_BUDGETS = (8 * GiB, 12 * GiB, 16 * GiB, 24 * GiB)
CPU_BUDGET_FRACTIONS = (0.5, 0.75, 1.0, 1.5)  # of the predicted no-offload, no-checkpoint peak


def default_out_dir(device: str) -> str:
    return os.path.join("benchmarks", "results", f"{device}-{datetime.date.today().isoformat()}")


def run_suite(model: str = "tiny", device: str = "cpu", *, quick: bool = False, steps: int | None = None,
              warmup: int | None = None, grid: list[BenchConfig] | None = None, out_dir: str | None = None,
              budgets: list[int] | None = None, run_planner: bool = True, measure_compile: bool | None = None,
              cpu_threads: int | None = 1, log: Callable[[str], None] = print) -> tuple[dict[str, Any], dict[str, str]]:
    """Run the suite and write its report; returns (result, written file paths).

    On CPU the run is single-threaded by default (cpu_threads=1): on a shared or small machine, two intra-op threads
    contending with anything else make step times swing several-fold; one thread gives repeatable figures."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise StrategyError("--device cuda was asked for but CUDA is not available: use --device cpu (or --quick)")
    threads = torch.get_num_threads()
    if dev.type == "cpu" and cpu_threads:
        torch.set_num_threads(cpu_threads)
    try:
        return _run(model, dev, quick, steps, warmup, grid, out_dir, budgets, run_planner, measure_compile, log)
    finally:
        torch.set_num_threads(threads)


def _run(model, dev, quick, steps, warmup, grid, out_dir, budgets, run_planner, measure_compile, log):
    steps = steps or (3 if quick else 5)
    warmup = 1 if quick and warmup is None else (2 if warmup is None else warmup)
    grid = grid or (quick_grid() if quick else full_grid(dev.type))
    started = time.perf_counter()
    log(f"building {model} ...")
    bench = build_bench_model(model)
    primary = grid[0]
    bandwidth = measure_h2d_bandwidth(dev)
    peak, peak_source = device_peak_flops(dev)
    meta = {"model": model, "device": dev.type, "device_name": _device_name(dev), "date": datetime.date.today()
            .isoformat(), "torch": torch.__version__, "python": platform.python_version(),
            "total_params": bench.total_params, "lora_params": bench.lora_params, "h2d_bytes_per_s": bandwidth,
            "peak_flops": peak, "peak_flops_source": peak_source, "steps": steps, "warmup": warmup,
            "primary_batch": primary.batch, "primary_resolution": primary.resolution}
    log(f"{bench.total_params / 1e9:.3g} B params; H2D {bandwidth / 1e9:.3g} GB/s; probing at batch "
        f"{primary.batch}, {primary.resolution} px ...")
    base = primary.strategy.replace(offload_fraction=0.0, checkpoint="off", activation_offload=False, compile="off")
    profile = probe_model(bench.model, bench.inputs_maker(primary.batch, primary.resolution, dev), dev, base,
                          measure_compile=(dev.type == "cuda") if measure_compile is None else measure_compile)
    flops_cache: dict[tuple[int, int], dict] = {}
    records = []
    for k, cfg in enumerate(grid):
        rec = run_config(bench, cfg, dev, steps=steps, warmup=warmup)
        _annotate(rec, cfg, bench, profile, primary.resolution, peak, flops_cache)
        records.append(rec)
        log(f"[{k + 1}/{len(grid)}] {cfg.name}: " + (skip_word(rec) or f"{rec['step_s']:.4g} s/step"))
    add_bounds(records, bandwidth)
    planner_rows = []
    if run_planner:
        if budgets is None:
            reference = predict(profile, base).peak_bytes
            budgets = list(CUDA_BUDGETS) if dev.type == "cuda" else [int(f * reference) for f in CPU_BUDGET_FRACTIONS]
        planner_rows = _planner_check(bench, profile, primary, dev, budgets, steps, warmup, log)
    meta["wall_s"] = time.perf_counter() - started
    result = {"meta": meta, "profile": profile.to_dict(), "configs": records, "planner": planner_rows}
    paths = report.write(result, out_dir or default_out_dir(dev.type))
    log(f"done in {meta['wall_s']:.0f} s: " + ", ".join(paths.values()))
    return result, paths


def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} thread(s))"


def _annotate(rec: dict, cfg: BenchConfig, bench, profile, probed_resolution: int, peak: float | None,
              cache: dict) -> None:
    """Predicted figures (at the probe's resolution only: another resolution changes the token count, and attention
    grows with its square, so it is not a linear rescale) and FLOP-based utilisation."""
    rec["predicted_peak_bytes"] = rec["predicted_step_s"] = None
    if cfg.resolution == probed_resolution:
        pred = predict(profile, cfg.strategy, batch_scale=cfg.batch / profile.batch)
        rec["predicted_peak_bytes"], rec["predicted_step_s"] = pred.peak_bytes, pred.step_s
    if skipped(rec):
        return
    key = (cfg.batch, cfg.resolution)
    if key not in cache:
        cache[key] = forward_flops(bench, cfg.batch, cfg.resolution)
    fl = step_flops(cache[key], cfg.strategy, profile.block_names)
    rec.update(model_flops=fl["model"], hardware_flops=fl["hardware"], recompute_fraction=fl["recompute_fraction"])
    rec["mfu"] = fl["model"] / (rec["step_s"] * peak) if peak else None
    rec["hfu"] = fl["hardware"] / (rec["step_s"] * peak) if peak else None


def _planner_check(bench, profile, primary: BenchConfig, dev, budgets, steps, warmup, log) -> list[dict]:
    rows = []
    for budget in budgets:
        try:
            p = plan(profile, budget)
        except StrategyError as exc:
            rows.append({"budget_bytes": budget, "error": str(exc)})
            log(f"plan for {format_bytes(budget)}: {exc}")
            continue
        cfg = BenchConfig(p.strategy, primary.batch, primary.resolution)
        measured = run_config(bench, cfg, dev, steps=steps, warmup=warmup)
        rows.append({"budget_bytes": budget, "strategy": p.strategy.to_flat(), "label": strategy_label(p.strategy),
                     "predicted_peak_bytes": p.predicted_peak_bytes, "predicted_step_s": p.predicted_step_s,
                     "explanation": p.explanation, "candidates": p.candidates_considered,
                     "breakdown": p.prediction.breakdown, "measured": measured,
                     "fits": fits(measured, budget) if dev.type == "cuda" else None})
        log(f"plan for {format_bytes(budget)}: {strategy_label(p.strategy)}: predicted {p.predicted_step_s:.3g} s, "
            f"measured " + (skip_word(measured) or f"{measured['step_s']:.3g} s"))
    return rows

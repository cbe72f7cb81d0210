"""`tightrope bench gpu-bench` (`make gpu-bench`): does the planner keep its promises, and does compile pay?

In order (the folder, the summary and the exit status as in bench/gpu_run.py):
  1. H2D bandwidth from pinned and from pageable host memory.
  2. Planner: the Flux-dev-shaped model probed once at 1024 px, batch 1, with the most frugal strategy (offload 1.0,
     checkpoint all, activation offload); then for each budget (6, 8, 12, 16, 24 GB) the plan, run with the budget
     emulated by torch.cuda.set_per_process_memory_fraction: predicted vs measured peak (reserved, and device used)
     and step time, the predicted bound max(C_fwd, X) + max(C_bwd, X) + other, and whether the plan fit. A plan that
     does not fit its budget (out of memory, or measured above it) fails the run: the planner promised it would.
  3. Compile: on the ~2 B model at 1024 px, per-block compile at activation budget 0.5 against eager checkpoint-all
     (s/step ratio; target >= 1.5x), with compile time and recompiles.
About 6-8 minutes on one H100. `--tiny`: the tiny model at 64 px, budgets as fractions of its predicted peak.
"""
from __future__ import annotations

import gc
import sys
from typing import Any

import torch

from ..memory.plan_cost import predict
from ..memory.planner import plan
from ..memory.probe import measure_h2d_bandwidth, probe_model
from ..memory.strategy import Strategy, StrategyError
from .grid import BenchConfig, strategy_label
from .gpu_run import Run, gib, run_main
from .measure import fits, memory_budget, run_config, skipped
from .models import build_bench_model

GB = 10 ** 9
PLANNER = {"model": "flux-dev", "resolution": 1024, "batch": 1, "budgets": [g * GB for g in (6, 8, 12, 16, 24)],
           "warmup": 1, "steps": 2}
COMPILE = {"model": "flux-2b", "resolution": 1024, "batch": 1, "warmup": 2, "steps": 3}
TINY_PLANNER = {"model": "tiny", "resolution": 64, "batch": 1, "budget_fractions": (0.75, 1.5), "warmup": 0,
                "steps": 1}
TINY_COMPILE = {"model": "tiny", "resolution": 64, "batch": 1, "warmup": 1, "steps": 1}


def main(argv: list[str] | None = None, log=print) -> int:
    return run_main("gpu-bench", argv, __doc__.splitlines()[0], _run, log)


def _run(run: Run, device: torch.device, tiny: bool, log) -> int:
    bw = run.section("bandwidth", lambda: {"pinned": measure_h2d_bandwidth(device, pinned=True),
                                           "pageable": measure_h2d_bandwidth(device, pinned=False)})
    if "pinned" in bw:
        run.add("H2D bandwidth pinned / pageable", f"{bw['pinned'] / 1e9:.3g} / {bw['pageable'] / 1e9:.3g} GB/s")
    planner = run.section("planner", lambda: _planner(device, TINY_PLANNER if tiny else PLANNER, log))
    for row in planner.get("plans", []) if isinstance(planner, dict) else []:
        _summarise_plan(run, row)
    compiled = run.section("compile", lambda: _compile(device, TINY_COMPILE if tiny else COMPILE, log))
    if isinstance(compiled, dict) and "speedup" in compiled:
        eager, comp = compiled["eager"], compiled["compiled"]
        run.add(f"{compiled['model']} {compiled['resolution']} px: compile@0.5 vs eager ckpt-all",
                f"{compiled['speedup']:.2f}x ({eager.get('step_s', 0):.3g} vs {comp.get('step_s', 0):.3g} s/step; "
                f"compile {comp.get('compile_s', 0):.0f} s, {comp.get('recompiles', '?')} recompiles after step 1)"
                if compiled["speedup"] else _why_no_speedup(eager, comp), ">= 1.5x (sd-scripts PR: 1.73x)",
                False if eager.get("failed") or comp.get("failed") else None)
    return run.finish()


def _why_no_speedup(eager: dict, compiled: dict) -> str:
    failed = [f"{name} crashed: {r['error'][:100]}" for name, r in (("eager", eager), ("compiled", compiled))
              if r.get("failed")]
    return "; ".join(failed) or "a run ran out of memory"


def _planner(device: torch.device, spec: dict, log) -> dict[str, Any]:
    cuda = device.type == "cuda"
    bench = build_bench_model(spec["model"])
    try:
        frugal = Strategy.of(compute_dtype="bf16" if cuda else "fp32", offload_fraction=1.0, checkpoint="all",
                             activation_offload=True)
        log(f"probing {spec['model']} at {spec['resolution']} px ...")
        profile = probe_model(bench.model, bench.inputs_maker(spec["batch"], spec["resolution"], device), device,
                              frugal, repeats=1)
        budgets = spec.get("budgets") or [int(f * predict(profile, frugal.replace(offload_fraction=0.0,
                                                                                   activation_offload=False,
                                                                                   checkpoint="off")).peak_bytes)
                                          for f in spec["budget_fractions"]]
        rows = []
        for budget in budgets:
            rows.append(_one_plan(bench, profile, budget, spec, device))
            log(f"  budget {budget / GB:.3g} GB: {rows[-1].get('label', rows[-1].get('error'))}")
    finally:
        del bench
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return {"model": spec["model"], "resolution": spec["resolution"], "profile": profile.to_dict(), "plans": rows}


def _one_plan(bench, profile, budget: int, spec: dict, device: torch.device) -> dict[str, Any]:
    try:
        p = plan(profile, budget)
    except StrategyError as exc:
        return {"budget_bytes": budget, "error": str(exc)}
    cfg = BenchConfig(p.strategy, spec["batch"], spec["resolution"])
    with memory_budget(device, budget):
        measured = run_config(bench, cfg, device, steps=spec["steps"], warmup=spec["warmup"])
    peak = max(measured.get("peak_reserved_bytes", 0), measured.get("device_used_bytes", 0))
    return {"budget_bytes": budget, "label": strategy_label(p.strategy), "strategy": p.strategy.to_flat(),
            "explanation": p.explanation, "predicted_peak_bytes": p.predicted_peak_bytes,
            "predicted_step_s": p.predicted_step_s, "predicted_bound_s": p.prediction.bound_s,
            "breakdown": p.prediction.breakdown, "measured": measured, "measured_peak_bytes": peak,
            "peak_error": peak / p.predicted_peak_bytes - 1 if peak else None,
            "fits": fits(measured, budget) if device.type == "cuda" else None}


def _summarise_plan(run: Run, row: dict) -> None:
    what = f"plan for {row['budget_bytes'] / GB:.3g} GB"
    if row.get("error"):
        run.add(what, f"no plan: {row['error'][:120]}", "every budget fits")
        return
    m = row["measured"]
    if m.get("oom"):
        run.add(f"{what}: {row['label']}", "out of memory", "fits", False if row["fits"] is not None else None)
        return
    if m.get("failed"):
        run.add(f"{what}: {row['label']}", f"crashed: {m['error'][:120]}", "runs", False)
        return
    error = f" ({row['peak_error']:+.0%})" if row["peak_error"] is not None else ""
    measured = gib(row["measured_peak_bytes"]) + error if row["measured_peak_bytes"] else "not measured (CPU)"
    run.add(f"{what}: {row['label']}: peak", f"predicted {gib(row['predicted_peak_bytes'])}, measured {measured}",
            "within 10 %, fits", row["fits"])
    run.add(f"{what}: step", f"predicted {row['predicted_step_s']:.3g} s, measured {m['step_s']:.3g} s, bound "
            f"{row['predicted_bound_s']:.3g} s (ratio {m['step_s'] / row['predicted_bound_s']:.2f})", "<= 1.15 x bound")


def _compile(device: torch.device, spec: dict, log) -> dict[str, Any]:
    cuda = device.type == "cuda"
    bench = build_bench_model(spec["model"])
    base = Strategy.of(compute_dtype="bf16" if cuda else "fp32",
                       compile_backend="inductor" if cuda else "aot_eager_decomp_partition")
    records = {}
    try:
        for key, strategy in (("eager", base.replace(checkpoint="all")),
                              ("compiled", base.replace(compile="per_block", activation_memory_budget=0.5))):
            log(f"  {spec['model']} {strategy_label(strategy)} ...")
            records[key] = run_config(bench, BenchConfig(strategy, spec["batch"], spec["resolution"]), device,
                                      steps=spec["steps"], warmup=spec["warmup"])
    finally:
        del bench
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    ok = not skipped(records["eager"]) and not skipped(records["compiled"])
    return {"model": spec["model"], "resolution": spec["resolution"], **records,
            "speedup": records["eager"]["step_s"] / records["compiled"]["step_s"] if ok else None}


if __name__ == "__main__":
    sys.exit(main())

"""`tightrope bench gpu-check` (`make gpu-check`): is the CUDA path correct, and what does the headline run cost?

In order (a section that crashes is recorded and the next one runs; see bench/gpu_run.py for the folder and exit):
  1. the equivalence matrix on the device against the CPU (bench/cuda_checks.py);
  2. the same with sleeps injected on the compute stream and on the copy streams (ordering bugs);
  3. the CUDA leak test;
  4. the headline: a Flux-dev-shaped model (random bf16 weights made on the machine, rank-16 LoRA) at 2048 px,
     batch 1: offload 0.9 + activation offload + checkpoint all; offload 1.0 (likewise); offload 1.0 at prefetch
     depth 0; offload 1.0 with the blocks in token chunks, at depth 1 and at depth 0, and at depth 0 with the
     optimizer on the host (the planner's least-peak configuration: bench/headline_plan.py), and that at depth 1
     (the planner's 4 GB plan); and their offload-0 twins, whose compute gives the bound
     max(C_fwd, X_fwd) + max(C_bwd, X_bwd) + optimizer of the others. The least-peak row runs one more step, from
     an emptied cache with the allocator's history recorded: allocator_trace.md says what was allocated, waiting
     and free when reserved memory peaked, and which request made the cache grow (bench/allocator_trace.py);
  5. the targets themselves: the least-peak configuration run under a 4 GB and a 3 GB cap, and the planner's 4 GB
     plan under a 4 GB cap (a smaller GPU emulated, as gpu-bench's budgets are): does it run there, and how much
     slower than uncapped. Uncapped, reserved memory also holds what the allocator keeps only because nothing asks
     it to give memory back, and blocks freed while a copy stream still reads them (record_stream); at a cap it
     first waits for those copies and empties its cache, then retries, and only then runs out of memory.
About 8-9 minutes on one H100 (estimated from the 2026-11-23 run's timings: today's rows have not run together).
`--tiny` runs three strategies of the matrix and the headline's on the tiny model at 64 px; with `--device cpu` (the
dry run) the sleeps are no-ops (no streams) and the devices are spelled "cpu" and "cpu:0".
"""
from __future__ import annotations

import gc
import sys
from typing import Any

import torch

from ..memory.probe import TOKEN_CHUNKS, measure_h2d_bandwidth
from ..memory.strategy import Strategy
from . import allocator_trace, cuda_checks
from .grid import BenchConfig, with_references
from .gpu_run import Run, gib, run_main
from .measure import add_bounds, fits, memory_budget, run_config, skip_word, skipped
from .models import build_bench_model

HEADLINE = {"model": "flux-dev", "resolution": 2048, "batch": 1, "warmup": 1, "steps": 2}
TINY = {"model": "tiny", "resolution": 64, "batch": 1, "warmup": 0, "steps": 1}
PEAK_TARGET = "<= 4.0 GB first, aim 3.0 (Stagehand: 4.15 GB on an RTX 3090)"
RATIO_TARGET = "<= 1.15"


# The planner's least-peak candidate for the headline (`tightrope bench headline-plan`; tests/bench check it is):
# every block offloaded through one cell of slots (single blocks still stream one ahead in it), every block's
# token-wise parts in chunks (memory/token_chunks.py; the count: memory/probe.py TOKEN_CHUNKS), and the LoRA's
# gradients and AdamW state in host memory (training/host_optimizer.py). The same without the last, as before it;
# and at prefetch depth 1: the planner's plan for 4 GB (faster by the model: the freed memory buys the deeper prefetch).
WITHOUT_OPTIMIZER_OFFLOAD = {"offload_fraction": 1.0, "prefetch_depth": 0, "token_chunks": TOKEN_CHUNKS}
LEAST_PEAK = {**WITHOUT_OPTIMIZER_OFFLOAD, "optimizer_offload": True}
PLAN_4GB = {**LEAST_PEAK, "prefetch_depth": 1}
# (strategy, cap in bytes, target): the 4 GB target and the 3 GB aim, on reserved memory. The aim last: the run ends
# with these, and the tightest cap, where the allocator empties its cache and retries most, is the slowest row and
# the first a time limit cuts
CAPPED = ((LEAST_PEAK, 4 * 10**9, "runs within 4.0 GB (first target)"),
          (PLAN_4GB, 4 * 10**9, "the planner's 4 GB plan fits 4 GB"),
          (LEAST_PEAK, 3 * 10**9, "runs within 3.0 GB (aim)"))
CAPPED_STEPS = 1  # measured steps under a cap (after the warm-up): whether it runs there, and roughly how much slower


def headline_configs(device_type: str, resolution: int, batch: int) -> list[BenchConfig]:
    base = Strategy.of(compute_dtype="bf16" if device_type == "cuda" else "fp32", checkpoint="all",
                       activation_offload=True)
    return with_references([BenchConfig(base.replace(offload_fraction=0.9), batch, resolution),
                            BenchConfig(base.replace(offload_fraction=1.0), batch, resolution),
                            BenchConfig(base.replace(offload_fraction=1.0, prefetch_depth=0), batch, resolution),
                            BenchConfig(base.replace(offload_fraction=1.0, token_chunks=TOKEN_CHUNKS), batch,
                                        resolution),
                            BenchConfig(base.replace(**WITHOUT_OPTIMIZER_OFFLOAD), batch, resolution),
                            BenchConfig(base.replace(**LEAST_PEAK), batch, resolution),
                            BenchConfig(base.replace(**PLAN_4GB), batch, resolution)])


def main(argv: list[str] | None = None, log=print) -> int:
    return run_main("gpu-check", argv, __doc__.splitlines()[0], _run, log)


def _run(run: Run, device: torch.device, tiny: bool, log) -> int:
    configs = cuda_checks.matrix(tiny=tiny)
    compiled = cuda_checks.compiled_matrix("inductor" if device.type == "cuda" else "aot_eager_decomp_partition")
    compiled = compiled if device.type == "cuda" else []  # CPU dry run: the test suite compiles on CPU already
    equivalence = run.section("equivalence", lambda: cuda_checks.run_matrix(device.type, configs + compiled, log=log))
    _summarise_matrix(run, "equivalence matrix vs CPU", equivalence)
    ordering = run.section("stream_ordering", lambda: cuda_checks.run_matrix(
        device.type, configs if device.type == "cuda" else configs[:1],
        injections=("sleep on compute stream", "sleep on copy streams"), log=log))
    _summarise_matrix(run, "with injected stream sleeps", ordering)
    edges = run.section("adjacent_registrations", lambda: cuda_checks.adjacent_registrations(device.type))
    if isinstance(edges, dict) and "registered" in edges:
        run.add("driver: copies across two adjacent page-locked registrations", "; ".join(
            f"{k}: {v}" for k, v in edges.items() if k.startswith(("D2H", "H2D"))), "informational")
    leak = run.section("leak_test", lambda: cuda_checks.run_leak_test(device.type, run.folder))
    if isinstance(leak, dict) and "passed" in leak:
        run.add(f"leak test ({leak['config']})", "passed" if leak["passed"] else leak["output"][-200:], "flat",
                leak["passed"])
    spec = TINY if tiny else HEADLINE
    headline = run.section("headline", lambda: _headline(device, spec, log, run))
    if isinstance(headline, dict) and "configs" in headline:
        _summarise_headline(run, headline)
        _summarise_capped(run, f"{headline['model']} {headline['resolution']} px", headline["capped"])
    return run.finish()


def _summarise_matrix(run: Run, what: str, rows: Any) -> None:
    if not isinstance(rows, list):
        return  # the section crashed: already in the summary
    failed = [r for r in rows if not r["passed"]]
    run.add(what, f"{len(rows) - len(failed)}/{len(rows)} configurations match", "all", not failed)
    for r in failed:
        run.add(f"  {r['injection']}: {r['config']}", r.get("error", "")[:160], "match", False)


def _headline(device: torch.device, spec: dict, log, run: Run) -> dict[str, Any]:
    """The headline rows, each written to the folder as soon as it is measured (a timeout keeps the rows done); the
    least-peak row also runs one traced step (bench/allocator_trace.py: why reserved exceeds allocated)."""
    log(f"building {spec['model']} (random weights) ...")
    bench = build_bench_model(spec["model"])
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the build's random draws leave cached blocks behind
    bandwidth = measure_h2d_bandwidth(device)
    records = []
    try:
        configs = headline_configs(device.type, spec["resolution"], spec["batch"])
        for cfg in configs:  # the offload-0 twin (the most memory) comes last
            records.append(run_config(bench, cfg, device, steps=spec["steps"], warmup=spec["warmup"],
                                      trace=_least_peak(cfg.strategy.to_flat())))
            r = records[-1]
            log(f"  {cfg.name}: " + (skip_word(r) or f"{r['step_s']:.3g} s/step, peak reserved "
                                    f"{gib(r['peak_reserved_bytes'])}"))
            _write_trace(run, r)
            run.result["sections"]["headline_rows_so_far"] = records
            run.write()
        add_bounds(records, bandwidth)
        capped = _capped(bench, spec, records, device, log, run)
        run.result["sections"].pop("headline_rows_so_far")  # only now: a crash under a cap keeps the rows above
    finally:
        del bench
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"model": spec["model"], "resolution": spec["resolution"], "batch": spec["batch"],
            "h2d_bytes_per_s": bandwidth, "configs": records, "capped": capped}


def _capped(bench, spec: dict, records: list[dict], device: torch.device, log, run: Run) -> list[dict[str, Any]]:
    """The CAPPED rows, each under its cap (measure.memory_budget), with the uncapped row's step time beside it."""
    base = headline_configs(device.type, spec["resolution"], spec["batch"])[0].strategy
    rows: list[dict[str, Any]] = []
    for changes, cap, target in CAPPED:
        cfg = BenchConfig(base.replace(**changes), spec["batch"], spec["resolution"])
        with memory_budget(device, cap):
            r = run_config(bench, cfg, device, steps=min(spec["steps"], CAPPED_STEPS), warmup=spec["warmup"])
        uncapped = next((u for u in records if u["strategy"] == r["strategy"] and not skipped(u)), None)
        r.update(cap_bytes=cap, target=target, fits=fits(r, cap) if device.type == "cuda" else None,
                 uncapped_step_s=uncapped["step_s"] if uncapped else None)
        rows.append(r)
        log(f"  {cfg.name} under a {cap / 1e9:g} GB cap: " + (skip_word(r) or f"{r['step_s']:.3g} s/step"))
        run.result["sections"]["headline_capped_so_far"] = rows
        run.write()
    run.result["sections"].pop("headline_capped_so_far", None)
    return rows


def _least_peak(flat: dict[str, Any]) -> bool:
    return all(flat[k] == v for k, v in LEAST_PEAK.items())


def _write_trace(run: Run, record: dict[str, Any]) -> None:
    trace = record.get("allocator_trace")
    if trace and "error" not in trace:
        title = f"{record['label']}, {record['resolution']} px, batch {record['batch']}"
        (run.folder / "allocator_trace.md").write_text(allocator_trace.markdown(trace, title), encoding="utf-8")
        events = trace.pop("compact", None)  # the events go to a file of their own, not into the JSON
        if events is not None:
            allocator_trace.write_compact(run.folder / "allocator_trace_events.json.gz", events, trace["baseline"])


def _summarise_headline(run: Run, headline: dict) -> None:
    px = f"{headline['model']} {headline['resolution']} px"
    for r in headline["configs"]:
        off = r["strategy"]["offload_fraction"]
        target = PEAK_TARGET if off == 0.9 or _least_peak(r["strategy"]) else ""
        if r.get("oom"):
            run.add(f"{px} {r['label']}", f"out of memory: {r.get('error', '')[:100]}", target)
            continue
        if r.get("failed"):  # a bug, not a figure: the section's other rows still ran
            run.add(f"{px} {r['label']}", f"crashed: {r['error'][:120]}", "runs", False)
            continue
        memory = (f"reserved {gib(r['peak_reserved_bytes'])} ({r['peak_reserved_bytes'] / 1e9:.2f} GB), allocated "
                  f"{gib(r['peak_allocated_bytes'])}, device used {gib(r['device_used_bytes'])}"
                  if r["peak_reserved_bytes"] else "not measured (CPU)")
        run.add(f"{px} {r['label']}: peak", memory, target)
        if r.get("activation_host"):
            run.add(f"{px} {r['label']}: activation host memory", _arena_line(r["activation_host"], r["d2h_bytes"]))
        if "allocator_trace" in r:
            run.add(f"{px} {r['label']}: allocator trace", _trace_line(r["allocator_trace"]))
        if off:
            ratio = r.get("bound_ratio")
            run.add(f"{px} {r['label']}: step / bound", f"{r['step_s']:.3g} s / {r['bound_s']:.3g} s = {ratio:.2f}"
                    if ratio else f"{r['step_s']:.3g} s (no bound)", RATIO_TARGET)
        else:
            run.add(f"{px} {r['label']}: compute (offload-0 twin)", f"{r['step_s']:.3g} s/step (fwd {r['fwd_s']:.3g}"
                    f", bwd {r['bwd_s']:.3g}, optimizer {r['opt_s']:.3g})")


def _arena_line(host: dict[str, Any], d2h_bytes: float) -> str:
    """Activation offload's host memory: its page-locked arena against the bytes a step copies out (torch's pinned
    allocator takes a power of two per buffer: by its rule 7.1 GiB for 5.5 GiB at 2048 px, activation_host.py)."""
    locked = "page-locked" if host["pinned"] else "pageable (page-locking refused)"
    return (f"arena {gib(host['arena_bytes'])} {locked} for {gib(d2h_bytes)} copied out per step; "
            f"{host['pageable_buffers']} pageable buffers (the first step's)")


def _summarise_capped(run: Run, px: str, rows: list[dict[str, Any]]) -> None:
    """Whether each capped row ran within its cap: a figure against the target (a miss is not a failed check), but a
    crash is a bug."""
    for r in rows:
        what = f"{px} {r['label']} under a {r['cap_bytes'] / 1e9:g} GB cap"
        if r.get("failed"):
            run.add(what, f"crashed: {r['error'][:120]}", "runs", False)
            continue
        if r.get("oom"):
            run.add(what, f"does not fit: out of memory ({r.get('error', '')[:80]})", r["target"])
            continue
        slower = f" = {r['step_s'] / r['uncapped_step_s']:.2f}x uncapped" if r.get("uncapped_step_s") else ""
        used = (f"peak reserved {gib(r['peak_reserved_bytes'])} ({r['peak_reserved_bytes'] / 1e9:.2f} GB), device "
                f"used {r['device_used_bytes'] / 1e9:.2f} GB; " if r["peak_reserved_bytes"] else "")
        verdict = {True: "fits", False: "over the cap", None: "no cap on the CPU"}[r["fits"]]
        run.add(what, f"{verdict}: {used}{r['step_s']:.3g} s/step{slower}", r["target"])


def _trace_line(t: dict[str, Any]) -> str:
    if "error" in t:
        return f"the traced step failed: {t['error'][:100]}"
    p, grew = t["at_peak"], t["grew_for"] or {"bytes": 0, "site": "?"}
    return (f"one step from an emptied cache: reserved {gib(t['peak_reserved'])}, allocated {gib(p['allocated'])}, "
            f"free in the cache {gib(p['free_in_cache'])}, waiting for streams {gib(p['waiting_for_streams'])}; "
            f"last growth for {grew['bytes'] / 2**20:.0f} MiB at `{grew['site']}` (allocator_trace.md)")


if __name__ == "__main__":
    sys.exit(main())

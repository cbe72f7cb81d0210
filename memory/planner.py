"""The automatic memory planner: the fastest strategy that fits a memory budget, explained in one paragraph.

It enumerates candidates (offload fraction 0..1 in steps of 0.05 through `select_offloaded`, prefetch depth 0 up
to the runtime's MAX_PREFETCH_DEPTH (depth 0 keeps one cell of slots: the least memory, for budgets nothing else
fits; small blocks still prefetch; each depth more costs a cell, so the budget bounds it, and depths past one cell
per offloaded block add nothing, see `prefetch_depths`),
checkpointing off / every 2nd block / all, activation offload on/off, and, when the profile measured it, per-block
compile at activation budgets 1.0 and 0.5, and token chunks at the count the profile measured them at (probe.py
says why that count), and, where the caller allows it, optimizer offload off/on), predicts each one's peak memory and
step time from a measured Profile (plan_cost.predict), and picks the fastest that fits; equal times go to the one
using less memory. A larger budget can therefore never give a slower plan: it only adds candidates (the one it
drops, an optimizer-offload twin once its twin without fits, is slower than that twin: `_memory_first`).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable

import torch

from .host_memory import HostNeeds
from .offload_selection import select_offloaded
from .plan_cost import ADAMW_BYTES_PER_ELEMENT, Prediction, host_step_s, predict
from .profile import Profile
from .strategy import (MAX_PREFETCH_DEPTH, ActivationOffloadConfig, Keep, OptimizerOffloadConfig, ShardingConfig,
                       Strategy, StrategyError)

OFFLOAD_GRID = tuple(round(0.05 * k, 2) for k in range(21))
AUTO_MARGIN_BYTES = 512 << 20  # left free by budget="auto": other processes, the display, allocator growth


@dataclass(frozen=True)
class Plan:
    strategy: Strategy
    predicted_peak_bytes: int
    predicted_step_s: float
    explanation: str
    candidates_considered: int
    prediction: Prediction
    budget_bytes: int


def format_bytes(n: float) -> str:
    """GiB for anything over a GiB (device memory is sold in GiB), else MiB/KiB."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def reads_free_memory(device: torch.device | str) -> bool:
    """Whether auto_budget can read what is free on `device` (only CUDA can)."""
    return torch.device(device).type == "cuda"


def auto_budget(device: torch.device | str, margin_bytes: int = AUTO_MARGIN_BYTES) -> int:
    """Free device memory now, minus a margin. Only CUDA can say what is free. Blocks this process's caching
    allocator holds but no tensor uses (a probe's, say) are free to the plan: the driver counts them as used."""
    device = torch.device(device)
    if not reads_free_memory(device):
        raise StrategyError(f"budget='auto' reads the free GPU memory, but the device is '{device}': give an "
                            "explicit budget in bytes (e.g. budget_bytes=12 * 2**30)")
    free, _total = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if free <= margin_bytes:
        raise StrategyError(f"budget='auto': only {format_bytes(free)} of {device} is free, less than the "
                            f"{format_bytes(margin_bytes)} margin: close other GPU programs or give a budget")
    return int(free - margin_bytes)


def candidate_strategies(profile: Profile, base: Strategy, *, allow_compile: bool = True,
                         compile_time_budget_s: float | None = None,
                         optimizer_offload: bool = True) -> list[tuple[Strategy, list[int]]]:
    """Distinct candidates with their offloaded blocks (offload fractions that pick the same blocks count once).
    optimizer_offload: each candidate also with optimizer offload, right after its twin without (not with sharding,
    which the Strategy refuses it with); False gives only candidates without."""
    offload_sets: dict[tuple[int, ...], float] = {}
    for f in (0.0,) if base.sharding.active else OFFLOAD_GRID:  # sharded blocks are not also offloaded
        chosen = tuple(select_offloaded(profile.block_frozen, base.replace(offload_fraction=f,
                                                                           offload_blocks=None).offload))
        offload_sets.setdefault(chosen, f)
    compiles = [("off", 1.0)]
    if allow_compile and compile_measured(profile):
        for b in (1.0, 0.5):
            seconds = sum(per[str(b)].compile_s for per in profile.compile.values())
            if compile_time_budget_s is None or seconds <= compile_time_budget_s:
                compiles.append(("per_block", b))
    chunk_counts = (1, profile.token_chunks) if profile.chunked and profile.token_chunks > 1 else (1,)
    optimizer = (False, True) if optimizer_offload and not base.sharding.active else (False,)
    out, seen = [], set()
    for chosen, f in offload_sets.items():
        for depth in (prefetch_depths(len(chosen)) if chosen else (base.offload.prefetch_depth,)):
            for ckpt in ("off", "every_n", "all"):
                for (compile_mode, budget), chunks in itertools.product(compiles, chunk_counts):
                    try:
                        s = base.replace(offload_fraction=f, offload_blocks=None, prefetch_depth=depth,
                                         checkpoint=ckpt, checkpoint_every=2, activation_offload=False,
                                         compile=compile_mode, activation_memory_budget=budget, token_chunks=chunks)
                    except StrategyError:
                        continue  # a combination the Strategy refuses (eager checkpointing of budget-compiled
                        # blocks, compiled blocks in token chunks)
                    # activation offload only moves what blocks keep at less than everything
                    compact = any(s.keeps(i) is not Keep.ALL for i in range(profile.n_blocks))
                    for act_offload, opt_offload in itertools.product((False, True) if compact else (False,),
                                                                      optimizer):
                        key = (chosen, depth, ckpt, compile_mode, budget, chunks, act_offload, opt_offload)
                        if key not in seen:
                            seen.add(key)
                            # by parts: the flat form's round trip would cost most of the planner's time
                            out.append((s.replace(activations=ActivationOffloadConfig(enabled=act_offload),
                                                  optimizer=OptimizerOffloadConfig(enabled=opt_offload)), list(chosen)))
    return out


def prefetch_depths(n_offloaded: int) -> range:
    """The depths worth trying for `n_offloaded` blocks: 0-2 always, deeper while a depth still adds a cell (the
    runtime keeps depth + 1 cells, at most one per offloaded block), up to the most the runtime takes."""
    return range(min(MAX_PREFETCH_DEPTH, max(2, n_offloaded - 1)) + 1)


def compile_measured(profile: Profile) -> bool:
    per_type = profile.compile or {}
    return bool(per_type) and all(t in per_type and {"1.0", "0.5"} <= set(per_type[t]) for t in profile.block_types)


def plan(profile: Profile, budget_bytes: int | str, *, batch_scale: float = 1.0, allow_compile: bool = True,
         compile_time_budget_s: float | None = None, base: Strategy | None = None, margin_fraction: float = 0.05,
         margin_bytes: int | None = None, device: torch.device | str | None = None,
         host: HostNeeds | None = None, sharding: ShardingConfig | None = None,
         optimizer_bytes: float = ADAMW_BYTES_PER_ELEMENT, optimizer_offload: bool = True,
         grad_accumulation: int = 1) -> Plan:
    """The fastest strategy predicted to fit `budget_bytes` (or 'auto': free CUDA memory minus a margin), and, given
    `host`, its host-RAM budget too. `sharding` (the launch's, e.g. --fsdp) is taken as given: a sharded run
    considers no layer offload, and its weights are predicted whole (per-rank bytes are not modelled yet: an
    overestimate for a model of many blocks, whose rank holds about 1/N of them plus two whole blocks).
    optimizer_bytes: the optimizer's state per trainable element (AdamW's 8 unless told). optimizer_offload: whether
    candidates may keep the optimizer in host memory (False where the session's optimizer cannot step there);
    grad_accumulation: the run's micro-batches per step (optimizer offload's host buffers depend on it)."""
    if budget_bytes == "auto":
        budget_bytes = auto_budget(device or profile.device)
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, float)) or budget_bytes <= 0:
        raise StrategyError(f"budget_bytes={budget_bytes!r} is not a memory budget: give a positive number of "
                            "bytes (e.g. 12 * 2**30) or 'auto'")
    base = base or _base_from(profile)
    if sharding is not None:
        base = base.replace(sharding=sharding)
    candidates = candidate_strategies(profile, base, allow_compile=allow_compile,
                                      compile_time_budget_s=compile_time_budget_s, optimizer_offload=optimizer_offload)
    kw = {"batch_scale": batch_scale, "margin_fraction": margin_fraction, "margin_bytes": margin_bytes,
          "optimizer_bytes": optimizer_bytes, "grad_accumulation": grad_accumulation}
    # memory first, for every candidate; step times (most of the cost) only for the ones that fit
    scored = _memory_first(profile, candidates, budget_bytes, kw)
    fitting = [(p, s) for p, s in scored if p.peak_bytes <= budget_bytes]
    if host is not None:
        fitting = host.keep_fitting(fitting, scored)
    fitting = _fastest(profile, fitting, kw)
    if not fitting:
        least = min(scored, key=lambda ps: ps[0].peak_bytes)
        raise StrategyError(
            f"no strategy fits {format_bytes(budget_bytes)}: this model at batch {profile.batch * batch_scale:g} "
            f"needs at least {format_bytes(least[0].peak_bytes)}, with the strategy that needs the least "
            f"({_describe(least[1], least[0], profile)}): raise the budget or reduce the batch/resolution")
    best, strategy = min(fitting, key=lambda ps: (round(ps[0].step_s, 9), ps[0].peak_bytes))
    text = explain(profile, strategy, best, int(budget_bytes), len(candidates), allow_compile)
    text += f" {host.explain(best)}" if host is not None else ""
    return Plan(strategy, best.peak_bytes, best.step_s, text, len(candidates), best, int(budget_bytes))


def _memory_first(profile: Profile, candidates: list[tuple[Strategy, list[int]]], budget: float,
                  kw: dict) -> list[tuple[Prediction, Strategy]]:
    """Each candidate's memory, except a deeper prefetch of a candidate that already did not fit: a depth more
    adds a cell or nothing (candidate_strategies lists the depths of a candidate in increasing order); and except an
    optimizer-offload candidate whose twin without (listed just before it) fits. The two differ only in the step's
    last part (plan_cost.predict): the device's optimizer step (optimizer_s) gives way to host_step_s, never less
    than optimizer_s plus the LoRA's copy back, and the gradients' copies to the host add to backward (or to the
    step, where copies are synchronous); the passes' pipelines are the same. So the twin is the faster by at least
    the copy back (the same, with the same peak, for a model with nothing to train: then the earlier one wins), and
    needs less host RAM: the candidate could not be chosen. A budget that grows drops such a candidate only for its
    faster twin: a larger budget still never gives a slower plan."""
    scored, too_big, twins_fit = [], set(), set()
    for s, off in candidates:
        variant = (tuple(off), s.checkpointing.mode, s.activations.enabled, s.compiler.scope,
                   s.compiler.activation_memory_budget, s.checkpointing.token_chunks, s.optimizer.enabled)
        if variant in too_big or (variant[:-1], s.offload.prefetch_depth) in twins_fit:
            continue
        p = predict(profile, s, offloaded=off, timed=False, **kw)
        if p.peak_bytes > budget:
            too_big.add(variant)
        elif not s.optimizer.enabled:
            twins_fit.add((variant[:-1], s.offload.prefetch_depth))
        scored.append((p, s))
    return scored


def _fastest(profile: Profile, fitting: list[tuple[Prediction, Strategy]],
             kw: dict) -> list[tuple[Prediction, Strategy]]:
    """The fitting candidates timed, in order of their lower bound, until the bound alone rules the rest out: a
    step is never faster than its bound, so what is left could neither beat nor tie the fastest so far. In the
    candidates' order, so that equal ones go to the same candidate as if all were timed."""
    timed, fastest = {}, math.inf
    for k in sorted(range(len(fitting)), key=lambda k: fitting[k][0].bound_s):
        p, s = fitting[k]
        if p.bound_s > fastest + 2e-9:  # plan() compares steps rounded to 1e-9 s
            break
        timed[k] = (predict(profile, s, offloaded=list(p.offloaded), **kw), s)
        fastest = min(fastest, timed[k][0].step_s)
    return [timed[k] for k in sorted(timed)]


def _base_from(profile: Profile) -> Strategy:
    probed = Strategy.from_dict(profile.strategy_base).to_flat()  # the tagged form, or the flat one of 0.1 profiles
    return Strategy.of(**{k: probed[k] for k in ("offload_policy", "compute_dtype", "weight_dtype", "pin_memory",
                                                 "block_lists", "compile_mode", "compile_backend")})


def _describe(s: Strategy, p: Prediction, profile: Profile) -> str:
    parts = [f"{len(p.offloaded)} of {profile.n_blocks} blocks offloaded",
             {"off": "no checkpointing", "all": "every block checkpointed",
              "every_n": f"one block in {s.checkpointing.every} checkpointed"}[s.checkpointing.mode]]
    if s.activations.enabled:
        parts.append("activation offload")
    if s.checkpointing.token_chunks > 1:
        parts.append(f"{s.checkpointing.token_chunks} token chunks")
    if s.compiler.per_block:
        parts.append(f"per-block compile at activation budget {s.compiler.activation_memory_budget:g}")
    if s.optimizer.enabled:
        parts.append("optimizer offload")
    return ", ".join(parts)


def explain(profile: Profile, s: Strategy, p: Prediction, budget: int, considered: int, allow_compile: bool) -> str:
    b = p.breakdown
    n = profile.n_blocks
    if p.offloaded:
        share = b["host_weights"] / max(sum(profile.block_frozen), 1)
        depth = s.offload.prefetch_depth
        first = (f"Offloading {share:.0%} of the blocks' frozen weights ({s.offload.policy}: {len(p.offloaded)} of "
                 f"{n} blocks) keeps {format_bytes(b['host_weights'])} of weights in host memory, "
                 + (f"streamed in {depth} block{'s' if depth > 1 else ''} ahead"
                    if depth else "each loaded when needed (blocks of half a slot or less stream ahead)"))
    else:
        first = f"All {n} blocks stay on the device ({format_bytes(b['weights'])} of weights)"
        if s.sharding.active:
            first += ", their frozen weights sharded over the ranks (predicted whole: an overestimate)"
    acts = {"off": "no checkpointing keeps every activation",
            "all": "checkpointing every block keeps only the block inputs",
            "every_n": f"checkpointing one block in {s.checkpointing.every} keeps only those blocks' inputs"}
    if s.keeps(0) is Keep.BUDGET:
        second = (f"each block is compiled with activation budget {s.compiler.activation_memory_budget:g}, so the "
                  "compiler recomputes the cheap ops")
    else:
        second = acts[s.checkpointing.mode]
        if s.compiler.per_block:
            second += ", with each block compiled"
        if s.checkpointing.token_chunks > 1:
            second += (f", and each block runs its token-wise parts in {s.checkpointing.token_chunks} token chunks, "
                       "recomputed in backward (a smaller working set)")
    second += f" ({format_bytes(b['activations'])} of activations"
    second += f", {format_bytes(b['host_activations'])} more waiting in host memory)" if s.activations.enabled \
        else ")"
    if s.compiler.per_block:
        second += f"; compiling takes about {p.compile_s:.0f} s once"
    if s.optimizer.enabled:
        second += ("; the LoRA's optimizer state and gradients wait in host memory "
                   f"({format_bytes(b['host_optimizer'])}, a CPU optimizer step and the LoRA's copy back take "
                   f"~{host_step_s(profile):.2g} s/step)")
    exposed = p.step_s - p.compute_s
    if not p.offloaded and not s.activations.enabled and not s.optimizer.enabled:
        third = "nothing is transferred"
    elif profile.device != "cuda":
        third = f"on {profile.device} the copies are synchronous and add ~{exposed:.2g} s/step"
    elif not profile.h2d_pinned:
        third = f"host memory is not pinned, so the copies are synchronous and add ~{exposed:.2g} s/step"
    elif exposed <= 0.02 * p.step_s:
        third = "transfers are hidden behind compute"
    else:
        third = (f"transfers add ~{exposed:.2g} s/step beyond compute (the physical bound is {p.bound_s:.2g} "
                 "s/step)")
    note = ""
    if allow_compile and not compile_measured(profile):
        note = (" Per-block compile was not considered: the probe did not measure it (it does on CUDA; "
                "probe_model(..., measure_compile=True) elsewhere).")
    return (f"{first}; {second}. Predicted {format_bytes(p.peak_bytes)} peak of your {format_bytes(budget)}, "
            f"~{p.step_s:.3g} s/step; {third} (best of {considered} candidates).{note}")


def autotune_batch(profile: Profile | Callable[[int], Profile], budget_bytes: int, *,
                   strategy: Strategy | None = None, max_batch: int = 4096, **plan_kwargs) -> int:
    """The largest batch whose predicted peak fits `budget_bytes`: with `strategy` fixed, or with the best plan for
    each batch. `profile` is a profile to scale linearly from its own batch, or a function batch -> Profile (e.g.
    re-probing). Exponential then binary search, as the TorchDiTan study did, since peak memory grows with batch."""
    def at(batch: int) -> Profile:
        return profile(batch) if callable(profile) else profile.at_batch(batch)

    def fits(batch: int) -> bool:
        prof = at(batch)
        if strategy is not None:
            return predict(prof, strategy).peak_bytes <= budget_bytes
        try:
            plan(prof, budget_bytes, **plan_kwargs)
            return True
        except StrategyError:
            return False

    if not fits(1):
        need = predict(at(1), strategy).peak_bytes if strategy is not None else None
        raise StrategyError(f"not even batch 1 fits {format_bytes(budget_bytes)}"
                            + (f" (it needs {format_bytes(need)})" if need else "")
                            + ": raise the budget, lower the resolution, or offload and checkpoint more")
    lo, hi = 1, 2
    while True:
        probe = min(hi, max_batch)
        if not fits(probe):
            hi = probe
            break
        lo = probe
        if lo == max_batch:
            return lo
        hi *= 2
    while hi - lo > 1:  # lo fits, hi does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo

"""Host-memory benchmark, 2 local ranks (torchrun data parallel, gloo, CPU): the host copies of the weights.

Each rank builds the same Flux-shaped model (W bytes), shares its frozen host weights with the other local rank
(memory/shared_host.py) or, for comparison, keeps its own copy (today's behaviour before sharing), then trains two
steps with offload 1.0. Every rank reads its own proportional set size (PSS, /proc/self/smaps_rollup: a page mapped
by two processes counts half in each) at the same points, between barriers: bare (interpreter, torch, process
group), with the model, after sharing, at the end of each step's backward, and after the run. Summed over the ranks
and taken above the bare processes, PSS counts every host page once: target for the weights with 2 ranks <= 1.1 W.

    python -m torch.distributed.run --standalone --nproc_per_node 2 -m tightrope.bench.host_memory_ranks 1.0 share
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

from ..memory.runtime import MemoryRuntime
from ..memory.shared_host import share_across_local_ranks
from ..memory.strategy import Strategy
from .models import build_bench_model

RANKS = 2


def pss_bytes() -> int:
    with open("/proc/self/smaps_rollup", encoding="utf-8", errors="surrogateescape") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))


def rank_child(model_spec: dict, offload: float, share: bool) -> None:
    """One rank (under torchrun): PSS at each phase; rank 0 prints every rank's figures as one JSON line."""
    dist = torch.distributed
    dist.init_process_group("gloo")
    phases: dict[str, int] = {}

    def mark(name: str) -> None:
        dist.barrier()
        phases[name] = pss_bytes()
        dist.barrier()

    mark("bare")
    bench = build_bench_model("host-memory", params=model_spec["params"], txt_len=model_spec["txt_len"],
                              init_device="cpu")
    model = bench.model
    inputs, target = bench.make_inputs(model_spec["batch"], model_spec["resolution"])
    mark("loaded")
    if share:
        share_across_local_ranks(model, int(os.environ["LOCAL_RANK"]))
    mark("shared")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    steps = []
    with MemoryRuntime(model, Strategy.of(offload_fraction=offload, compute_dtype="fp32"), "cpu") as rt:
        slots = rt.offload.slot_bytes() if rt.offload else 0
        for _ in range(2):
            F.mse_loss(model(**inputs), target).backward()
            mark("step")
            steps.append(phases["step"])
            opt.step()
            opt.zero_grad(set_to_none=True)
    mark("after")
    phases["step"] = max(steps)
    report = {**phases, "slot_bytes": slots,
              "weights_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, report)
    if dist.get_rank() == 0:
        print(json.dumps(gathered))
    dist.destroy_process_group()


def measure(offload: float, env: dict) -> list[dict]:
    """Two rows for `RANKS` local ranks at `offload`: each rank's own copy, and one shared copy."""
    rows = []
    for share in (False, True):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={RANKS}",
               "-m", "tightrope.bench.host_memory", "--rank-child", str(offload), "share" if share else "private"]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env={**os.environ, **env})
        if proc.returncode != 0:
            raise RuntimeError(f"{RANKS}-rank host-memory run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        ranks = json.loads(proc.stdout.strip().splitlines()[-1])
        w = ranks[0]["weights_bytes"]

        def above_bare(phase: str, less_slots: bool = False) -> float:
            return sum(r[phase] - r["bare"] - (r["slot_bytes"] if less_slots else 0) for r in ranks) / w
        rows.append({"offload": offload, "ranks": RANKS, "shared": share, "per_rank": ranks,
                     "weights_w": above_bare("shared"), "loaded_w": above_bare("loaded"),
                     "step_beyond_slots_w": above_bare("step", True), "after_w": above_bare("after"),
                     "slots_w": sum(r["slot_bytes"] for r in ranks) / w})
    return rows


def markdown(rows: list[dict]) -> list[str]:
    lines = [f"## {RANKS} local ranks (torchrun, gloo, data parallel), PSS summed over the ranks", "",
             "Above the bare processes (interpreter, torch, process group); PSS counts a page shared by both ranks "
             "once in the sum. Weights: after loading (each rank builds the model) and, with sharing, after the ranks "
             "mapped one shared copy. During a step: at the end of the backward, less the simulated device slots "
             "(2 per rank on the CPU device). Target for the weights: <= 1.1 W.", "",
             "| offload | host copy | loaded | weights (before training) | step, beyond the slots | after the run |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['offload']:g} | {'one, shared' if r['shared'] else 'one per rank'} | "
                     f"{r['loaded_w']:.2f} W | {r['weights_w']:.2f} W | {r['step_beyond_slots_w']:.2f} W | "
                     f"{r['after_w']:.2f} W |")
    return lines

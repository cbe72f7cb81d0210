"""`tightrope bench reserved-replay`: the headline configurations' allocated and reserved peaks, replayed through the
model of the CUDA caching allocator (bench/reserved_replay.py), next to what the H100 measured where it ran them.

The measured figures are read from the committed gpu-check results (MEASURED, both allocator modes), matched to the
replayed configurations by strategy. What the H100 reserved beyond the replay (the residual: allocations that are not
tensors, frees delayed by the copy stream, anything else the replay leaves out) is reported per configuration; for
the configurations not yet measured the replay is also shown plus the largest residual measured with the same
allocator, the assumption being that it does not grow, which only the next GPU run can check.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ..memory.strategy import Strategy
from .gpu_check import headline_configs
from .grid import strategy_label
from .measure import skipped
from .report import markdown_target
from .reserved_replay import replay_step, replayable

MEASURED = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "h100-2026-11-23"
RUNS = {True: "gpu-check.json", False: "gpu-check-default-allocator.json"}  # expandable segments -> file
GiB = float(1 << 30)


def measured(folder: Path, expandable: bool, model: str, resolution: int) -> dict[Strategy, tuple[int, int]]:
    """(peak allocated, peak reserved) per strategy of the headline run in `folder` made with that allocator."""
    path = folder / RUNS[expandable]
    if not path.is_file():
        return {}
    headline = json.loads(path.read_text(encoding="utf-8"))["sections"]["headline"]
    if (headline["model"], headline["resolution"], headline["batch"]) != (model, resolution, 1):
        return {}
    return {Strategy.from_dict(c["strategy"]): (c["peak_allocated_bytes"], c["peak_reserved_bytes"])
            for c in headline["configs"] if not skipped(c) and "peak_reserved_bytes" in c}


def rows(model: str = "flux-dev", resolution: int = 2048, folder: Path = MEASURED, log=None,
         strategies: list[Strategy] | None = None) -> list[dict]:
    """One row per allocator mode and strategy (default: gpu-check's headline configurations that can be replayed)."""
    if strategies is None:
        strategies = list(dict.fromkeys(c.strategy for c in headline_configs("cuda", resolution, 1)
                                        if replayable(c.strategy)))
    out = []
    for expandable in (True, False):
        seen = measured(folder, expandable, model, resolution)
        for s in strategies:
            t0 = time.perf_counter()
            r = replay_step(s, model, resolution, expandable_segments=expandable)
            row = {"strategy": s, "label": strategy_label(s), "expandable": expandable,
                   "replay_allocated": r.peak_allocated, "replay_reserved": r.peak_reserved,
                   "measured": seen.get(s), "replay_s": time.perf_counter() - t0}
            out.append(row)
            if log:
                log(f"replayed {row['label']} ({'expandable' if expandable else 'default'}): "
                    f"{r.peak_allocated / GiB:.2f} / {r.peak_reserved / GiB:.2f} GiB in {row['replay_s']:.0f} s")
    return out


def report(found: list[dict], model: str = "flux-dev", resolution: int = 2048, folder: Path = MEASURED) -> str:
    lines = [f"# Reserved memory replayed: {model} r16 bf16 {resolution} px, batch 1", "",
             "Command: `tightrope bench reserved-replay" + (f" --model {model}" if model != "flux-dev" else "")
             + (f" --resolution {resolution}" if resolution != 2048 else "") + "`", "",
             "Each configuration's step (two steps) on fake tensors, every tensor's birth and death replayed through "
             "the model of the CUDA caching allocator (memory/allocator_model.py; bench/reserved_replay.py says "
             "what is modelled and what is left out). Measured: the GPU run in "
             f"`{folder.name}` where it ran the same strategy with the same allocator.", "",
             "| allocator | configuration | replay: allocated | replay: reserved | measured: allocated | "
             "measured: reserved | measured - replay, reserved |", "| --- | --- | --- | --- | --- | --- | --- |"]
    residual = {True: [], False: []}
    for r in found:
        m = r["measured"]
        if m:
            residual[r["expandable"]].append(m[1] - r["replay_reserved"])
        cells = (f"{m[0] / GiB:.2f} GiB | {m[1] / GiB:.2f} GiB | {(m[1] - r['replay_reserved']) / GiB:+.2f} GiB"
                 if m else "not measured | | ")
        lines.append(f"| {'expandable' if r['expandable'] else 'default'} | `{r['label']}` | "
                     f"{r['replay_allocated'] / GiB:.2f} GiB | {r['replay_reserved'] / GiB:.2f} GiB | {cells} |")
    forecast = []
    for r in found:
        res = residual[r["expandable"]]
        if r["measured"] is None and res:
            total = r["replay_reserved"] + max(res)
            forecast.append(f"- `{r['label']}` ({'expandable' if r['expandable'] else 'default'} allocator): "
                            f"{total / GiB:.2f} GiB ({total / 1e9:.2f} GB) reserved")
    if forecast:
        lines += ["", "Not yet measured, replayed plus the largest residual measured with the same allocator (if the "
                  "residual does not grow; the next GPU run checks it):", ""] + forecast
    else:
        lines += ["", "Nothing measured to compare with: the replay alone."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tightrope bench reserved-replay", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="flux-dev", help="a benchmark model (bench/models.py)")
    ap.add_argument("--resolution", type=int, default=2048)
    ap.add_argument("--measured", metavar="DIR", type=Path, default=MEASURED,
                    help="a gpu-check results folder to compare with (default: the committed H100 run)")
    ap.add_argument("--out", metavar="FILE|DIR", help="also write the markdown here (in a folder: reserved_replay.md)")
    args = ap.parse_args(argv)
    try:  # before the replay: a bad path fails in a second, not after it
        out = markdown_target(args.out, "reserved_replay.md")
    except ValueError as e:
        ap.error(str(e))
    if not args.measured.is_dir():
        ap.error(f"--measured {args.measured}: no such folder; name a gpu-check results folder (one with "
                 "gpu_check.json), or leave it out for the committed H100 run")
    found = rows(args.model, args.resolution, args.measured, log=lambda m: print(m, file=sys.stderr))
    text = report(found, args.model, args.resolution, args.measured)
    print(text, end="")
    if out is not None:
        out.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Write a benchmark run: JSON (everything), a markdown table, and PNG charts (training/charts.py)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..memory.planner import format_bytes
from .measure import skipped
from ..training.charts import line_chart, scatter_chart

GiB = float(1 << 30)


def markdown_target(out: str | None, name: str) -> Path | None:
    """Where a report's `--out` writes its markdown: the file named, or `name` inside a folder named (an existing
    one, or a path ending in a separator, as the other benchmarks' --out DIR). ValueError, naming the fix, for a
    target whose folder does not exist."""
    if not out:
        return None
    path = Path(out)
    if path.is_dir() or out.endswith(("/", os.sep)):
        path = path / name
    if not path.parent.is_dir():
        raise ValueError(f"--out {out}: the folder {path.parent} does not exist; create it, or name a file in an "
                         "existing folder")
    return path


def _fmt(v: Any, spec: str = ".3g") -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def markdown(result: dict[str, Any]) -> str:
    meta = result["meta"]
    cuda = meta["device"] == "cuda"
    lines = [f"# Tightrope benchmark: {meta['model']} on {meta['device_name']} ({meta['date']})", "",
             f"{meta['total_params'] / 1e9:.3g} B parameters ({meta['lora_params'] / 1e6:.3g} M LoRA), "
             f"H2D {meta['h2d_bytes_per_s'] / 1e9:.3g} GB/s, peak {meta['peak_flops_source']}. "
             f"Medians of {meta['steps']} steps after {meta['warmup']} warm-up steps. "
             f"torch {meta['torch']}.", ""]
    mem_col = "peak alloc / reserved / device used GiB" if cuda else "predicted peak GiB (CPU: no allocator stats)"
    lines += [f"| config | s/step | img/s | {mem_col} | MFU | HFU | H2D GB/step | wait s | compile s | "
              "recompiles | bound s | ratio |", "|" + " --- |" * 12]
    for r in result["configs"]:
        if skipped(r):
            lines.append(f"| {r['name']} | {'OOM' if r.get('oom') else 'FAILED'} | | | | | | | | | | |")
            continue
        if cuda:
            mem = (f"{r['peak_allocated_bytes'] / GiB:.2f} / {r['peak_reserved_bytes'] / GiB:.2f} / "
                   f"{r.get('device_used_bytes', 0) / GiB:.2f}")
        else:
            mem = _fmt(r["predicted_peak_bytes"] / GiB if r.get("predicted_peak_bytes") else None, ".3g")
        lines.append(" | ".join([
            f"| {r['name']}", _fmt(r["step_s"]), _fmt(r["images_per_s"]), mem, _pct(r.get("mfu")),
            _pct(r.get("hfu")), _fmt(r["h2d_bytes"] / 1e9), _fmt(r["transfer_wait_s"]), _fmt(r["compile_s"], ".2f"),
            str(r["recompiles"]), _fmt(r.get("bound_s")), _fmt(r.get("bound_ratio"), ".2f")]) + " |")
    if result.get("planner"):
        lines += ["", "## Planner: predicted vs measured", "",
                  "| budget | strategy | predicted peak | measured peak reserved | fits | predicted s/step | "
                  "measured s/step |", "|" + " --- |" * 7]
        for p in result["planner"]:
            if p.get("error"):
                lines.append(f"| {format_bytes(p['budget_bytes'])} | infeasible: {p['error']} | | | | | |")
                continue
            m = p.get("measured") or {}
            peak = format_bytes(m["peak_reserved_bytes"]) if m.get("peak_reserved_bytes") else "–"
            lines.append(f"| {format_bytes(p['budget_bytes'])} | {p['label']} | "
                         f"{format_bytes(p['predicted_peak_bytes'])} | {peak} | {_fmt(p.get('fits'))} | "
                         f"{p['predicted_step_s']:.3g} | {_fmt(m.get('step_s'))} |")
        lines += [""] + [f"- {format_bytes(p['budget_bytes'])}: {p['explanation']}" for p in result["planner"]
                         if p.get("explanation")]
    lines += ["", "MFU = model FLOPs / (s/step x peak); model FLOPs = 2 F_base + 3 F_lora + 3 F_attn (frozen base: no "
              "weight gradients); HFU adds the recompute forward. bound = max(C_fwd, X_fwd) + max(C_bwd, X_bwd) + "
              "optimizer, C from the offload-0 twin, X = streamed bytes / H2D bandwidth; ratio = s/step / bound.", ""]
    return "\n".join(lines)


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.1f}%"


def charts(result: dict[str, Any]) -> dict[str, Any]:
    """name -> PIL image."""
    meta = result["meta"]
    cuda = meta["device"] == "cuda"
    primary = [r for r in result["configs"] if not skipped(r) and r["batch"] == meta["primary_batch"]
               and r["resolution"] == meta["primary_resolution"]]
    mems = [(r["peak_reserved_bytes"] if cuda else r.get("predicted_peak_bytes"), r) for r in primary]
    unit, size = _unit(max((m or 0 for m, _ in mems), default=0))
    points = [(m / size, r["step_s"], r["label"]) for m, r in mems if m]
    xlabel = f"peak reserved {unit}" if cuda else f"predicted peak {unit} (CPU)"
    out = {"frontier": scatter_chart(points, title=f"{meta['model']} memory vs speed ({meta['device_name']})",
                                     xlabel=xlabel, ylabel="s/step")}
    series: dict[str, list[tuple[float, float]]] = {}
    for r in primary:
        s = r["strategy"]
        if s["compile"] != "off" or s["prefetch_depth"] != 1:
            continue
        key = f"ckpt {s['checkpoint']}" + (" + act offload" if s["activation_offload"] else "")
        series.setdefault(key, []).append((s["offload_fraction"], r["step_s"]))
    out["offload"] = line_chart(series, title=f"{meta['model']}: s/step vs offloaded fraction",
                                xlabel="offload fraction", ylabel="s/step")
    plans = [p for p in result.get("planner", []) if not p.get("error") and p.get("measured")]
    if plans:
        unit, size = _unit(max(p["budget_bytes"] for p in plans))
        out["planner"] = line_chart(
            {"predicted": [(p["budget_bytes"] / size, p["predicted_step_s"]) for p in plans],
             "measured": [(p["budget_bytes"] / size, p["measured"].get("step_s", float("nan"))) for p in plans]},
            title="Planner: s/step by memory budget", xlabel=f"budget {unit}", ylabel="s/step")
    return out


def _unit(largest: float) -> tuple[str, float]:
    return ("GiB", GiB) if largest >= GiB else ("MiB", float(1 << 20))


def save_cpu_result(name: str, result: dict[str, Any], text: str, out: str | None) -> None:
    """`<out>/<name>.json` and `.md` (default out: benchmarks/results/cpu-<date>/), and the markdown printed."""
    out = out or os.path.join("benchmarks", "results", f"cpu-{result['date']}")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{name}.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1, sort_keys=True)
    with open(os.path.join(out, f"{name}.md"), "w", encoding="utf-8") as f:
        f.write(text)
    print(text)
    print(f"written: {os.path.join(out, name + '.json')} and .md")


def write(result: dict[str, Any], out_dir: str) -> dict[str, str]:
    """Files written, by kind."""
    os.makedirs(out_dir, exist_ok=True)
    model = result["meta"]["model"]
    paths = {"json": os.path.join(out_dir, f"bench-{model}.json"), "md": os.path.join(out_dir, f"bench-{model}.md")}
    with open(paths["json"], "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1, sort_keys=True, default=str)
    with open(paths["md"], "w", encoding="utf-8") as f:
        f.write(markdown(result))
    for name, img in charts(result).items():
        paths[name] = os.path.join(out_dir, f"{name}-{model}.png")
        img.save(paths[name])
    return paths

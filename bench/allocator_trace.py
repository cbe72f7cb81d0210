"""Why the CUDA caching allocator reserved more than the step allocated: one recorded step, replayed.

The first H100 run (benchmarks/results/h100-2026-11-23/notes.md) measured the headline's reserved peak 1.8 GiB above
its allocated peak, at every offload fraction; the 4 GB target is on reserved memory. `make gpu-check` therefore runs
one more step of the least-peak headline configuration with the allocator's history on
(`torch.cuda.memory._record_memory_history`, Python stacks), after `empty_cache()` so that the step grows the cache
from its persistent part (slots, LoRA, optimizer state), and replays the trace here:

- reserved memory: + segment_alloc / segment_map, - segment_free / segment_unmap (expandable segments map and unmap);
- allocated: + alloc, - free_requested; waiting for another stream (record_stream): free_requested until
  free_completed, neither allocated nor reusable;
- the moment reserved memory first reaches its maximum: what was allocated, waiting and free in the cache then, the
  request that made the cache grow, and the live allocations grouped by the innermost frame in Tightrope's own code
  (the trace lists a stack's innermost frame first, as torch.cuda._memory_viz reads it);
- every growth of the cache, by stream (each stream has its own pool: memory one stream frees is not another's).

Allocations made before the recording (the baseline) are known only by their total; their frees are counted.
"""
from __future__ import annotations

import contextlib
import gzip
import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator

import torch

from ..memory.allocator_model import CachingAllocatorModel

ROOT = os.path.realpath(Path(__file__).resolve().parents[1]) + os.sep
MAX_ENTRIES = 2_000_000  # one chunked headline step makes ~10^5 events; the ring keeps the newest, so leave room
GROW = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
MiB = float(1 << 20)


@contextlib.contextmanager
def recording(device: torch.device, max_entries: int = MAX_ENTRIES) -> Iterator[dict[str, Any]]:
    """Record the allocator's history on `device` (CUDA) inside the block; afterwards `box["trace"]` holds the
    device's trace entries, `box["baseline"]` the reserved/allocated bytes when recording began and `box["truncated"]`
    whether the ring of `max_entries` overflowed (then the replay from the baseline is wrong)."""
    box: dict[str, Any] = {"baseline": {"reserved": torch.cuda.memory_reserved(device),
                                        "allocated": torch.cuda.memory_allocated(device)}}
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                             max_entries=max_entries)
    try:
        yield box
        traces = torch.cuda.memory._snapshot(device)["device_traces"]
        box["trace"] = traces[device.index or 0] if traces else []
        box["truncated"] = len(box["trace"]) >= max_entries  # the ring dropped the oldest: the replay is wrong
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


_own: dict[str, str | None] = {}


def _own_path(filename: str) -> str | None:
    """`filename` relative to the package root when it is Tightrope's (not this module), else None."""
    if filename not in _own:
        real = os.path.realpath(filename)
        inside = real.startswith(ROOT) and not real.endswith(os.path.join("bench", "allocator_trace.py"))
        _own[filename] = real[len(ROOT):] if inside else None
    return _own[filename]


def where(frames: list[dict[str, Any]]) -> str:
    """The innermost frame in Tightrope's code as `path:line (function)`, else the innermost frame at all."""
    if isinstance(frames, str):  # a compact trace's event (read_compact): the site itself
        return frames
    for f in frames or ():
        path = _own_path(f.get("filename", ""))
        if path is not None:
            return f"{path}:{f.get('line')} ({f.get('name')})"
    if frames:
        f = frames[0]
        return f"{os.path.basename(f.get('filename', '?'))}:{f.get('line')} ({f.get('name')})"
    return "<no Python frame>"


def analyse(trace: list[dict[str, Any]], baseline: dict[str, int], top: int = 12) -> dict[str, Any]:
    """Replay `trace` from `baseline` (see the module's docstring). All sizes in bytes. The state "at the peak" is
    taken just after the request that made the cache grow to its peak got its memory."""
    reserved = peak = baseline["reserved"]
    peak_at = -1
    growth: list[dict[str, Any]] = []
    for i, e in enumerate(trace):
        sign = GROW.get(e["action"], 0)
        if not sign:
            continue
        reserved += sign * e["size"]
        if sign > 0:
            growth.append({"index": i, "bytes": e["size"], "stream": e.get("stream", 0),
                           "request": _describe(trace, _next_alloc(trace, i))})
        if reserved > peak:
            peak, peak_at = reserved, i
    request_at = _next_alloc(trace, peak_at) if peak_at >= 0 else None
    state = _replay(trace[:(peak_at if request_at is None else request_at) + 1], baseline)
    by_site: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, site in state["live"].values():
        by_site[site][0] += size
        by_site[site][1] += 1
    sites = sorted(by_site.items(), key=lambda kv: -kv[1][0])[:top]
    by_stream: dict[int, int] = defaultdict(int)
    for g in growth:
        by_stream[g["stream"]] += g["bytes"]
    return {"events": len(trace), "baseline": dict(baseline), "peak_reserved": peak,
            "at_peak": {"allocated": state["allocated"], "waiting_for_streams": state["waiting"],
                        "free_in_cache": peak - state["allocated"] - state["waiting"],
                        "recorded_live": sum(s for s, _ in state["live"].values()),
                        "baseline_freed": state["baseline_freed"]},
            "grew_for": _describe(trace, request_at),
            "live_by_site": [{"site": site, "bytes": b, "count": n} for site, (b, n) in sites],
            "growth_by_stream": dict(sorted(by_stream.items(), key=lambda kv: -kv[1])),
            "largest_growths": sorted(growth, key=lambda g: -g["bytes"])[:top]}


def model_growth(trace: list[dict[str, Any]], baseline_reserved: int) -> dict[str, Any]:
    """The allocator model (memory/allocator_model.py) given this step's own requests, sizes and streams, each
    returned to its cache when the GPU's allocator completed its free: how far the model's cache grows, next to how
    far the GPU's grew from the baseline. Equal growth says the model places these requests as CUDA does (so a gap
    between `tightrope bench reserved-replay` and the GPU lies in the requests the replay makes); a difference says
    the model misses a rule. Expandable segments are assumed when the trace maps pages."""
    expandable = any(e["action"] in ("segment_map", "segment_unmap") for e in trace)
    model = CachingAllocatorModel(expandable_segments=expandable)
    handles: dict[int, Any] = {}
    for e in trace:
        if e["action"] == "alloc":
            handles[e["addr"]] = model.malloc(e["size"], e.get("stream", 0))
        elif e["action"] == "free_completed" and e["addr"] in handles:
            model.free(handles.pop(e["addr"]))
    reserved = peak = baseline_reserved
    for e in trace:
        reserved += GROW.get(e["action"], 0) * e["size"]
        peak = max(peak, reserved)
    return {"expandable_segments": expandable, "gpu_growth": peak - baseline_reserved,
            "model_growth": model.peak_reserved, "model_peak_allocated": model.peak_allocated}


def compact(trace: list[dict[str, Any]]) -> list[list]:
    """The trace without its stacks: [action, address, bytes, stream, innermost frame of ours] per event, for a
    replay off the GPU machine (gpu-check writes it as allocator_trace_events.json.gz)."""
    return [[e["action"], e.get("addr", 0), e.get("size", 0), e.get("stream", 0), where(e.get("frames", []))]
            for e in trace]


def write_compact(path: Path, events: list[list], baseline: dict[str, int]) -> None:
    with gzip.open(path, "wt", encoding="utf-8") as f:
        json.dump({"baseline": baseline, "fields": ["action", "addr", "size", "stream", "site"], "events": events}, f)


def read_compact(path: Path) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """A written trace back in the format `analyse` and `model_growth` read (each stack replaced by its site)."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        data = json.load(f)
    return [{"action": a, "addr": addr, "size": size, "stream": stream, "frames": site}
            for a, addr, size, stream, site in data["events"]], data["baseline"]


def _next_alloc(trace: list[dict[str, Any]], i: int) -> int | None:
    """Index of the allocation that made the cache grow at entry i: the first alloc recorded after it."""
    for j in range(i + 1, min(len(trace), i + 64)):
        if trace[j]["action"] == "alloc":
            return j
    return None


def _describe(trace: list[dict[str, Any]], j: int | None) -> dict[str, Any] | None:
    if j is None:
        return None
    e = trace[j]
    return {"bytes": e["size"], "stream": e.get("stream", 0), "site": where(e.get("frames", []))}


def _replay(trace: list[dict[str, Any]], baseline: dict[str, int]) -> dict[str, Any]:
    allocated, waiting, baseline_freed = baseline["allocated"], 0, 0
    live: dict[int, tuple[int, str]] = {}
    pending: dict[int, int] = {}
    for e in trace:
        action = e["action"]
        if action == "alloc":
            allocated += e["size"]
            live[e["addr"]] = (e["size"], where(e.get("frames", [])))
        elif action == "free_requested":
            allocated -= e["size"]
            waiting += e["size"]
            pending[e["addr"]] = e["size"]
            if live.pop(e["addr"], None) is None:
                baseline_freed += e["size"]
        elif action == "free_completed":
            waiting -= pending.pop(e["addr"], e["size"])
    return {"allocated": allocated, "waiting": waiting, "live": live, "baseline_freed": baseline_freed}


def markdown(a: dict[str, Any], title: str) -> str:
    """The analysis as a short report (allocator_trace.md in the gpu-check folder)."""
    p, g = a["at_peak"], a["grew_for"]
    lines = [f"# Allocator trace: {title}", ""]
    if a.get("truncated"):
        lines += ["**The trace overflowed its ring (MAX_ENTRIES): the oldest events are lost and the figures below "
                  "are wrong.**", ""]
    lines += [f"{a['events']} allocator events in one step after empty_cache(); recording began at "
              f"{_mib(a['baseline']['reserved'])} reserved, {_mib(a['baseline']['allocated'])} allocated.", "",
              "| at the step's peak of reserved memory | MiB |", "| --- | --- |",
              f"| reserved | {_mib(a['peak_reserved'])} |", f"| allocated | {_mib(p['allocated'])} |",
              f"| freed, waiting for another stream | {_mib(p['waiting_for_streams'])} |",
              f"| free in the cache (reserved - allocated - waiting) | {_mib(p['free_in_cache'])} |", ""]
    if g:
        lines += [f"The cache grew to that peak for a {_mib(g['bytes'])} MiB request on stream {g['stream']} at "
                  f"`{g['site']}`: no free block of the cache held it.", ""]
    m = a.get("model")
    if m and "error" in m:
        lines += [f"The allocator model failed on this trace: {m['error']}", ""]
    elif m:
        kind = "expandable segments" if m["expandable_segments"] else "default segments"
        lines += [f"The allocator model (memory/allocator_model.py, {kind}) given this step's own requests grows its "
                  f"cache by {_mib(m['model_growth'])} MiB; the GPU's grew by {_mib(m['gpu_growth'])} MiB.", ""]
    lines += ["| live at the peak, allocated at | MiB | tensors |", "| --- | --- | --- |"]
    lines += [f"| `{s['site']}` | {_mib(s['bytes'])} | {s['count']} |" for s in a["live_by_site"]]
    lines += ["", "| cache growth by stream | MiB |", "| --- | --- |"]
    lines += [f"| {stream} | {_mib(b)} |" for stream, b in a["growth_by_stream"].items()]
    lines += ["", "| largest growths | MiB | stream | for a request of (MiB) | at |", "| --- | --- | --- | --- | --- |"]
    for gr in a["largest_growths"]:
        r = gr["request"] or {"bytes": 0, "site": "?"}
        lines.append(f"| event {gr['index']} | {_mib(gr['bytes'])} | {gr['stream']} | {_mib(r['bytes'])} | "
                     f"`{r['site']}` |")
    return "\n".join(lines) + "\n"


def _mib(n: float) -> str:
    return f"{n / MiB:.1f}"


def main(argv: list[str] | None = None) -> int:
    """`python -m tightrope.bench.allocator_trace allocator_trace_events.json.gz`: the report of a written trace
    again, off the GPU machine."""
    import argparse
    import sys
    ap = argparse.ArgumentParser(prog="python -m tightrope.bench.allocator_trace", description=main.__doc__)
    ap.add_argument("events", type=Path, help="allocator_trace_events.json.gz from a gpu-check folder")
    args = ap.parse_args(argv)
    trace, baseline = read_compact(args.events)
    analysis = dict(analyse(trace, baseline), model=model_growth(trace, baseline["reserved"]))
    sys.stdout.write(markdown(analysis, str(args.events)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What `gpu-check` and `gpu-bench` share: the command line, the results folder, the run's metadata, sections that
fail without stopping the run, and the summary table (printed, and written as markdown next to the JSON).

    tightrope bench gpu-check [--out DIR] [--device cuda|cpu] [--tiny]
    tightrope bench gpu-bench [--out DIR] [--device cuda|cpu] [--tiny]

The folder is --out, else $GPU_CHECK_OUT, else benchmarks/results/<device>-<date>/. Without CUDA (and without
`--device cpu`) the command says so in one line and exits 0. `--device cpu --tiny` is the dry run: the same
orchestration on tiny models in seconds (CI runs it); `--tiny` on a GPU is a one-minute smoke test of the plumbing.
Exit status: 0 when every correctness check passed, 1 when one failed or a section crashed, 2 for a usage error.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

GiB = float(1 << 30)


def parse(prog: str, argv: list[str], description: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"tightrope bench {prog}", description=description)
    ap.add_argument("--out", metavar="DIR", help="results folder (default: $GPU_CHECK_OUT, else "
                    "benchmarks/results/<device>-<date>/)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cuda (default); cpu only with --tiny, as a dry run of the orchestration")
    ap.add_argument("--tiny", action="store_true", help="tiny models and resolutions: a dry run (cpu) or a quick "
                    "smoke test of the plumbing (cuda)")
    args = ap.parse_args(argv)
    if args.device == "cpu" and not args.tiny:
        ap.error("--device cpu runs only as a dry run: add --tiny")
    return args


def no_cuda_line(prog: str) -> str | None:
    """The one line printed instead of a run when CUDA is missing (None when there is a GPU)."""
    if torch.cuda.is_available():
        return None
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    return (f"{prog}: no CUDA device here (torch {torch.__version__}, {build}): nothing to check; run it on a GPU "
            f"machine (or `tightrope bench {prog} --device cpu --tiny` for a dry run)")


def resolve_device(name: str) -> torch.device:
    """With its index: torch.device("cuda") != torch.device("cuda:0"), and some CUDA calls (the memory fraction)
    refuse a device without one."""
    device = torch.device(name)
    return torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" and device.index is None \
        else device


@contextlib.contextmanager
def one_cpu_thread(device: torch.device) -> Iterator[None]:
    """The CPU dry run uses one intra-op thread: on a small shared machine two threads contend and run several
    times slower than one. Restored afterwards."""
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def device_slug(device: torch.device) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def out_dir(given: str | None, device: torch.device) -> Path:
    folder = given or os.environ.get("GPU_CHECK_OUT") or os.path.join(
        "benchmarks", "results", f"{device_slug(device)}-{datetime.date.today().isoformat()}")
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    return path


def meta(device: torch.device, tiny: bool) -> dict[str, Any]:
    cuda = device.type == "cuda"
    return {"device": device.type,
            "device_name": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
            "device_memory_bytes": torch.cuda.get_device_properties(device).total_memory if cuda else None,
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if cuda else None, "driver": nvidia_driver() if cuda else None,
            "python": platform.python_version(), "peft": _version("peft"),
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "commit": _commit(), "tiny": tiny}


def _version(package: str) -> str | None:
    """An installed package's version (the GPU image's own: e.g. peft, whose LoRA forward the token-chunked single
    blocks compute by columns only where they recognise it, training/lora/linear_columns.py), or None."""
    from importlib import metadata
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _cell(text: str) -> str:
    """Text for one cell of the summary table: CUDA's errors run over several lines, and a '|' would split it."""
    return re.sub(r"\s*\n\s*", " ", text.strip("\n")).replace("|", "\\|")


def nvidia_driver(path: str = "/proc/driver/nvidia/version") -> str | None:
    """The NVIDIA kernel driver's version (e.g. '580.95.05'; Linux: /proc/driver/nvidia/version), or None. Page-locking
    read-only memory in place behaves differently across drivers (memory/host_pinning.py)."""
    try:
        with open(path, encoding="utf-8") as f:
            found = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", f.readline())
    except OSError:
        return None
    return found.group(1) if found else None


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parents[1]).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


class Run:
    """Sections in order; one that raises is recorded (type, message, traceback tail) and the next one runs."""

    def __init__(self, name: str, device: torch.device, tiny: bool, folder: Path, log: Callable[[str], None]):
        self.name, self.device, self.folder, self.log = name, device, folder, log
        self.result: dict[str, Any] = {"meta": meta(device, tiny), "sections": {}}
        self.summary: list[tuple[str, str, str, bool | None]] = []  # (what, result, target, passed or None)
        self.t0 = time.perf_counter()
        self.running: str | None = None  # the section under way (the files written meanwhile say so)
        self.finished = False

    def section(self, key: str, fn: Callable[[], Any]) -> Any:
        self.log(f"{self.name}: {key} ...")
        t0 = time.perf_counter()
        self.running = key
        self.write()  # stopped in this section, the files say so
        try:
            value = fn()
        except Exception as exc:
            value = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
            self.add(f"{key}: crashed", value["error"][:120], "runs", False)
        self.result["sections"][key] = value
        self.result["sections"][f"{key}_wall_s"] = time.perf_counter() - t0
        self.running = None
        self.write()  # a later crash (or a timeout) leaves what was done on disk
        return value

    def add(self, what: str, result: str, target: str = "", passed: bool | None = None) -> None:
        self.summary.append((_cell(what), _cell(result), _cell(target), passed))

    def failed(self) -> bool:
        return any(p is False for *_, p in self.summary)

    def table(self) -> str:
        m = self.result["meta"]
        rows = [f"# {self.name}: {m['device_name']} (torch {m['torch']}, CUDA {m['cuda']}, {m['date']})", "",
                "| check / measure | result | target | status |", "| --- | --- | --- | --- |"]
        for what, result, target, passed in self.summary:
            status = "–" if passed is None else ("PASS" if passed else "FAIL")
            rows.append(f"| {what} | {result} | {target} | {status} |")
        verdict = "FAILED" if self.failed() else "all checks passed"
        if not self.finished:  # written as it goes: a run stopped at a time limit must not read as a whole one
            verdict = (f"INCOMPLETE (stopped, or still running, in section '{self.running}'; its rows so far are in "
                       f"the JSON)" if self.running else "INCOMPLETE (stopped, or still running, between sections)") \
                + ("; FAILED so far" if self.failed() else "; nothing failed so far")
        rows += ["", f"{verdict}; wall {time.perf_counter() - self.t0:.0f} s; everything in "
                 f"{self.folder}/{self.name}.json"]
        return "\n".join(rows)

    def write(self) -> None:
        self.result["summary"] = [dict(zip(("what", "result", "target", "passed"), row)) for row in self.summary]
        self.result["wall_s"] = time.perf_counter() - self.t0
        self.result["complete"] = self.finished
        (self.folder / f"{self.name}.json").write_text(json.dumps(self.result, indent=1, sort_keys=True, default=str),
                                                            encoding="utf-8")
        (self.folder / f"{self.name}.md").write_text(self.table() + "\n", encoding="utf-8")

    def finish(self) -> int:
        self.finished, self.running = True, None
        self.write()
        self.log(self.table())
        return 1 if self.failed() else 0


def run_main(name: str, argv: list[str] | None, description: str, run: Callable[..., int], log) -> int:
    """gpu-check / gpu-bench's command line: one line and exit 0 without CUDA, else `run(Run, device, tiny, log)`."""
    args = parse(name, list(sys.argv[1:] if argv is None else argv), description)
    if args.device == "cuda":
        line = no_cuda_line(name)
        if line:
            log(line)
            return 0
    device = resolve_device(args.device)
    with one_cpu_thread(device):
        return run(Run(name, device, args.tiny, out_dir(args.out, device), log), device, args.tiny, log)


def gib(n: float | None) -> str:
    return "–" if n is None else f"{n / GiB:.2f} GiB"

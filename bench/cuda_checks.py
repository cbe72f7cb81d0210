"""Correctness checks for `tightrope bench gpu-check`: the runtime trains exactly like plain PyTorch on the device.

1. Equivalence matrix: the tiny two-stream model of the test suite (tests/helpers/two_stream.py: double and single
   blocks, keyword inputs, in-place residuals) trained 2 AdamW steps under every strategy, fp32 with TF32 off and
   evicted slots poisoned with NaN, with the device spelled without and with an index ("cuda" and "cuda:0"; "cpu"
   and "cpu:0" in the CPU dry run), against the plain-PyTorch run on the CPU. Both spellings must also move the
   same bytes (a device compared by its spelling once silently switched activation offload off).
2. The same matrix with `torch.cuda._sleep` queued on the compute stream (before every matmul and attention, in
   forward, recompute and backward) and on the side streams (on entering every `torch.cuda.stream` context the
   runtime opens): a missing wait between the streams then reads a slot before its copy lands, or overwrites it
   while a queued kernel still needs it, and the gradients show it. Two rows train 3 steps of 2 micro-batches each
   (`accumulation_matrix`): nothing synchronises between micro-batches, so host buffers reused within a step
   (the activation arena, the host optimizer's staging buffer) are reused with copies still queued.
3. The CUDA tests of the test suite, in their own process: the leak tests (tests/reliability/test_leaks.py: device
   memory flat over ten runs, pinned host memory given back after a run) and weights streamed from a read-only file
   mapping, page-locked read-only (tests/memory/test_host_pinning.py; ComfyUI's dynamic VRAM holds weights so), and
   the reference Flux's token-chunked blocks streamed through poisoned slots against the CPU
   (tests/training/test_reference_flux_chunks.py: RoPE rows per chunk, linear1 by weight rows, CUDA attention).
The test helpers are imported from the source checkout's tests/helpers (this is a developer's command).
"""
from __future__ import annotations

import contextlib
import itertools
import mmap
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path
from xml.etree import ElementTree
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..memory.host_pinning import _clear_last_error, _error_text
from ..memory.runtime import MemoryRuntime
from ..memory.strategy import Strategy

ROOT = Path(__file__).resolve().parents[1]
HELPERS = ROOT / "tests" / "helpers"
STEPS = 2
ACCUMULATION = (3, 2)  # steps, micro-batches per step (accumulation_matrix)
# fp32 on both sides with TF32 off: only the summation order differs (cuBLAS/SDPA vs CPU kernels), ~1e-6 relative
# per op over ~20 ops per pass; 1e-4 relative leaves ~5x above that, while a stale or poisoned weight is off by O(1)
# or NaN. On the CPU dry run the kernels are the same ones: the test suite's 1e-5.
TOLERANCE = {"cuda": (1e-4, 1e-5), "cpu": (1e-5, 1e-6)}
SLEEP_CYCLES = 1_000_000  # ~0.5 ms at H100 clocks: far longer than any copy of the tiny model's blocks


def two_stream():
    """tests/helpers/two_stream.py of the checkout (the test suite's model), imported by path."""
    if not (HELPERS / "two_stream.py").is_file():
        raise FileNotFoundError(f"{HELPERS / 'two_stream.py'} is missing: run gpu-check from a source checkout")
    sys.path.insert(0, str(HELPERS))
    try:
        import two_stream as module
    finally:
        sys.path.remove(str(HELPERS))
    return module


def matrix(tiny: bool = False) -> list[tuple[str, Strategy]]:
    """Eager: offload 0 / 0.5 / 1 x checkpoint off / all x activation offload; plus prefetch depth 2 and every-2nd,
    and token chunks (offload 1 + checkpoint all + activation offload; offload 0.5 alone), and the first of those with
    the optimizer on the host. tiny: four of them (the optimizer on the host, and three that still cover weight
    streaming with and without checkpointing and activation offload)."""
    out = []
    for off, ckpt, act in itertools.product((0.0, 0.5, 1.0), ("off", "all"), (False, True)):
        if act and ckpt == "off":
            continue  # activation offload only moves checkpointed blocks' inputs: the same run as without
        out.append((f"off{off:g} ckpt-{ckpt}" + (" actoff" if act else ""),
                    Strategy.of(compute_dtype="fp32", offload_fraction=off, checkpoint=ckpt, activation_offload=act)))
    out.append(("off0.5 ckpt-every2 actoff depth2", Strategy.of(compute_dtype="fp32", offload_fraction=0.5,
                                                               checkpoint="every_n", checkpoint_every=2,
                                                               activation_offload=True, prefetch_depth=2)))
    out += [(f"off{off:g} ckpt-{ckpt} chunks3" + (" actoff" if act else ""),
             Strategy.of(compute_dtype="fp32", offload_fraction=off, checkpoint=ckpt, activation_offload=act,
                         token_chunks=3))  # the test model's blocks have chunked forwards (two_stream.py)
            for off, ckpt, act in ((1.0, "all", True), (0.5, "off", False))]
    out.append(("off1 ckpt-all actoff chunks3 optoff",  # AdamW on the host: training/host_optimizer.py
                Strategy.of(compute_dtype="fp32", offload_fraction=1.0, checkpoint="all", activation_offload=True,
                            token_chunks=3, optimizer_offload=True)))
    return [out[k] for k in (3, 8, 9, -1)] if tiny else out + accumulation_matrix()


def accumulation_matrix() -> list[tuple[str, Strategy, int, int]]:
    """Rows of (name, strategy, steps, micro-batches): three steps of two micro-batches each, nothing synchronised
    between a step's micro-batches. Activation offload's host arena starts over for the second micro-batch while
    its first one's copies may still be queued (memory/activation_host.py), and the host optimizer adds the second
    micro-batch's gradients from its staging buffer (training/host_optimizer.py)."""
    return [(f"off{off:g} ckpt-all actoff{' optoff' if opt else ''} {ACCUMULATION[0]}x{ACCUMULATION[1]} micro",
             Strategy.of(compute_dtype="fp32", offload_fraction=off, checkpoint="all", activation_offload=True,
                         optimizer_offload=opt), *ACCUMULATION)
            for off, opt in ((1.0, False), (0.5, True))]


def compiled_matrix(backend: str) -> list[tuple[str, Strategy]]:
    return [(f"compile@{b:g} off0.5 actoff", Strategy.of(compute_dtype="fp32", offload_fraction=0.5,
                                                          compile="per_block", compile_backend=backend,
                                                          activation_memory_budget=b, activation_offload=True, **ckpt))
            for b, ckpt in ((1.0, {"checkpoint": "all"}), (0.5, {}))]


@contextlib.contextmanager
def exact_fp32() -> Iterator[None]:
    """TF32 off for matmuls and convolutions, restored afterwards."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


class _SlowCompute(TorchDispatchMode):
    """Queues a sleep on the current (compute) stream before every matmul and attention kernel."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        if "mm" in name or "scaled_dot_product" in name:
            torch.cuda._sleep(SLEEP_CYCLES)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def slow_side_streams() -> Iterator[None]:
    """Every `torch.cuda.stream(s)` context begins with a sleep queued on s (the runtime's copy streams)."""
    real = torch.cuda.stream

    @contextlib.contextmanager
    def slowed(stream):
        with real(stream):
            if stream is not None:
                torch.cuda._sleep(SLEEP_CYCLES)
            yield

    torch.cuda.stream = slowed
    try:
        yield
    finally:
        torch.cuda.stream = real


INJECTIONS: dict[str, Callable[[], Any]] = {"none": contextlib.nullcontext, "sleep on compute stream": _SlowCompute,
                                            "sleep on copy streams": slow_side_streams}


def run_matrix(device_type: str, configs: list[tuple], *, injections: tuple[str, ...] = ("none",),
               log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """One row per (injection, strategy): passed, the largest differences, and the bytes moved per spelling. A
    config is (name, strategy), or (name, strategy, steps, micro-batches)."""
    ts = two_stream()
    with exact_fp32():
        references: dict[tuple[int, int], Any] = {}
        spellings = (device_type, f"{device_type}:0")
        rows = []
        for injection in injections:
            for name, strategy, *schedule in configs:  # schedule: (steps, micro-batches), default (STEPS, 1)
                if injection != "none" and strategy.compiler.per_block:
                    continue  # a dispatch mode or patched stream context under the compiler tests the compiler
                schedule = tuple(schedule) or (STEPS, 1)
                if schedule not in references:
                    references[schedule] = ts.train_steps(ts.make_lora_model(), steps=schedule[0], micro=schedule[1])
                rows.append(_one(ts, references[schedule], name, strategy, spellings, injection, device_type,
                                 schedule))
                log(f"  [{'PASS' if rows[-1]['passed'] else 'FAIL'}] {injection}: {name}")
    return rows


def _one(ts, reference, name, strategy, spellings, injection, device_type, schedule=(STEPS, 1)) -> dict[str, Any]:
    row: dict[str, Any] = {"check": "equivalence", "injection": injection, "config": name,
                           "strategy": strategy.to_flat(), "passed": False}
    t0 = time.perf_counter()
    caught = warnings.catch_warnings(record=True)
    seen = caught.__enter__()
    warnings.simplefilter("always")
    try:
        counters = {}
        for spelling in spellings:
            model = ts.make_lora_model()
            inject = INJECTIONS[injection] if device_type == "cuda" else contextlib.nullcontext
            with MemoryRuntime(model, strategy, spelling, poison_slots=True, activation_min_bytes=0) as rt, inject():
                losses, grads = ts.train_steps(model, steps=schedule[0], runtime=rt, micro=schedule[1])
                counters[spelling] = {k: v for k, v in rt.counters().items() if k != "graphs"}  # graphs: global
            row[f"max_diff[{spelling}]"] = _compare(losses, grads, reference, *TOLERANCE[device_type])
        first, second = (counters[s] for s in spellings)
        row["counters"] = counters
        if first != second:
            raise AssertionError(f"'{spellings[0]}' and '{spellings[1]}' moved different bytes: {first} vs {second}")
        if strategy.offload.fraction and not first["h2d_bytes"]:
            raise AssertionError("offloaded blocks were never streamed in")
        if strategy.activations.enabled and strategy.checkpointing.mode != "off" and not first["d2h_bytes"]:
            raise AssertionError("activation offload sent nothing to the host")
        row["passed"] = True
    except Exception as exc:  # a failed check is a result: the next one still runs
        row["error"] = f"{type(exc).__name__}: {str(exc).strip()[:2000]}"
        row["traceback"] = traceback.format_exc()[-4000:]
    finally:
        caught.__exit__(None, None, None)
    if seen:  # e.g. a refused page-locking: the row says so
        row["warnings"] = sorted({f"{w.category.__name__}: {w.message}"[:500] for w in seen})
        if row["passed"] and any("refused to unpin" in w for w in row["warnings"]):
            row["passed"], row["error"] = False, "CUDA refused to unpin host memory (see warnings)"
    row["wall_s"] = time.perf_counter() - t0
    return row


def _compare(losses, grads, reference, rtol: float, atol: float) -> float:
    """Largest |difference| over losses and gradients; raises AssertionError beyond the tolerance."""
    ref_losses, ref_grads = reference
    worst = 0.0
    pairs = [(torch.tensor(losses), torch.tensor(ref_losses), "loss")]
    pairs += [(g[k].cpu(), rg[k], f"step {s} grad {k}") for s, (g, rg) in enumerate(zip(grads, ref_grads)) for k in rg]
    for got, want, what in pairs:
        if not torch.isfinite(got).all():
            raise AssertionError(f"{what} is not finite (a poisoned slot was read)")
        worst = max(worst, float((got - want).abs().max()))
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m, w=what: f"{w}: {m}")
    return worst


def adjacent_registrations(device_type: str) -> dict[str, Any]:
    """What the driver does with a copy whose host range spans two adjacent page-locked registrations, both ways: the
    runtime never makes one (host_pinning.copy_parts cuts at every edge), and the CPU model of the driver
    (tests/helpers/fake_cudart.py) refuses it; a copy partly in one registration and partly in none, refused on the
    first H100 run, is the reference. Informational: which rule the model should keep."""
    if device_type != "cuda":
        return {"check": "adjacent registrations", "skipped": "no CUDA"}
    page = mmap.PAGESIZE
    cudart, device = torch.cuda.cudart(), torch.device("cuda", torch.cuda.current_device())
    raw = torch.empty(6 * page, dtype=torch.uint8)
    start = -raw.data_ptr() % page
    registered = []
    for k in range(2):
        code = int(cudart.cudaHostRegister(raw.data_ptr() + start + k * page, page, 0))
        if code:  # refused: CUDA's last error stays set, and the next launch (the arange below) would raise it
            _clear_last_error(device, _error_text(cudart, code))
        else:
            registered.append(raw.data_ptr() + start + k * page)
    result: dict[str, Any] = {"check": "adjacent registrations", "registered": len(registered)}
    try:
        src = torch.arange(2 * page, device=device).to(torch.uint8)
        for name, offset in (("two adjacent registrations", start), ("registered + not registered", start + page)):
            host = raw[offset: offset + 2 * page]
            for direction in ("D2H", "H2D"):
                try:
                    if direction == "D2H":
                        host.copy_(src, non_blocking=True)
                    else:
                        torch.empty_like(src).copy_(host, non_blocking=True)
                    torch.cuda.synchronize(device)
                    result[f"{direction} {name}"] = "accepted"
                except RuntimeError as exc:
                    result[f"{direction} {name}"] = f"refused: {str(exc).splitlines()[0][:120]}"
                    with contextlib.suppress(RuntimeError):
                        torch.cuda.synchronize(device)
    finally:
        for address in registered:
            cudart.cudaHostUnregister(address)
    return result


def run_leak_test(device_type: str, folder: Path, timeout_s: float = 150.0) -> dict[str, Any]:
    """The test suite's CUDA tests (the leak tests, weights streamed from a read-only mapping, the chunked Flux, the
    optimizer on the host: its copies, and fp16 loss scaling with it) in a
    fresh process (on the CPU dry run: the leak tests' baseline test). It passes only if every test ran and passed (a
    skip is a failure here); pytest's junit XML says which. They take about 45 s on an H100 (the one test of 2026-11-23:
    25 s): the limit is there so that a hung test leaves the headline its time."""
    tests = [str(ROOT / "tests" / part) for part in ("reliability/test_leaks.py", "memory/test_host_pinning.py",
                                                     "training/test_reference_flux_chunks.py",
                                                     "training/test_host_optimizer.py",
                                                     "memory/test_activation_host.py")]
    select = "ten_runs_keep_cuda_memory_flat or pinned_host_memory_back or read_only_mapping_page_locked or " \
        "chunked_run_on_cuda or on_cuda_host_optimizer or on_cuda_fp16_overflow or page_sized_registrations" \
        if device_type == "cuda" else "baseline_is_taken_after_the_warmup"
    expected = 8 if device_type == "cuda" else 1  # on CUDA: 6 tests, and the chunked Flux run in 2 strategies
    report = (folder / "leak-test.xml").resolve()  # the test runs from the checkout's root
    cmd = [sys.executable, "-m", "pytest", *tests, "-k", select, "-p", "no:cacheprovider", f"--junitxml={report}"]
    t0 = time.perf_counter()
    counts: dict[str, int] = {}
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        out = (proc.stdout + proc.stderr).strip()
        suite = ElementTree.parse(report).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        passed = proc.returncode == 0 and counts["tests"] == expected and not any(
            counts[k] for k in ("failures", "errors", "skipped"))
    except subprocess.TimeoutExpired:
        out, passed = f"timed out after {timeout_s:.0f} s", False
    except (OSError, ElementTree.ParseError) as exc:
        out, passed = f"no test report ({exc})", False
    return {"check": "leak test", "config": select, "passed": passed, "counts": counts, "output": out[-3000:],
            "wall_s": time.perf_counter() - t0}

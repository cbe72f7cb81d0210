"""Measure one benchmark configuration: a few real LoRA training steps (AdamW) under the MemoryRuntime."""
from __future__ import annotations

import contextlib
import gc
import statistics
import time
import traceback
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from ..memory.runtime import MemoryRuntime
from ..training.host_optimizer import HostOptimizer
from ..training.optimizer import host_adamw
from . import allocator_trace
from .grid import BenchConfig
from .models import BenchModel


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_config(bench: BenchModel, config: BenchConfig, device: torch.device | str, *, steps: int = 5,
               warmup: int = 2, trace: bool = False) -> dict[str, Any]:
    """Median figures over `steps` measured steps after `warmup` steps. The first step's excess over a steady step
    is reported as compile (and other one-off) time. A CUDA out-of-memory is a result, not a crash; so is any other
    error (record["failed"], with its traceback) unless it left CUDA unusable (then it is raised). `trace` (CUDA):
    one more step, not measured, with the allocator's history recorded (bench/allocator_trace.py), in
    record["allocator_trace"]."""
    device = torch.device(device)
    model = bench.model
    record: dict[str, Any] = {"name": config.name, "label": config.label, "batch": config.batch,
                              "resolution": config.resolution, "strategy": config.strategy.to_flat()}
    inputs, target = bench.make_inputs(config.batch, config.resolution, device=device)
    steps_data: list[dict[str, float]] = []
    try:
        with MemoryRuntime(model, config.strategy, device) as rt:
            record["offloaded_blocks"] = len(rt.offloaded)
            record["weights_on_device_bytes"] = rt.device_weight_bytes()
            opt = _optimizer(model, config.strategy, device)
            try:
                for _ in range(warmup + steps):
                    steps_data.append(_one_step(model, rt, opt, inputs, target, device))
                if trace and device.type == "cuda":
                    record["allocator_trace"] = _traced_step(model, rt, opt, inputs, target, device)
                if rt.acts is not None and rt.acts.host is not None:  # activation offload's page-locked arena
                    host = rt.acts.host
                    record["activation_host"] = {"arena_bytes": host.arena_bytes, "high_water_bytes": host.high_water,
                                                 "pinned": host.pinned, "pageable_buffers": host.pageable_buffers}
            finally:
                if isinstance(opt, HostOptimizer):
                    opt.close()
            del opt
    except torch.cuda.OutOfMemoryError as exc:
        record.update(oom=True, error=str(exc).splitlines()[0])
        return record
    except Exception as exc:  # noqa: BLE001 - one configuration's crash must not cost the rest of its section
        record.update(oom=False, failed=True, error=f"{type(exc).__name__}: {str(exc)[:500]}",
                      traceback=traceback.format_exc()[-4000:])
        if device.type == "cuda":
            try:
                torch.cuda.synchronize(device)
            except Exception:  # noqa: BLE001 - a sticky CUDA error: every later configuration would fail too
                raise exc from None
        return record
    finally:
        for p in model.parameters():
            p.grad = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    steady = steps_data[warmup:] or steps_data[-1:]

    def med(key: str) -> float:
        return statistics.median(d[key] for d in steady)

    step_s = med("step_s")
    record.update(
        oom=False, steps=len(steady), step_s=step_s, fwd_s=med("fwd_s"), bwd_s=med("bwd_s"), opt_s=med("opt_s"),
        images_per_s=config.batch / step_s if step_s > 0 else None,
        peak_allocated_bytes=max(d["peak_allocated"] for d in steady),
        peak_reserved_bytes=max(d["peak_reserved"] for d in steady),
        device_used_bytes=max(d["device_used"] for d in steady),
        h2d_bytes=med("h2d_bytes"), h2d_fwd_bytes=med("h2d_fwd_bytes"), d2h_bytes=med("d2h_bytes"),
        grad_d2h_bytes=med("grad_d2h_bytes"),
        transfer_wait_s=med("wait_s"),
        compile_s=max(0.0, steps_data[0]["step_s"] - step_s),
        graphs_first_step=int(steps_data[0]["recompiles"]),
        recompiles=int(sum(d["recompiles"] for d in steps_data[1:])),
        loss=steady[-1]["loss"])
    return record


@contextlib.contextmanager
def memory_budget(device: torch.device, budget: int) -> Iterator[None]:
    """The caching allocator refuses to reserve more than `budget` bytes (a smaller GPU, emulated); lifted after."""
    if device.type != "cuda":
        yield
        return
    gc.collect()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), device)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        gc.collect()
        torch.cuda.empty_cache()


def skipped(record: dict[str, Any]) -> bool:
    """Whether a configuration has no figures: it ran out of memory, or failed (run_config)."""
    return bool(record.get("oom") or record.get("failed"))


def skip_word(record: dict[str, Any]) -> str:
    """'OOM', 'FAILED' or '' (the configuration has figures)."""
    return "OOM" if record.get("oom") else "FAILED" if record.get("failed") else ""


def fits(record: dict[str, Any], budget: int) -> bool:
    """A run fits a budget if it ran and neither what the allocator reserved nor what the device lost to the run
    (total - free, over the baseline) exceeds it: allocated alone leaves out the cache and fragmentation."""
    if skipped(record):
        return False
    return max(record.get("peak_reserved_bytes", 0), record.get("device_used_bytes", 0)) <= budget


def _traced_step(model, rt: MemoryRuntime, opt, inputs, target, device: torch.device) -> dict[str, Any]:
    """One step from an emptied cache (what persists between steps stays allocated) with the history recorded. A
    diagnosis: its failure (an out-of-memory included) is reported in the result, the measured steps are kept."""
    torch.cuda.empty_cache()
    try:
        with allocator_trace.recording(device) as box:
            data = _one_step(model, rt, opt, inputs, target, device)
        result = allocator_trace.analyse(box["trace"], box["baseline"])
        result["truncated"] = box["truncated"]
        result["compact"] = allocator_trace.compact(box["trace"])  # gpu-check writes it to a file of its own
        try:  # a check of the allocator model: its failure must not cost the analysis above
            result["model"] = allocator_trace.model_growth(box["trace"], box["baseline"]["reserved"])
        except Exception as exc:  # noqa: BLE001
            result["model"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    except Exception as exc:  # noqa: BLE001 - reported, and the run's figures stand
        opt.zero_grad(set_to_none=True)
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    result.update(step_peak_reserved=data["peak_reserved"], step_peak_allocated=data["peak_allocated"])
    return result


def _optimizer(model, strategy, device: torch.device):
    """AdamW over the LoRA: on the device, or on the host (fused) when the strategy offloads the optimizer."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if not strategy.optimizer.enabled:
        return torch.optim.AdamW(list(params.values()), lr=1e-5)
    return HostOptimizer(params, lambda host: host_adamw(list(host.values()), lr=1e-5), device,
                         pin=strategy.offload.pin_memory)


def _one_step(model, rt: MemoryRuntime, opt, inputs, target, device) -> dict[str, float]:
    rt.start_step()  # synchronises and resets CUDA peak stats
    h2d_before, grads_before = rt.counters()["h2d_bytes"], getattr(opt, "d2h_bytes", 0)
    t0 = time.perf_counter()
    with rt.autocast():
        out = model(**inputs)
    loss = F.mse_loss(out.float(), target)
    _sync(device)  # splits forward from backward time (one extra sync per step)
    t1 = time.perf_counter()
    h2d_fwd = rt.counters()["h2d_bytes"] - h2d_before
    loss.backward()
    _sync(device)
    t2 = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    stats = rt.end_step()  # synchronises: the step includes the optimizer, as the planner's prediction does
    t3 = time.perf_counter()
    return {"step_s": t3 - t0, "fwd_s": t1 - t0, "bwd_s": t2 - t1, "opt_s": t3 - t2,
            "peak_allocated": stats.peak_allocated_bytes, "peak_reserved": stats.peak_reserved_bytes,
            "device_used": stats.device_used_bytes,
            "h2d_bytes": stats.h2d_bytes, "h2d_fwd_bytes": h2d_fwd, "d2h_bytes": stats.d2h_bytes,
            "grad_d2h_bytes": getattr(opt, "d2h_bytes", 0) - grads_before,  # optimizer offload's gradients
            "wait_s": stats.transfer_wait_s, "recompiles": stats.recompiles, "loss": float(loss.detach())}


def add_bounds(records: list[dict[str, Any]], h2d_bytes_per_s: float) -> None:
    """Physical bound of every run: max(C_fwd, X_fwd) + max(C_bwd, X_bwd) + optimizer, with C from the offload-0
    twin's measured forward/backward (same batch, resolution, checkpointing, compile), X = bytes streamed in that
    pass / measured H2D bandwidth. Activation offload copies are not in X (they use their own stream)."""
    twins = {_twin_key(r): r for r in records if not skipped(r) and r["strategy"]["offload_fraction"] == 0}
    for r in records:
        ref = twins.get(_twin_key(r))
        if skipped(r) or ref is None:
            r["bound_s"] = r["bound_ratio"] = None
            continue
        x_fwd = r["h2d_fwd_bytes"] / h2d_bytes_per_s
        x_bwd = (r["h2d_bytes"] - r["h2d_fwd_bytes"]) / h2d_bytes_per_s
        bound = max(ref["fwd_s"], x_fwd) + max(ref["bwd_s"], x_bwd) + ref["opt_s"]
        r["bound_s"] = bound
        r["bound_ratio"] = r["step_s"] / bound if bound > 0 else None


def _twin_key(r: dict[str, Any]) -> tuple:
    s = dict(r["strategy"])
    for k in ("offload_fraction", "offload_blocks", "prefetch_depth", "offload_policy"):
        s.pop(k, None)
    return r["batch"], r["resolution"], tuple(sorted((k, str(v)) for k, v in s.items()))

"""Measure a model for the planner (measure, don't guess).

`probe_model` runs under the MemoryRuntime, so a model larger than the device can be probed with an offloading
`strategy_base`. Two passes:
  1. One whole training step (forward + backward) with every block checkpointed: the bytes each block keeps at
     its checkpoint boundary are counted with a saved-tensors hook (torch's non-reentrant checkpoint saves the block
     inputs outside its own hooks, so ours sees exactly those), attributed to blocks by forward pre/post hooks.
     Storages saved by several blocks (modulation vector, RoPE tables) are "shared" and kept once; saves outside
     any block are "other". Each block's inputs are captured on the host for pass 2.
  2. Each block alone, on its captured inputs, without checkpointing (its unwrapped forward, weights loaded by the
     runtime's layer offload): the bytes it saves for backward (weights excluded: they are not activations), the
     allocator's growth on CUDA, its real peak over forward + backward on CUDA (max_memory_allocated above what was
     allocated before it: activations, autocast and LoRA casts, gradients, workspaces), and its forward and backward
     compute time (CUDA events on CUDA). Only one block's activations are alive at a time, so the probe never needs
     the no-checkpoint peak: it needs what the backward of one checkpointed block needs anyway.
The probe runs with strategy_base's weight and activation offload (checkpointing all blocks), so with the most
frugal base (offload 1.0 + activation offload, as `auto` uses on CUDA) it fits any budget a plan could fit.
Optionally (measure_compile) the first block of each type is compiled per block at activation budgets 1.0 and 0.5.
Blocks whose type has a token-chunked forward (token_chunks.py) are measured a second time in pass 2, chunked
(`Profile.chunked`), at strategy_base's token_chunks, or TOKEN_CHUNKS when that is 1. TOKEN_CHUNKS = 8: a chunked
block's peak is the larger of attention's working set (q, k, v, its output, their gradients, fixed) and one chunk's
recompute plus backward (the unchunked transient / chunks); both grow with the tokens alike, so the count that
reaches attention's floor does not depend on the resolution. Measured on Flux-dev's blocks (bench headline-plan,
fake tensors): the peak falls from 31-34 H (H = tokens x hidden x 2 bytes) unchunked to 12.5/14.5 H at 4 chunks and
11.2/13.0 H at 8, and stays at 11.0/13.0 H at 16 and 32 (double/single block).
Last, one AdamW step over copies of the trainable parameters is timed on the device (`optimizer_s`) and one fused
AdamW step on the CPU over fp32 host copies (`host_optimizer_s`: the step optimizer offload takes instead).
"""
from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from .block_compile import CompileCaches, compile_block
from .layer_offload import in_backward
from .probe_tools import Captured, Clock, SavedBytes, measure_h2d_bandwidth, output_tensors
from .profile import ChunkedBlock, CompileFactors, Profile
from .runtime import MemoryRuntime
from .strategy import Strategy
from .token_chunks import ChunkContext, chunked_forward_for

__all__ = ["probe_model", "measure_h2d_bandwidth"]

TOKEN_CHUNKS = 8  # the chunk count chunked blocks are measured (and planned) at: see the module docstring

InputsMaker = Callable[[], tuple[dict[str, Any], Callable[[Any], torch.Tensor]]]


@dataclass
class _BlockProbe:
    """What measuring one block alone needs, the same for every block of a probe."""
    rt: MemoryRuntime   # the runtime the probe runs under (its device, layer offload and autocast)
    captured: list      # per block: its (args, kwargs) from pass 1, on the host
    shared: set[int]    # storages saved by several blocks: kept once, counted in act_shared, not per block
    weights: set[int]   # storages of the weights: not activations, never counted
    clock: Clock
    repeats: int        # timed calls per block (the median is kept); 0: one call, no warm-up
    progress: Callable[[int, int], None] | None = None  # told (blocks measured, of total) as each one is
    total: int = 0      # the block measurements the probe makes: eager, and chunked (twice) where it can
    done: int = 0


def _to_device(inputs: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def probe_model(model: nn.Module, make_inputs: InputsMaker, device: torch.device | str,
                strategy_base: Strategy | None = None, *, batch: int | None = None, repeats: int = 3,
                measure_compile: bool = False, h2d_nbytes: int | None = None,
                progress: Callable[[int, int], None] | None = None) -> Profile:
    """Measure `model` on the inputs `make_inputs()` returns ((kwargs for model, loss_fn(output) -> loss)).
    progress: told (block measurements done, of all) after each one (minutes on a large model).

    strategy_base supplies dtypes, pinning, block lists and (for a model larger than the device) the weight and
    activation offload used while probing; checkpointing and compile are set by the probe itself."""
    device = torch.device(device)
    base = strategy_base or Strategy()
    strategy = base.replace(checkpoint="all", compile="off")
    originals = {id(m): m.__dict__.get("forward") for m in model.modules()}
    clock = Clock(device)
    try:
        with MemoryRuntime(model, strategy, device) as rt:
            blocks = [b.module for b in rt.blocks]
            weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
            weights |= rt.offload.device_storage_ptrs() if rt.offload else set()
            inputs, loss_fn = make_inputs()
            inputs = _to_device(inputs, device)
            first = next((v for v in inputs.values() if isinstance(v, torch.Tensor)), None)
            batch = batch or (int(first.shape[0]) if first is not None and first.ndim else 1)

            boundary, captured, step = _whole_step(model, rt, blocks, inputs, loss_fn, weights, clock)
            shared = {p for p, (_, owners, _) in boundary.by_ptr.items()
                      if len({o for o in owners if o is not None}) > 1}
            act_allocs: list[list[int]] = [[] for _ in blocks]
            act_shared = act_other = 0
            for ptr, (n, owners, _) in boundary.by_ptr.items():
                inside = {o for o in owners if o is not None}
                if ptr in shared:
                    act_shared += n
                elif inside:
                    act_allocs[min(inside)].append(n)
                else:
                    act_other += n

            probe = _BlockProbe(rt, captured, shared, weights, clock, repeats, progress,
                                len(blocks) + 2 * sum(chunked_forward_for(m) is not None for m in blocks))
            forwards = [originals.get(id(m)) or type(m).forward.__get__(m) for m in blocks]  # unwrapped: no checkpoint
            eager = [_probe_block(probe, i, forward) for i, forward in enumerate(forwards)]
            act_full, act_alloc, peak, fwd_s, bwd_s = ([r[k] for r in eager]
                                                       for k in ("saved", "alloc", "peak", "fwd_s", "bwd_s"))
            compile_factors = _probe_compile(probe, blocks, forwards, eager) if measure_compile else None
            chunks = base.checkpointing.token_chunks if base.checkpointing.token_chunks > 1 else TOKEN_CHUNKS
            chunked = _probe_chunked(probe, blocks, forwards, chunks, cuda=device.type == "cuda")
            sizes = rt.sizes
            # pageable host memory makes non_blocking copies synchronous: measure (and plan) the runtime's copies
            pinned = rt.host_memory_pinned() if rt.offload is not None or rt.acts is not None \
                else base.offload.pin_memory and device.type == "cuda"
            trainable = [p for p in model.parameters() if p.requires_grad]
            optimizer_s = _time_optimizer(trainable, clock)
            host_optimizer_s = _time_host_optimizer(trainable)
            # inside the runtime: its undo then gives back the pinned buffer this takes from torch's host cache
            h2d_bytes_per_s = measure_h2d_bandwidth(device, h2d_nbytes, pinned=pinned)
    finally:
        for p in model.parameters():
            p.grad = None  # the probe's gradients are not the user's (also when it fails or is interrupted)
    return Profile(
        device=device.type, batch=batch, block_names=[b.name for b in rt.blocks],
        block_types=[type(m).__name__ for m in blocks], block_frozen=list(sizes.block_frozen),
        block_packed=list(sizes.block_packed), block_trainable=list(sizes.block_trainable),
        other_weight_bytes=sizes.other, trainable_bytes=sum(p.numel() * p.element_size() for p in trainable),
        trainable_numel=sum(p.numel() for p in trainable), act_full=act_full, act_ckpt=[sum(a) for a in act_allocs],
        act_shared=act_shared, act_other=act_other, fwd_s=fwd_s, bwd_s=bwd_s,
        other_s=max(0.0, step["other_fwd_s"]) * 3.0,  # backward outside the blocks taken as twice its forward
        h2d_bytes_per_s=h2d_bytes_per_s, h2d_pinned=pinned, optimizer_s=optimizer_s, host_optimizer_s=host_optimizer_s,
        act_full_alloc=act_alloc if device.type == "cuda" else None,
        block_peak_alloc=peak if device.type == "cuda" else None, compile=compile_factors,
        token_chunks=chunks if chunked else 1, chunked=chunked,
        measured={k: v for k, v in step.items() if k != "other_fwd_s"}, strategy_base=base.to_dict(),
        act_ckpt_allocs=act_allocs)


def _whole_step(model, rt, blocks, inputs, loss_fn, weights, clock):
    """Pass 1: two checkpoint-all steps; the first counts boundary bytes and captures inputs, the second is timed."""
    counter = SavedBytes(weights)
    captured: list[tuple[tuple, dict] | None] = [None] * len(blocks)
    store: dict[tuple, Captured] = {}
    marks: dict[int, list] = {}
    state = {"capture": True}

    def capture(v):
        if not isinstance(v, torch.Tensor):
            return v
        ptr = v.untyped_storage().data_ptr()
        key = (ptr, v.storage_offset(), tuple(v.shape), v.stride(), v.dtype)
        if key not in store:  # inputs every block receives are copied once
            store[key] = Captured(v.detach().to("cpu", copy=True), v.requires_grad, ptr)
        return store[key]

    def pre(i):
        def hook(module, args, kwargs):
            if in_backward():
                return
            counter.owner = i
            marks[i] = [clock.mark()]
            if state["capture"]:
                captured[i] = (tuple(capture(a) for a in args), {k: capture(v) for k, v in kwargs.items()})
        return hook

    def post(i):
        def hook(module, args, output):
            if not in_backward():
                counter.owner = None
                marks[i].append(clock.mark())
        return hook

    handles = [h for i, m in enumerate(blocks) for h in (m.register_forward_pre_hook(pre(i), with_kwargs=True),
                                                          m.register_forward_hook(post(i)))]
    result: dict[str, float] = {}
    try:
        for step in range(2):
            state["capture"] = step == 0
            rt.start_step()  # synchronises and resets the CUDA peak; end_step drops activation-offload bookkeeping
            t0 = clock.mark()
            with (_counting(counter, rt) if step == 0 else contextlib.nullcontext()), rt.autocast():
                loss = loss_fn(model(**inputs))
            t1 = clock.mark()
            loss.backward()
            t2 = clock.mark()
            block_fwd = sum(clock.seconds(a, b) for a, b in marks.values())
            result = {"other_fwd_s": clock.seconds(t0, t1) - block_fwd, "step_s_checkpoint_all": clock.seconds(t0, t2)}
            stats = rt.end_step()
            if clock.cuda:
                result["peak_allocated_checkpoint_all"] = float(stats.peak_allocated_bytes)
                result["peak_reserved_checkpoint_all"] = float(stats.peak_reserved_bytes)
            del loss
            marks.clear()
    finally:
        for h in handles:
            h.remove()
        counter.owner = None
    missing = [i for i, c in enumerate(captured) if c is None]
    if missing:
        raise RuntimeError(f"blocks {missing} did not run in the probe's forward: does the model call every block "
                           "from forward()? If some blocks are skipped, set Strategy.block_lists to the ones used")
    return counter, captured, result


@contextlib.contextmanager
def _counting(counter: SavedBytes, rt: MemoryRuntime):
    """Count saved tensors. Only the innermost saved-tensor hooks see a save, and with activation offload those are
    the runtime's own around each checkpointed block: so the counter also runs inside the runtime's pack."""
    acts = rt.acts
    if acts is not None:
        real = acts.pack
        acts.pack = lambda t, *args, **kwargs: real(counter.pack(t), *args, **kwargs)
    try:
        with counter.hooks():
            yield
    finally:
        if acts is not None:
            del acts.pack  # the instance attribute: the class's pack shows through again


def _time_optimizer(params: list[torch.Tensor], clock: Clock, repeats: int = 3) -> float:
    """Median AdamW step over copies of the trainable parameters (the user's own are never stepped)."""
    if not params:
        return 0.0
    copies = [p.detach().clone().requires_grad_() for p in params]
    for c in copies:
        c.grad = torch.randn_like(c)
    opt = torch.optim.AdamW(copies, lr=1e-5)
    opt.step()  # the first step allocates the moments
    times = []
    for _ in range(repeats):
        a = clock.mark()
        opt.step()
        times.append(clock.seconds(a, clock.mark()))
    return statistics.median(times)


def _time_host_optimizer(params: list[torch.Tensor], repeats: int = 3) -> float:
    """Median step of fused AdamW on the CPU (the default implementation where this torch has no fused CPU one) over
    fp32 host copies of the trainable parameters, views of one flat buffer as optimizer offload keeps them
    (training/host_optimizer.py): what a step of optimizer offload spends on the CPU. The user's own parameters are
    never stepped; the gradients are constants (the step's cost does not depend on their values)."""
    if not params:
        return 0.0
    numels = [p.numel() for p in params]
    flat, grads = torch.zeros(sum(numels)), torch.full((sum(numels),), 1e-3)
    copies = []
    for c, g, p in zip(flat.split(numels), grads.split(numels), params):
        c.copy_(p.detach().reshape(-1))
        copies.append(nn.Parameter(c.view(p.shape)))
        copies[-1].grad = g.view(p.shape)
    try:
        opt = torch.optim.AdamW(copies, lr=1e-5, fused=True)
        opt.step()  # the first step allocates the moments
    except (RuntimeError, ValueError):  # this torch has no fused AdamW on the CPU
        opt = torch.optim.AdamW(copies, lr=1e-5)
        opt.step()
    times = []
    for _ in range(repeats):
        a = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - a)
    return statistics.median(times)


def _restore(c, device, skip: set[int], shared: set[int]):
    if not isinstance(c, Captured):
        return c
    t = c.data.to(device, copy=True)  # fresh every call: blocks may add into their inputs in place
    if c.requires_grad:
        t = t.requires_grad_().clone()  # a non-leaf, so in-place updates inside the block stay legal
    if c.ptr in shared:
        skip.add(t.untyped_storage().data_ptr())  # kept once for all blocks: counted in act_shared
    return t


def _probe_block(probe: _BlockProbe, i: int, forward, *, repeats: int | None = None,
                 count: bool = True) -> dict[str, float]:
    """Block i alone, without checkpointing: bytes saved for backward, and median forward/backward times.
    repeats: probe.repeats unless given; count=False only times (a compile's first call)."""
    rt, captured, shared, clock = probe.rt, probe.captured[i], probe.shared, probe.clock
    repeats = probe.repeats if repeats is None else repeats
    device = rt.device
    fwd_t, bwd_t, saved, alloc, peak = [], [], 0, 0, 0
    # the first calls in a process pay one-off costs (allocator, kernel selection); repeats=0 is one timed call
    warmup = 2 if repeats else 0
    for r in range(max(1, repeats) + warmup):
        if rt.offload is not None:
            rt.offload.load(i)  # the unwrapped forward does not load: make the block's weights resident
        skip = set(probe.weights)
        args = tuple(_restore(a, device, skip, shared) for a in captured[0])
        kwargs = {k: _restore(v, device, skip, shared) for k, v in captured[1].items()}
        counter = SavedBytes(skip)
        measuring = r == 0 and count
        if clock.cuda:
            torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device) if clock.cuda else 0
        if clock.cuda and measuring:
            torch.cuda.reset_peak_memory_stats(device)
        a = clock.mark()
        with (counter.hooks() if measuring else contextlib.nullcontext()), rt.autocast():
            out = forward(*args, **kwargs)
        b = clock.mark()
        outs = [o for o in output_tensors(out) if o.requires_grad]
        if measuring:
            saved = counter.total()
            if clock.cuda:
                grown = torch.cuda.memory_allocated(device) - before
                alloc = max(0, grown - sum(o.untyped_storage().nbytes() for o in output_tensors(out)))
        grads = [torch.randn_like(o) for o in outs]
        c = clock.mark()
        if outs:
            torch.autograd.backward(outs, grads)
        d = clock.mark()
        if clock.cuda and measuring:
            torch.cuda.synchronize(device)
            peak = max(0, torch.cuda.max_memory_allocated(device) - before)
        if r >= warmup:
            fwd_t.append(clock.seconds(a, b))
            bwd_t.append(clock.seconds(c, d) if outs else 0.0)
        del out, outs, grads, args, kwargs
    probe.done += 1
    if probe.progress is not None:  # may raise (an interrupt in ComfyUI): between blocks, nothing half-done
        probe.progress(min(probe.done, probe.total), probe.total)
    return {"saved": saved, "alloc": alloc, "peak": peak, "fwd_s": statistics.median(fwd_t),
            "bwd_s": statistics.median(bwd_t)}


def _probe_compile(probe: _BlockProbe, blocks: list[nn.Module], forwards: list, eager: list[dict[str, float]]):
    """Per block type: compiled/eager time and saved-bytes ratios at activation budgets 1.0 and 0.5 (eager: each
    block's _probe_block result with its unwrapped forward)."""
    # compiled as a runtime compiles (CompileCaches): on the code objects later runtimes use and keep graphs on, so
    # under the same recompile limit (dynamo's default, 8, may already be held there: the probe ran eagerly)
    caches = CompileCaches()
    try:
        return _probe_compile_factors(probe, blocks, forwards, eager)
    finally:
        caches.close()


def _probe_compile_factors(probe: _BlockProbe, blocks: list[nn.Module], forwards: list,
                           eager: list[dict[str, float]]):
    factors: dict[str, dict[str, CompileFactors]] = {}
    for i, module in enumerate(blocks):
        kind = type(module).__name__
        if kind in factors:
            continue
        factors[kind] = {}
        for budget in (1.0, 0.5):
            config = dataclasses.replace(probe.rt.strategy.compiler, scope="per_block",
                                         activation_memory_budget=budget)
            compiled = compile_block(forwards[i], config)
            t0 = time.perf_counter()
            _probe_block(probe, i, compiled, repeats=0, count=False)
            if probe.clock.cuda:
                torch.cuda.synchronize(probe.rt.device)
            compile_s = time.perf_counter() - t0
            r, e = _probe_block(probe, i, compiled), eager[i]
            factors[kind][str(budget)] = CompileFactors(
                fwd_factor=r["fwd_s"] / max(e["fwd_s"], 1e-12), bwd_factor=r["bwd_s"] / max(e["bwd_s"], 1e-12),
                act_factor=r["saved"] / max(e["saved"], 1), compile_s=compile_s)
    return factors


def _probe_chunked(probe: _BlockProbe, blocks: list[nn.Module], forwards: list, chunks: int,
                   cuda: bool) -> list[ChunkedBlock | None] | None:
    """Each block that has a token-chunked forward, alone, chunked: saved bytes, peak (CUDA) and times."""
    if not any(chunked_forward_for(m) for m in blocks):
        return None
    out: list[ChunkedBlock | None] = []
    for i, module in enumerate(blocks):
        fn = chunked_forward_for(module)
        if fn is None:
            out.append(None)
            continue
        ctx = ChunkContext(chunks, plain=forwards[i])  # nothing else loads while one block is probed alone
        r = _probe_block(probe, i, lambda *a, fn=fn, m=module, ctx=ctx, **k: fn(m, ctx, *a, **k))
        # the forward the block's own checkpoint reruns in backward: its output regions skipped
        again = _probe_block(probe, i, lambda *a, fn=fn, m=module, ctx=ctx.rerun(), **k: fn(m, ctx, *a, **k),
                             count=False)
        out.append(ChunkedBlock(saved=int(r["saved"]), peak=int(r["peak"]) if cuda else 0, fwd_s=r["fwd_s"],
                                bwd_s=r["bwd_s"], recompute_s=again["fwd_s"]))
    return out

"""Predict a strategy's peak device memory and step time from a measured Profile.

Peak memory = resident weights (memory_model.predict_resident_weight_bytes: resident blocks + offload slots +
  everything outside the blocks, LoRA included) + LoRA gradients + AdamW state (two fp32 moments per trainable
  element; neither under optimizer offload, below, but the gradients in flight) + activations kept for backward (per
  block: all it saves, only its inputs when checkpointed, or what the compiler keeps under an activation budget;
  activation offload moves the kept bytes of checkpointed blocks to host memory except a two-block window) + inputs
  shared by all blocks + saves outside the blocks + the largest block's transient working set + the allocator's
  fragmentation + a margin. The transient is the block's peak over its forward + backward as the probe measured it
  on CUDA (everything the allocator held above the block's inputs: activations, autocast and LoRA casts,
  gradients, workspaces) less what is already counted as kept; without that measurement (CPU) it is
  estimated as the block's recomputed activations plus the gradients of its input and output. A budget limits what
  the CUDA caching allocator reserves, not what tensors occupy: the probe's own checkpoint-all step measures the gap
  (peak reserved - peak allocated), and the prediction adds it (scaled with the batch). On the first H100 run
  (2026-11-23) a fixed 256 MiB allowance let the 8 and 12 GB plans for Flux-dev at 1024 px run out of memory with
  0.3 GiB reserved but unallocated; the probe measured 0.74-1.0 GiB there.
Host memory for offloaded activations (breakdown "host_activations_pinned", what host_memory.HostNeeds counts) is
what the buffers take: page-locked on CUDA, in one arena of the step's buffers at activation_host.ALIGN apart
(`_arena_bytes`), pageable buffers of the same sizes elsewhere; "host_activations" is the bytes copied.
A strategy with token_chunks > 1 takes, for each block measured chunked (`Profile.chunked`), the chunked figures in
place of the block's own: bytes saved without checkpointing, the peak over forward + backward, and the forward and
backward times (the backward includes the chunks' recompute; a checkpointed block adds the forward its checkpoint
reruns, which skips the block's output regions: `recompute_s`, see token_chunks.ChunkContext.output_region).

Step time is a two-resource pipeline per pass (forward in block order, backward in reverse): the compute stream runs
blocks one after another; the copy engine streams an offloaded block's weights in (frozen weights travel
host-to-device only) once a slot is free. As in layer_offload, a copy is issued when the compute stream reaches the
block `prefetch_depth` offloaded blocks earlier (more while small blocks share the slot area's cells:
layer_offload.prefetch_window), and starts after the compute queued before it. Whatever the
schedule, a pass cannot beat its busiest resource, so the lower bound we report is
    step >= max(sum C_fwd, sum X_fwd) + max(sum C_bwd, sum X_bwd) + other + optimizer
with C_bwd including the recompute forward of checkpointed blocks and X the offloaded bytes / H2D bandwidth.
With depth-1 prefetch and every block offloaded the pipeline is close to sum_i max(C_i, X_i) per pass.
On CPU the runtime's copies are synchronous memcpys, and on CUDA so are copies from pageable (unpinned) host
memory: there the transfers add to compute instead of hiding.

Optimizer offload (Strategy.optimizer, training/host_optimizer.HostOptimizer) keeps the LoRA weights on the device but
moves each LoRA gradient to host memory as soon as backward completes it (freed on the device once copied) and steps
the optimizer on the CPU over host copies. The device then holds no optimizer state and, of the gradients, only those
in flight: about the LoRA gradients of the block whose backward runs and of the block before it (its copy may still
be under way), 2 x max(block_trainable), plus the trainable bytes outside the blocks. The step loses the device
optimizer step (optimizer_s) and gains the CPU step (Profile.host_optimizer_s, HOST_ADAMW_S_PER_ELEMENT per element
where the profile did not measure it; never less than optimizer_s: host_step_s) and the copy of the updated LoRA
back to the device (trainable_bytes over the H2D bandwidth, on the compute stream). The gradients' device-to-host
copies run on a side stream during backward on CUDA from pinned memory; elsewhere (CPU, pageable) they add
trainable_bytes / bandwidth. Host memory (breakdown
"host_optimizer", what host_memory.HostNeeds counts): the host copy of the LoRA, its gradients (each trainable_bytes:
flat buffers page-locked in place, so not rounded up to a power of two) and the optimizer state (optimizer_bytes per
element), and with grad_accumulation > 1 a third flat buffer of trainable_bytes where micro-batches' gradients add.
"""
from __future__ import annotations

import math
import mmap
from dataclasses import dataclass, field

from .activation_host import aligned
from .layer_offload import prefetch_window
from .memory_model import predict_resident_weight_bytes, predict_slot_bytes
from .offload_selection import select_offloaded
from .profile import Profile
from .strategy import Keep, Strategy

ADAMW_BYTES_PER_ELEMENT = 8  # exp_avg and exp_avg_sq, fp32
CUDA_MARGIN_BYTES = 256 << 20  # cuBLAS/attention workspaces; the least fragmentation allowance on CUDA
# Host-side cost of one block load or activation fetch (Python bookkeeping, event record/wait), an estimate. It also
# keeps a hidden transfer from being "free": with time to spare the planner does not offload for nothing.
LOAD_OVERHEAD_S = 50e-6
# One fused AdamW step on the CPU per trainable element, for a profile that did not time it (older profiles, shapes
# only). The step streams 28 bytes per element (reads weight, gradient and two fp32 moments; writes weight and moments)
# so it is bound by host memory bandwidth: over one flat tensor of 37.6 M fp32 elements (Flux-dev's rank-16 LoRA) it
# took 53-72 ms on a 2-core VM (1.4-1.9 ns/element) and 2.2 ns/element on one thread there. A workstation moves 20-50
# GB/s (0.6-1.4 ns/element): 2 ns is the pessimistic side.
HOST_ADAMW_S_PER_ELEMENT = 2e-9


@dataclass(frozen=True)
class Prediction:
    peak_bytes: int
    step_s: float
    bound_s: float                                   # the physical lower bound above
    compute_s: float                                 # compute alone (forward, backward, recompute, other)
    compile_s: float                                 # one-off compile time (not in step_s)
    offloaded: tuple[int, ...]
    breakdown: dict[str, int] = field(default_factory=dict)


def _interp(budget: float, points: dict[float, float]) -> float:
    xs = sorted(points)
    if budget <= xs[0]:
        return points[xs[0]]
    for lo, hi in zip(xs, xs[1:]):
        if budget <= hi:
            return points[lo] + (points[hi] - points[lo]) * (budget - lo) / (hi - lo)
    return points[xs[-1]]


def _compile_factors(profile: Profile, kind: str, budget: float,
                     ckpt_ratio: float) -> tuple[float, float, float, float]:
    """(fwd, bwd, activation, compile seconds) factors for one block type; 1.0s when the profile has none."""
    measured = (profile.compile or {}).get(kind)
    if not measured:
        return 1.0, 1.0, 1.0, 0.0
    pts = {float(b): f for b, f in measured.items()}
    acts = {b: f.act_factor for b, f in pts.items()}
    acts.setdefault(0.0, ckpt_ratio)  # budget 0 keeps (about) the block inputs, as checkpointing does
    return (_interp(budget, {b: f.fwd_factor for b, f in pts.items()}),
            _interp(budget, {b: f.bwd_factor for b, f in pts.items()}), _interp(budget, acts),
            _interp(budget, {b: f.compile_s for b, f in pts.items()}))


def fragmentation_bytes(profile: Profile) -> float:
    """Reserved but unallocated device memory at the probe's peak (0 when it was not measured: CPU, old profiles)."""
    m = profile.measured
    return max(0.0, m.get("peak_reserved_checkpoint_all", 0.0) - m.get("peak_allocated_checkpoint_all", 0.0))


def predict(profile: Profile, strategy: Strategy, *, batch_scale: float = 1.0, margin_fraction: float = 0.05,
            margin_bytes: int | None = None, offloaded: list[int] | None = None, timed: bool = True,
            optimizer_bytes: float = ADAMW_BYTES_PER_ELEMENT, grad_accumulation: int = 1) -> Prediction:
    """Peak memory and step time of `strategy` on `profile`. timed=False skips the copy/compute pipelines (most of
    the cost): step_s is then NaN, and bound_s (never more than step_s) is what a caller can rule a candidate out
    by. optimizer_bytes: the optimizer's state per trainable element (AdamW's two fp32 moments unless told), on the
    device, or in host memory under optimizer offload; grad_accumulation: micro-batches per optimizer step (above 1,
    optimizer offload keeps one more host buffer of the LoRA's size)."""
    n, s = profile.n_blocks, batch_scale
    off = sorted(offloaded if offloaded is not None else select_offloaded(profile.block_frozen, strategy.offload))
    compiled = strategy.compiler.per_block
    budget = strategy.compiler.activation_memory_budget
    kept, full, c_fwd, c_bwd, compact, block_peak, inputs_only = [], [], [], [], [], [], []
    compile_s: dict[str, float] = {}
    factors: dict[str, tuple[float, float, float, float]] = {}
    measured_peak = profile.block_peak_alloc or [0] * n
    for i in range(n):
        chunked = profile.chunked_block(i, strategy.checkpointing.token_chunks)
        f_i = (chunked.saved if chunked else profile.kept_full(i)) * s
        fwd_s, bwd_s = (chunked.fwd_s, chunked.bwd_s) if chunked else (profile.fwd_s[i], profile.bwd_s[i])
        refwd_s = chunked.recompute_s if chunked and chunked.recompute_s is not None else fwd_s
        block_peak.append((chunked.peak if chunked else measured_peak[i]) * s)
        ckpt_i = profile.act_ckpt[i] * s
        ff = bf = af = 1.0
        if compiled:
            kind = profile.block_types[i]
            if kind not in factors:
                factors[kind] = _compile_factors(profile, kind, budget, ckpt_i / max(f_i, 1.0))
            ff, bf, af, compile_s[kind] = factors[kind]
        keep = strategy.keeps(i)
        eager_ckpt = keep is Keep.INPUTS
        k_i = {Keep.INPUTS: ckpt_i, Keep.BUDGET: max(ckpt_i, f_i * af), Keep.ALL: f_i * af}[keep]
        kept.append(k_i)
        full.append(f_i * af if compiled else f_i)
        compact.append(keep is not Keep.ALL)
        inputs_only.append(eager_ckpt)
        c_fwd.append(fwd_s * s * ff)
        c_bwd.append(bwd_s * s * bf + (refwd_s * s * ff if eager_ckpt else 0.0))

    on_device = list(kept)
    act_host = [0.0] * n
    if strategy.activations.enabled:
        window = 2 * max((k for k, c in zip(kept, compact) if c), default=0.0)
        for i in range(n):
            if compact[i]:
                act_host[i], on_device[i] = kept[i], 0.0
        act_device = sum(on_device) + min(window, sum(act_host))
    else:
        act_device = sum(on_device)
    activations = act_device + (profile.act_shared + profile.act_other) * s
    transient = max((max((full[i] - kept[i] if compact[i] else 0.0) + 2 * profile.act_ckpt[i] * s,
                         block_peak[i] - kept[i]) for i in range(n)), default=0.0)
    weights = predict_resident_weight_bytes(profile.sizes(), off, strategy.offload.prefetch_depth)
    slots = predict_slot_bytes(profile.sizes(), off, strategy.offload.prefetch_depth)
    host_optimizer = 0.0
    if strategy.optimizer.enabled:  # gradients in flight only, the state in host memory (the module's docstring)
        outside = max(0, profile.trainable_bytes - sum(profile.block_trainable))
        grads = min(profile.trainable_bytes, 2 * max(profile.block_trainable, default=0) + outside)
        optimizer = 0.0
        host_optimizer = ((3 if grad_accumulation > 1 else 2) * profile.trainable_bytes
                          + optimizer_bytes * profile.trainable_numel)
    else:
        grads = profile.trainable_bytes
        optimizer = optimizer_bytes * profile.trainable_numel
    subtotal = weights + grads + optimizer + activations + transient
    if margin_bytes is None:
        margin_bytes = max(CUDA_MARGIN_BYTES, fragmentation_bytes(profile) * s) if profile.device == "cuda" else 0
    margin = margin_fraction * subtotal + margin_bytes
    breakdown = {"weights": int(weights), "slots": int(slots), "gradients": int(grads), "optimizer": int(optimizer),
                 "activations": int(activations), "transient": int(transient), "margin": int(margin),
                 "host_weights": int(sum(profile.block_frozen[i] for i in off)), "host_activations": int(sum(act_host)),
                 "host_optimizer": int(host_optimizer)}
    # what the host buffers take: page-locked ones are carved out of one arena (activation_host.py)
    pinned = profile.device == "cuda" and strategy.offload.pin_memory
    breakdown["host_activations_pinned"] = _arena_bytes([
        _activation_buffers(profile, i, act_host[i], s, inputs_only[i]) for i in range(n) if act_host[i]]) \
        if pinned else int(sum(act_host))
    other = profile.other_s * s + (host_step_s(profile) if strategy.optimizer.enabled else profile.optimizer_s)
    compute = sum(c_fwd) + sum(c_bwd) + other
    bw = max(profile.h2d_bytes_per_s, 1.0)
    grads_d2h = profile.trainable_bytes / bw if strategy.optimizer.enabled else 0.0  # the gradients to the host
    offset = set(off)
    x_fwd = [profile.block_packed[i] / bw if i in offset else 0.0 for i in range(n)]
    still_loaded = loaded_at_turnaround(profile.block_packed, off, strategy.offload.prefetch_depth)
    x_bwd = [(0.0 if i in still_loaded else x_fwd[i]) + act_host[i] / bw for i in range(n)]
    d2h = sum(act_host) / bw  # activations leave on their own stream during the forward
    overlap = profile.device == "cuda" and profile.h2d_pinned
    if overlap:  # the gradients leave on a side stream during backward (device-to-host: a copy engine of its own)
        bound = max(sum(c_fwd), sum(x_fwd), d2h) + max(sum(c_bwd), sum(x_bwd), grads_d2h) + other
    else:
        d2h += grads_d2h
        bound = compute + sum(x_fwd) + sum(x_bwd) + d2h
    if not timed:
        return Prediction(peak_bytes=int(subtotal + margin), step_s=math.nan, bound_s=bound, compute_s=compute,
                          compile_s=sum(compile_s.values()), offloaded=tuple(off), breakdown=breakdown)

    cells = min(strategy.offload.prefetch_depth + 1, len(off))
    cell = max((profile.block_packed[i] for i in off), default=0)
    # a block whose copy is activations only takes a whole cell's share: as many ahead as prefetch_depth
    share = [profile.block_packed[i] if i in offset else cell for i in range(n)]
    window = (share, cell, cells, strategy.offload.prefetch_depth)
    t_fwd = _pipeline(list(range(n)), c_fwd, x_fwd, window, overlap)
    t_bwd = _pipeline(list(range(n - 1, -1, -1)), c_bwd, x_bwd, window, overlap)
    t_fwd = max(t_fwd, d2h) if overlap else t_fwd + d2h
    t_bwd = max(t_bwd, grads_d2h) if overlap else t_bwd
    return Prediction(peak_bytes=int(subtotal + margin), step_s=t_fwd + t_bwd + other, bound_s=bound,
                      compute_s=compute, compile_s=sum(compile_s.values()), offloaded=tuple(off),
                      breakdown=breakdown)


def host_step_s(profile: Profile) -> float:
    """What optimizer offload's step takes in place of the device's optimizer step: the CPU step (measured, else
    estimated from HOST_ADAMW_S_PER_ELEMENT) and the copy of the updated LoRA back to the device. The CPU step is
    taken as never faster than the device's own (optimizer_s): on CUDA it is the slower by far anyway (a GPU steps
    AdamW over a LoRA in about a millisecond); a CPU profile times both on the same cores, where what differs is
    only the implementation (fused on the host, the default on the device) and the noise of a shared machine, no
    reason to plan an offload that moves bytes within the same memory. So optimizer offload never makes a step
    faster by itself, only through the device memory it frees (planner._memory_first counts on it)."""
    cpu = profile.host_optimizer_s
    if cpu is None:
        cpu = HOST_ADAMW_S_PER_ELEMENT * profile.trainable_numel
    return max(cpu, profile.optimizer_s) + profile.trainable_bytes / max(profile.h2d_bytes_per_s, 1.0)


def _activation_buffers(profile: Profile, i: int, kept: float, scale: float, inputs_only: bool) -> list[int]:
    """The sizes of block i's offloaded activation buffers (`kept` bytes in all): a block kept at its inputs offloads
    the storages the probe measured (`Profile.act_ckpt_allocs`); where their sizes are unknown (older profiles, a
    compiled block's own saves) the block's bytes count as one buffer."""
    allocs = profile.act_ckpt_allocs[i] if inputs_only and profile.act_ckpt_allocs else None
    return [math.ceil(a * scale) for a in allocs] if allocs else [math.ceil(kept)]


def _arena_bytes(buffers: list[list[int]]) -> int:
    """What the page-locked arena of activation offload takes for a step's buffers: each at ALIGN, the whole in
    pages (activation_host.ActivationHost.settle)."""
    total = sum(aligned(b) for block in buffers for b in block)
    return -(-total // mmap.PAGESIZE) * mmap.PAGESIZE if total else 0


def loaded_at_turnaround(packed: list[int], offloaded: list[int], prefetch_depth: int) -> set[int]:
    """The offloaded blocks still in their slots when backward turns around: the last ones that fit the cells."""
    off = sorted(offloaded)
    if not off:
        return set()
    cells = min(prefetch_depth + 1, len(off))
    cell = max(packed[i] for i in off)
    n = prefetch_window([packed[i] for i in off[-2::-1]], packed[off[-1]], cell, cells, cells - 1)
    return set(off[len(off) - 1 - n:])


def _pipeline(order: list[int], compute: list[float], xfer: list[float], window: tuple, overlap: bool) -> float:
    """Finish time of one pass. Block i computes once its copy (xfer[i] > 0) has landed. Reaching block i, the
    runtime fetches i if missing and the next blocks that need copies, as many as layer_offload.prefetch_window
    allows (window = (bytes per block, cell bytes, cells, depth)); a copy starts after the compute queued before it
    (the copy stream waits on the compute stream) and after the previous copy."""
    nbytes, cell, cells, depth = window
    most = depth + cells * max((cell // b for b in nbytes if b), default=1)  # no window is longer
    needs = [i for i in order if xfer[i] > 0]
    ready: dict[int, float] = {}
    t = copy_free = 0.0
    k = 0  # needs[k:] are the blocks at or after the current one that need a copy
    for i in order:
        while k < len(needs) and needs[k] == i:
            k += 1
        ahead = prefetch_window([nbytes[j] for j in needs[k: k + most]], nbytes[i] if xfer[i] > 0 else None, cell,
                                cells, depth) if cell else depth
        targets = ([i] if xfer[i] > 0 else []) + needs[k: k + ahead]
        for j in targets:
            if j in ready:
                continue
            ready[j] = copy_free = max(t, copy_free) + xfer[j]
            if not overlap:
                t = copy_free  # CPU simulation: the copy runs on the compute thread
        t = max(t, ready.get(i, 0.0)) + compute[i] + (LOAD_OVERHEAD_S if xfer[i] > 0 else 0.0)
    return t

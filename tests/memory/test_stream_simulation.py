"""The runtime's CUDA branches, run on the CPU under a model of CUDA stream ordering (tests/helpers/sim_streams.py).

The model: the compute stream runs at once; a side stream's copies are queued, their destinations poisoned (NaN)
at once, and run only when something waits for them (an event's synchronize, a stream's wait_event up to the
event's mark, wait_stream, a stream or device synchronize), reading their sources as they are then. So a consumer
that reads a copy's destination without the wait reads NaN, a source changed before the copy runs is what is
copied, and a buffer refilled while someone still reads it shows the poison. LayerOffload, ActivationOffload (and
its page-locked arena), HostOptimizer and CpuEma take these streams on the "cpu" device, their `cuda` flag / stream
attributes set as on CUDA and page-locking through the driver's model (fake_cudart.FakeCudart): every
`if self.cuda:` / `self._stream is not None` branch runs. No production code is changed for it.

The compute stream's lag is checked rather than replayed: compute ops are numbered and logged with the bytes they
touch, each side stream and the host know how far compute had got when they last waited for it, and a copy (or a
host-side region: the host optimizer's AdamW and gradient sums) that writes bytes compute may still read, or reads
bytes compute may not have written yet, is a hazard (a slot refilled under a block still running on the GPU; an
activation copied out before the kernel that makes it). Hazards a test did not take fail it.

Lifetimes too: a queued copy's tensors are held through aliases that keep no view's base alive, so when the copy
runs, memory the program had already dropped without `record_stream` on that stream (the caching allocator would
have handed it out again) is a hazard; so is a side stream's allocation that may reuse a block of its pool which
compute used and which was freed with no `record_stream` on compute (a step's inputs, InputCopies).

What the model cannot see (the helper's docstring has the whole list): the allocator really handing memory out;
host memory unpinned under a queued copy.

The negative controls below remove one wait each and must fail here; run without the simulated streams (the plain
CPU path, where every copy is eager), the same removals go unseen: that is what the model adds. Sections 5 and 6
remove a wait for compute or a record_stream: the numbers stay right even here, only the lag and lifetime checks
see them.
"""
import mmap
import threading

import numpy as np
import pytest
import torch
from ema_reference import change_weights, lora_like_weights, reference_ema
from equivalence import assert_equivalent
from fake_cudart import FakeCudart
from sim_branches import cuda_branches
from sim_order import span
from sim_streams import SimStream, StreamSim, simulated_cuda
from torch.utils._python_dispatch import TorchDispatchMode
from two_stream import make_lora_model, train_steps

from tightrope.memory.activation_host import ActivationHost
from tightrope.memory.activation_offload import ActivationOffload
from tightrope.memory.ema import UPDATES_KEY, CpuEma
from tightrope.memory.host_pinning import page_aligned
from tightrope.memory.layer_offload import LayerOffload
from tightrope.memory.runtime import MemoryRuntime
from tightrope.memory.strategy import Strategy
from tightrope.training.host_optimizer import HostOptimizer

FP32 = dict(compute_dtype="fp32")
PAGE = mmap.PAGESIZE


@pytest.fixture
def sim(monkeypatch):
    with simulated_cuda(monkeypatch) as s:
        yield s


@pytest.fixture
def branches(sim, monkeypatch):
    """The runtime's objects on the "cpu" device take their CUDA branches under the simulated streams."""
    return cuda_branches(monkeypatch)


def _side_copy(stream, dst, src, non_blocking=True):
    """A copy as the runtime makes one: after the compute that made its tensors (the lag), and with their memory
    kept for the copy whatever the caller drops (record_stream: the lifetimes)."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=non_blocking)
        event = torch.cuda.Event()
        event.record(stream)
    src.record_stream(stream)
    dst.record_stream(stream)
    return event


# -- 1. the simulator itself ------------------------------------------------------------------------------------------
def test_a_deferred_copy_poisons_its_destination_until_waited(sim):
    side = torch.cuda.Stream("cuda")  # any device spelling
    src = torch.arange(6.0)
    dst, raw = torch.zeros(6), torch.zeros(8, dtype=torch.uint8)
    strided = torch.zeros(4, 6)[:, ::2]  # a non-contiguous destination
    ints = torch.zeros(3, dtype=torch.int64)
    sources = torch.arange(8, dtype=torch.uint8), torch.ones(4, 3), torch.tensor([1, 2, 3])  # alive until landed
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        dst.copy_(src, non_blocking=True)
        raw.copy_(sources[0], non_blocking=True)
        strided.copy_(sources[1], non_blocking=True)
        ints.copy_(sources[2], non_blocking=True)
        doubled = src * 2  # any other op runs at once
        event = torch.cuda.Event()
        event.record()  # on the current stream: the side one
    assert torch.isnan(dst).all() and (raw == 255).all() and torch.isnan(strided).all() and (ints == -1).all()
    assert torch.equal(doubled, torch.arange(6.0) * 2)
    assert sim.counters.deferred == 4 and sim.pending() == 4 and side.pending == 4
    torch.cuda.current_stream().wait_event(event)
    assert torch.equal(dst, src) and torch.equal(raw, torch.arange(8, dtype=torch.uint8))
    assert torch.equal(strided, torch.ones(4, 3)) and torch.equal(ints, torch.tensor([1, 2, 3]))
    assert sim.pending() == 0 and sim.counters.flushed == 4 and sim.counters.wait_events == 1


def test_an_event_wait_flushes_exactly_up_to_its_mark(sim):
    side = torch.cuda.Stream("cpu")
    a, b, c, threes = torch.zeros(3), torch.zeros(3), torch.zeros(3), torch.full((3,), 3.0)
    first = _side_copy(side, a, torch.ones(3))
    second = _side_copy(side, b, torch.full((3,), 2.0))
    with torch.cuda.stream(side):
        c.copy_(threes, non_blocking=True)  # after the second mark
    first.synchronize()
    assert torch.equal(a, torch.ones(3)) and torch.isnan(b).all() and torch.isnan(c).all()
    assert first.query() and side.pending == 2
    side.wait_event(second)  # a side stream waiting: the event's stream is flushed to the mark, not further
    assert torch.equal(b, torch.full((3,), 2.0)) and torch.isnan(c).all() and side.pending == 1
    on_compute = torch.cuda.Event(enable_timing=True)
    on_compute.record()  # on the compute stream: complete at once, flushes nothing
    on_compute.synchronize()
    assert side.pending == 1 and on_compute.elapsed_time(first) == 0.0
    torch.cuda.Event().synchronize()  # never recorded: complete
    assert side.pending == 1
    side.synchronize()  # before threes and c go


def test_a_source_changed_before_the_copy_runs_is_what_gets_copied(sim):
    side = torch.cuda.Stream("cpu")
    src, dst = torch.ones(4), torch.zeros(4)
    event = _side_copy(side, dst, src)
    src.mul_(5)  # on the compute stream, before anything waited for the copy: the hazard
    event.synchronize()
    assert torch.equal(dst, torch.full((4,), 5.0))


def test_wait_stream_and_synchronize_flush(sim):
    one, two = torch.cuda.Stream("cpu"), torch.cuda.Stream("cpu")
    a, b, c = torch.zeros(2), torch.zeros(2), torch.zeros(2)
    _side_copy(one, a, torch.ones(2))
    torch.cuda.current_stream("cpu").wait_stream(one)
    assert torch.equal(a, torch.ones(2))
    _side_copy(one, b, torch.ones(2))
    _side_copy(two, c, torch.ones(2))
    two.wait_stream(torch.cuda.current_stream())  # the compute stream has nothing queued
    one.synchronize()
    assert torch.equal(b, torch.ones(2)) and torch.isnan(c).all()
    torch.cuda.synchronize("cuda:0")  # every stream
    assert torch.equal(c, torch.ones(2)) and sim.pending() == 0
    # 3 of the 5 waits for streams are _side_copy's
    assert (sim.counters.wait_streams, sim.counters.stream_syncs, sim.counters.device_syncs) == (5, 1, 1)


def test_a_blocking_copy_on_a_side_stream_flushes_its_queue_first(sim):
    side = torch.cuda.Stream("cpu")
    a, b = torch.zeros(2), torch.zeros(2)
    _side_copy(side, a, torch.ones(2))
    _side_copy(side, b, torch.full((2,), 2.0), non_blocking=False)
    assert torch.equal(a, torch.ones(2)) and torch.equal(b, torch.full((2,), 2.0)) and side.pending == 0
    assert sim.counters.blocking == 1 and sim.counters.deferred == 1


def test_copies_on_one_stream_keep_their_order_and_another_stream_races(sim):
    """A copy that reads a buffer, then one that refills it: on the same stream the first runs first (the hardware's
    order); on another stream, not made to wait, the reader gets the poison (the reuse hazard)."""
    side, other = torch.cuda.Stream("cpu"), torch.cuda.Stream("cpu")
    buf, out = torch.ones(3), torch.zeros(3)
    _side_copy(side, out, buf)
    _side_copy(side, buf, torch.full((3,), 7.0))
    torch.cuda.synchronize()
    assert torch.equal(out, torch.ones(3)) and sim.counters.ordered_flushes == 1
    buf, out = torch.ones(3), torch.zeros(3)
    _side_copy(side, out, buf)
    _side_copy(other, buf, torch.full((3,), 7.0))  # the bug: no other.wait_stream(side)
    torch.cuda.synchronize()
    assert torch.isnan(out).all()


def test_the_side_stream_is_per_thread_and_copies_land_from_any_thread(sim):
    side = torch.cuda.Stream("cpu")
    theirs, dst = torch.zeros(2), torch.zeros(2)
    event = _side_copy(side, dst, torch.ones(2))
    with torch.cuda.stream(side):  # this thread's side stream is not another thread's current one
        worker = threading.Thread(target=lambda: (theirs.copy_(torch.ones(2), non_blocking=True), event.synchronize()),
                                  name="waiter")
        worker.start()
        worker.join()
    assert torch.equal(theirs, torch.ones(2)) and torch.equal(dst, torch.ones(2))
    assert sim.flush_threads == {"waiter"} and sim.counters.deferred == 1
    torch.ones(2).record_stream(side)
    assert sim.counters.record_streams == 3  # _side_copy's two


# -- 1b. the lagging compute stream: ordering checked against the compute log ----------------------------------------
def _kinds(found):
    return sorted({(h.who, h.does) for h in found})


def test_a_copy_reading_what_compute_just_wrote_needs_a_wait_for_compute(sim):
    """An activation copied out: its source was written by a compute op. Without a wait for the compute stream the
    copy may run before that kernel on a GPU; the values land right here (compute ran at once), the log catches it."""
    side = torch.cuda.Stream("cpu")
    src, dst = torch.ones(4) * 3, torch.zeros(4)
    with torch.cuda.stream(side):
        dst.copy_(src, non_blocking=True)  # no side.wait_stream(compute)
    torch.cuda.synchronize()
    assert torch.equal(dst, torch.full((4,), 3.0))  # the poison model alone sees nothing
    found = sim.take_hazards()
    assert _kinds(found) == [("side0", "reads (a copy)"), ("side0", "writes (a copy)")]
    assert "aten.mul.Tensor" in str(next(h for h in found if h.does.startswith("reads")))
    src2, dst2 = torch.ones(4) * 3, torch.zeros(4)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        dst2.copy_(src2, non_blocking=True)
    torch.cuda.synchronize()
    assert not sim.take_hazards() and sim.counters.checked_copies == 2


def test_a_buffer_refilled_while_compute_may_still_read_it_is_a_hazard(sim):
    """The slot-reuse race: compute reads a buffer (a block's weights), then a side copy refills it. Ordered only
    if the side stream waited for compute after that read: an event recorded before the read is not enough."""
    side = torch.cuda.Stream("cpu")
    slot, weights = torch.ones(8), torch.full((8,), 2.0)
    early = torch.cuda.Event()
    early.record()  # on compute, before the read
    side.wait_stream(torch.cuda.current_stream())
    _ = (slot * 2).sum()  # the block runs: it reads the slot
    side.wait_event(early)
    with torch.cuda.stream(side):
        slot.copy_(weights, non_blocking=True)
    found = sim.take_hazards()
    assert _kinds(found) == [("side0", "writes (a copy)")] and found[0].op == "aten.mul.Tensor"
    _ = (slot * 2).sum()
    after = torch.cuda.Event()
    after.record()  # on compute, after the read
    side.wait_event(after)
    with torch.cuda.stream(side):
        slot.copy_(weights, non_blocking=True)
    torch.cuda.synchronize()
    assert not sim.take_hazards() and torch.equal(slot, weights)


def test_waits_for_compute_pass_through_another_side_stream(sim):
    """Side stream B waiting for an event A recorded after A waited for compute is ordered after compute too."""
    a, b = torch.cuda.Stream("cpu"), torch.cuda.Stream("cpu")
    src, dst, dst_c = torch.arange(4.0) + 1, torch.zeros(4), torch.zeros(4)
    a.wait_stream(torch.cuda.current_stream())
    event = a.record_event()
    b.wait_event(event)
    with torch.cuda.stream(b):
        dst.copy_(src, non_blocking=True)
    c = torch.cuda.Stream("cpu")
    c.wait_stream(a)  # a whole stream: what it waited for too
    with torch.cuda.stream(c):
        dst_c.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    assert not sim.take_hazards() and torch.equal(dst, src)


def test_host_side_writes_wait_for_the_compute_that_reads_them(sim):
    """The host optimizer's hazard: compute queued a copy that reads the host weights; the host may overwrite them
    (AdamW) only after synchronising past it. Host ops are those of a host_side() region, and any op but a copy on
    page-locked memory (no kernel reads host memory); their fresh outputs are host memory (never a hazard), their
    reads are not checked; views touch nothing."""
    host, device = torch.ones(6), torch.zeros(6)
    torch.cuda.synchronize()  # both exist (their allocations are on the log)
    device.copy_(host, non_blocking=True)  # on compute: reads the host weights
    _ = host[2:]  # a view: no access
    with sim.host_side():
        host.add_(1)  # AdamW, too early
        fresh = host * 2  # its result is the host's own
    found = sim.take_hazards()
    assert [(h.who, h.does, h.op) for h in found] == [("host", "writes (aten.add_.Tensor)", "aten.copy_.default")]
    done = torch.cuda.Event()
    device.copy_(host, non_blocking=True)
    done.record()
    done.synchronize()
    with sim.host_side():
        host.add_(1)
        fresh.add_(host)
    assert not sim.take_hazards() and sim.counters.host_ops == 4

    sim.cudart = FakeCudart()  # page-locked memory: its ops are the host's without a region
    locked = page_aligned(PAGE // 4, torch.float32)
    torch.cuda.synchronize()
    assert sim.cudart.cudaHostRegister(locked.data_ptr(), locked.nbytes, 0) == 0
    compute_ops = sim.counters.compute_ops
    device.copy_(locked[:6], non_blocking=True)  # a copy: compute's, logged
    locked.mul_(3)  # not waited for: the host overwrites what the queued copy reads
    assert sim.counters.compute_ops == compute_ops + 1 and sim.counters.host_ops == 5
    assert [(h.who, h.does, h.op) for h in sim.take_hazards()] == [("host", "writes (aten.mul_.Tensor)",
                                                                     "aten.copy_.default")]
    torch.cuda.synchronize()
    locked.mul_(3)
    assert not sim.take_hazards()
    assert sim.cudart.cudaHostUnregister(locked.data_ptr()) == 0


class _AllocatorReuse(TorchDispatchMode):
    """Stands in for the CPU allocator handing out the bytes of a tensor compute used and freed: each new tensor
    torch.tensor makes (before the simulation's log sees its `lift_fresh`) gets that past, a compute op on its
    bytes, as Adafactor's `step` did where the finite check's norms had been (which the CPU allocator does or not
    with the heap's layout)."""

    def __init__(self, sim):
        super().__init__()
        self.sim = sim

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.lift_fresh.default:
            self.sim.timeline.record([span(args[0])], [], "aten.stack.default")  # compute read the freed norm there
        return func(*args, **(kwargs or {}))


def test_a_tensor_made_from_python_data_has_no_compute_past(sim):
    """torch.tensor(...) (Adafactor's host `step`) allocates outside the dispatcher and shows up only as
    `lift_fresh`, an alias of its input: what compute did to a freed tensor at those bytes is not its past (on a GPU
    a new host tensor has none on the compute stream). A fresh one compute then reads (a copy not yet waited for) is
    still the host's to wait for; and so are bytes that live on under a new tensor (from_numpy, as_tensor(ndarray):
    memory the tensor does not own)."""
    with _AllocatorReuse(sim):
        with sim.host_side():
            steps = [torch.tensor(0.0) for _ in range(3)]
    with sim.host_side():
        for s in steps:
            s += 1  # Adafactor's step_t += 1: no compute op touched this tensor
    assert not sim.take_hazards()

    device = torch.zeros(1)
    with sim.host_side():
        step = torch.tensor(0.0)
    device.copy_(step, non_blocking=True)  # compute reads the fresh host tensor (queued on a GPU)
    with sim.host_side():
        step += 1  # not waited for: the copy may read the old value or the new one
    assert [(h.who, h.does, h.op) for h in sim.take_hazards()] == [("host", "writes (aten.add_.Tensor)",
                                                                     "aten.copy_.default")]
    torch.cuda.synchronize()
    with sim.host_side():
        step += 1
    assert not sim.take_hazards()

    array = np.ones(4, np.float32)  # host memory that outlives its tensors
    device = torch.zeros(4)
    device.copy_(torch.from_numpy(array), non_blocking=True)  # compute reads it (queued on a GPU); tensor dropped
    with sim.host_side():
        again = torch.as_tensor(array)  # lift_fresh too, on the same bytes
        again.mul_(2)  # not waited for
    assert [(h.who, h.does) for h in sim.take_hazards()] == [("host", "writes (aten.mul_.Tensor)")]


def test_memory_dropped_under_a_queued_copy_needs_record_stream(sim):
    """The caching allocator's rule: a tensor dropped while a side copy still uses it is reused at once unless it was
    record_stream'd on that stream. Views the program keeps hold the memory; the queue's own aliases do not."""
    side = torch.cuda.Stream("cpu")
    dst, kept = torch.zeros(4), torch.zeros(8)
    src, recorded, viewed = torch.ones(4) * 2, torch.ones(4) * 3, torch.ones(8) * 4
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        dst.copy_(src, non_blocking=True)
        kept.copy_(recorded.repeat(2), non_blocking=True)  # a temporary: its memory goes back at once...
        torch.zeros(8).copy_(viewed, non_blocking=True)  # ... and so does this destination's
    view = viewed[2:]
    recorded.record_stream(side)  # not the temporary: it is not the copy's source
    del src, viewed
    torch.cuda.synchronize()
    found = sim.take_hazards()
    assert [(h.does.split(" memory")[0], h.span[1] - h.span[0]) for h in found] == [
        ("reads", 16), ("reads", 32), ("writes into", 32)]
    assert str(found[0]).startswith("side0 reads memory freed while its copy was queued, with no record_stream on "
                                    "this stream (the caching allocator may have handed it out again): bytes [0x")
    again = torch.ones(4)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        dst.copy_(again, non_blocking=True)
    again.record_stream(side)
    del again
    torch.cuda.synchronize()
    assert not sim.take_hazards() and torch.equal(dst, torch.ones(4)) and view.shape == (6,)


def test_a_side_stream_pool_block_compute_used_needs_record_stream_on_compute(sim):
    """A tensor allocated on a side stream is a block of that stream's pool: freed, the allocator gives it to the
    stream's next allocation at once, whatever compute still has queued on it, unless it was record_stream'd on
    compute or the stream waited for compute since."""
    side, compute = torch.cuda.Stream("cpu"), torch.cuda.current_stream()

    def copy_in(n):
        with sim.host_side():
            src = torch.ones(n)  # the host's (pageable) memory
        with torch.cuda.stream(side):
            out = torch.empty_like(src)
            out.copy_(src)  # pageable: a blocking copy
        compute.wait_stream(side)
        return out

    first = copy_in(4)
    (first * 2).sum()  # compute reads it
    del first
    held = copy_in(4)  # may land in first's block, under compute's queued reads
    found = sim.take_hazards()
    assert [(h.who, h.does.split(" memory")[0], h.op) for h in found] == [("side0", "reuses", "aten.mul.Tensor")]
    assert str(found[0]).startswith("side0 reuses memory of its pool freed with no record_stream on compute, its "
                                    "bytes [0x") and "that compute op #1 (aten.mul.Tensor) touched" in str(found[0])

    (held * 2).sum()
    held.record_stream(compute)
    del held
    kept = copy_in(4)  # the recorded block waits for compute: not this one
    (kept + 1).sum()
    del kept
    side.wait_stream(compute)  # or the stream orders its next work after compute's
    copy_in(4)
    unused = copy_in(4)  # compute never touched it: free to reuse
    del unused
    copy_in(4)
    assert not sim.take_hazards() and sim.counters.record_streams == 1


def test_hazards_no_test_took_fail_the_simulation():
    inner = StreamSim()
    side = inner.new_stream()
    dst = torch.zeros(3)  # before the log: never touched by compute
    with pytest.raises(AssertionError, match=r"^1 stream-ordering hazard\(s\) under a lagging compute stream; the "
                                             r"first: side0 reads \(a copy\) bytes \[0x[0-9a-f]+, 0x[0-9a-f]+\) that "
                                             r"compute op #2 \(aten\.add\.Tensor\) touched, having waited for "
                                             r"compute only up to op #0$"):
        with inner:
            src = torch.ones(3) + 1
            with inner.stream(side):
                dst.copy_(src, non_blocking=True)
    assert torch.equal(dst, src)  # landed at the end, before the hazards were raised
    assert not inner.checking and inner.counters.compute_ops == 2 and inner.counters.checked_copies == 1
    torch.ones(1) + 1  # the log is off again: nothing counted
    assert inner.counters.compute_ops == 2


# -- 2. the runtime under the simulated streams: equivalent to plain PyTorch ------------------------------------------
def _run(strategy, steps=2, micro=1, inspect=None, poison_slots=True):
    """run_managed, the model trained `steps` steps of `micro` micro-batches; inspect(rt) runs before the undo."""
    model = make_lora_model()
    with MemoryRuntime(model, strategy, "cpu", poison_slots=poison_slots, activation_min_bytes=0) as rt:
        losses, grads = train_steps(model, steps=steps, runtime=rt, micro=micro)
        seen = inspect(rt) if inspect is not None else None
    return (losses, grads, None), seen


def _streams(rt):
    """The runtime's side streams, by owner (each must be a simulated one: the CUDA branch ran)."""
    out = {}
    if rt.offload is not None:
        out["layers"] = rt.offload.copy_stream
    if rt.acts is not None:
        out["acts"] = rt.acts.stream
    return out


STRATEGIES = {
    "offload": (Strategy.of(offload_fraction=1.0, **FP32), 2, ["layers"]),
    "half+acts": (Strategy.of(offload_fraction=0.5, checkpoint="all", activation_offload=True, **FP32), 2,
                  ["layers", "acts"]),
    "optimizer": (Strategy.of(offload_fraction=0.5, optimizer_offload=True, **FP32), 2, ["layers", "optimizer"]),
    "token_chunks": (Strategy.of(offload_fraction=1.0, checkpoint="all", token_chunks=2, **FP32), 2, ["layers"]),
    # host buffers not page-locked: the host's own memory all the same (the finite check and clipping run there)
    "optimizer_pageable": (Strategy.of(optimizer_offload=True, pin_memory=False, **FP32), 2, ["optimizer"]),
}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_the_cuda_branches_train_as_plain_pytorch(branches, sim, name):
    strategy, steps, owners = STRATEGIES[name]
    result, streams = _run(strategy, steps, inspect=_streams)
    assert_equivalent(result, steps=steps)
    if "optimizer" in owners:
        streams["optimizer"] = next(s for s in sim.streams if s not in streams.values() and s.name != "inputs")
    assert sorted(streams) == sorted(owners) and all(isinstance(s, SimStream) and s.side for s in streams.values())
    for owner, stream in streams.items():
        assert stream.deferred > 0, f"{owner}: no copy was deferred"
        assert stream.flushed == stream.deferred, f"{owner}: copies left in flight"
    # the host ran ahead of the copies, and only the runtime's own waits landed them
    assert sim.counters.max_pending > 1 and sim.pending() == 0
    assert sim.counters.wait_events > 0 if {"layers", "acts"} & set(owners) else sim.counters.event_syncs > 0
    assert sim.counters.events_recorded > 0
    # every side copy was checked against the compute log (none raced it: the fixture fails on hazards left)
    assert sim.counters.compute_ops > 0 and sim.counters.checked_copies == sim.counters.deferred + sim.counters.blocking
    if "optimizer" in owners:
        assert sim.counters.host_ops > 0  # AdamW and the gradient sums, checked as the host's
    if "acts" in owners or "optimizer" in owners:
        assert sim.counters.record_streams > 0
    if "layers" in owners:
        assert branches.registered  # the weights were page-locked through the driver's model


def test_the_activation_arena_takes_deferred_copies_from_the_second_step(branches, sim, monkeypatch):
    """3 steps: the first copies into pageable buffers (blocking), the arena is sized at the second's start and
    both directions of later steps' copies go through it, queued. The arena's own synchronize at start_step finds
    nothing queued: end_step's wait-time read (collect_wait_seconds) synchronised the device already, and every
    copy had been waited for by then. So skipping that synchronize is a hazard this model cannot show."""
    queued_at_start = []
    real_start = ActivationOffload.start_step

    def start_step(self):
        queued_at_start.append((self.host.outgrown(), self.stream.pending))
        real_start(self)

    monkeypatch.setattr(ActivationOffload, "start_step", start_step)

    def inspect(rt):
        arena = rt.acts.host._arena
        lo, hi = arena.data_ptr(), arena.data_ptr() + arena.numel()
        mine = [r for r in sim.log if r.stream is rt.acts.stream]
        into = sum(lo <= r.dst[0] and r.dst[1] <= hi for r in mine)
        out_of = sum(lo <= r.src[0] and r.src[1] <= hi for r in mine)
        return rt.acts.stream, rt.acts.pinned, into, out_of, len(mine)

    strategy = Strategy.of(checkpoint="all", activation_offload=True, **FP32)
    result, (stream, pinned, into, out_of, deferred) = _run(strategy, steps=3, inspect=inspect)
    assert_equivalent(result, steps=3)
    assert pinned and deferred == stream.deferred == stream.flushed > 0
    assert into > 0 and out_of > 0 and into + out_of == deferred  # device-to-host and back, all through the arena
    assert sim.counters.blocking > 0  # the first step's, into pageable buffers
    assert queued_at_start == [(False, 0), (True, 0), (False, 0)]


def test_micro_batches_reuse_the_arena_and_the_staging_buffer_with_copies_queued(branches, sim, monkeypatch):
    """Nothing synchronises between a step's micro-batches (gpu-check's 3 steps x 2 micro-batches row): the second
    starts the activation arena over while the first's gradient copies to the host are still queued (on the
    optimizer's stream), and its gradients go to the staging buffer, added once landed."""
    queued_at_reuse = []
    real_buffer = ActivationHost.buffer_like

    def buffer_like(self, t):
        if self._arena is not None and self._in_arena == 0 and self._top > 0:  # the arena starts over
            queued_at_reuse.append(sim.pending())
        return real_buffer(self, t)

    monkeypatch.setattr(ActivationHost, "buffer_like", buffer_like)
    strategy = Strategy.of(offload_fraction=0.5, checkpoint="all", activation_offload=True, optimizer_offload=True,
                           **FP32)
    result, _ = _run(strategy, steps=3, micro=2)
    reference = train_steps(make_lora_model(), steps=3, micro=2)
    torch.testing.assert_close(torch.tensor(result[0]), torch.tensor(reference[0]), rtol=1e-5, atol=1e-6)
    for grads, ref in zip(result[1], reference[1]):
        assert grads.keys() == ref.keys()
        for name in ref:
            torch.testing.assert_close(grads[name], ref[name], rtol=1e-5, atol=1e-6)
    side = [s for s in sim.streams if s.name != "inputs"]  # this loop copies its inputs itself
    assert len(side) == 3 and all(s.deferred > 0 and s.flushed == s.deferred for s in side)
    assert any(queued_at_reuse), queued_at_reuse  # the arena was reused with copies in flight


# -- 3. the EMA with its stream simulated -----------------------------------------------------------------------------
def test_ema_updates_copied_on_a_side_stream_equal_the_eager_ema_bit_for_bit(branches, sim):
    steps, decay = 30, 0.75
    expected = reference_ema(lora_like_weights(), decay, steps)
    params, g = lora_like_weights(), torch.Generator().manual_seed(1)
    ema = CpuEma(params, decay)
    stream = ema._stream
    assert isinstance(stream, SimStream) and stream.side and ema._pinned is not None
    for _ in range(steps):
        change_weights(params, g)
        ema.update()
    state = ema.state_dict()
    ema.close()
    assert state[UPDATES_KEY].item() == steps
    assert all(torch.equal(state[k], v) for k, v in expected[-1].items())
    assert stream.deferred == steps == stream.flushed and sim.counters.record_streams == steps
    assert any(name.startswith("tightrope-ema") for name in sim.flush_threads)  # the worker waited for the copies


# -- 4. negative controls: one wait removed, the run must fail --------------------------------------------------------
def _no_layer_wait(monkeypatch):
    monkeypatch.setattr(LayerOffload, "_wait", lambda self, index: None)


def _no_activation_wait(monkeypatch):
    monkeypatch.setattr(ActivationOffload, "_wait", lambda self, event: None)


def _settle_without_synchronize(monkeypatch):
    def settle(self, i):  # HostOptimizer._settle, the bug: the gradients are read without waiting for their copies
        self._copied[i] = None
        if self._to_add[i] is not None:
            self._to_add[i] = None
            self._grads[i].add_(self._staging[i])
    monkeypatch.setattr(HostOptimizer, "_settle", settle)


CONTROLS = {
    # the compute stream reads a slot before its weights' copy landed
    "layer_wait": (_no_layer_wait, Strategy.of(offload_fraction=1.0, **FP32)),
    # backward reads an activation brought back before its copy landed (from step 2: step 1's copies go to pageable
    # buffers and block)
    "activation_wait": (_no_activation_wait, Strategy.of(checkpoint="all", activation_offload=True, **FP32)),
    # the optimizer reads gradients before their copies to the host landed. With layer (or activation) offload on,
    # end_step's collect_wait_seconds synchronises the whole device every step, which lands them too: the optimizer
    # alone is offloaded here, so _settle's wait is the only one
    "optimizer_settle": (_settle_without_synchronize, Strategy.of(optimizer_offload=True, **FP32)),
}


@pytest.mark.parametrize("name", list(CONTROLS))
def test_a_missing_wait_is_caught(branches, sim, monkeypatch, name):
    remove_wait, strategy = CONTROLS[name]
    remove_wait(monkeypatch)
    result, _ = _run(strategy, steps=2)
    torch.cuda.synchronize()  # copies never waited for, their buffers gone with the optimizer: land them now
    sim.take_hazards()  # the optimizer's host never synchronises: hazards too (section 5 tests their kind)
    with pytest.raises(AssertionError):
        assert_equivalent(result)
    finite = [all(torch.isfinite(g).all() for g in step.values()) for step in result[1]]
    if name == "activation_wait":
        assert finite == [True, False]  # the first step's blocking copies needed no wait
    else:
        assert not all(finite)


@pytest.mark.parametrize("name", list(CONTROLS))
def test_without_the_simulated_streams_the_same_missing_wait_goes_unseen(monkeypatch, name):
    """The plain CPU path copies eagerly: the removed wait changes nothing there (why the model is needed)."""
    remove_wait, strategy = CONTROLS[name]
    remove_wait(monkeypatch)
    result, _ = _run(strategy, steps=2)
    assert_equivalent(result)


@pytest.mark.parametrize("waits", [True, False], ids=["settled", "reused_unsettled"])
def test_the_ema_buffer_reused_before_the_last_fold_read_it_is_caught(branches, sim, monkeypatch, waits):
    """Reuse hazard: update() waits for the previous fold (_settle) before copying into the one page-locked buffer.
    The first fold is held after its copy landed, just before it reads the buffer; the next update is made; then
    the fold goes on. Settled, the EMA is the eager one bit for bit; unsettled, the next copy's destination (the
    buffer the fold is about to read) is what the fold reads: poison (on a GPU, the next step's weights)."""
    expected = reference_ema(lora_like_weights(), 0.9, 2)
    params, g = lora_like_weights(), torch.Generator().manual_seed(1)
    entered, gate, held = threading.Event(), threading.Event(), []
    real_fold, real_settle = CpuEma._fold, CpuEma._settle

    def fold(self, flat, decay):
        if threading.current_thread() is not threading.main_thread() and not held:
            held.append(True)
            entered.set()  # its copy has landed (event.synchronize returned): it reads the buffer next
            assert gate.wait(30)
        real_fold(self, flat, decay)

    def settle(self):
        if waits:
            if self.updates >= 1:
                gate.set()  # the next update waits for the held fold: let it go on (else it waits forever)
            real_settle(self)

    monkeypatch.setattr(CpuEma, "_fold", fold)
    monkeypatch.setattr(CpuEma, "_settle", settle)
    ema = CpuEma(params, 0.9)
    change_weights(params, g)
    ema.update()
    assert entered.wait(30)
    change_weights(params, g)
    ema.update()
    gate.set()
    ema._worker.shutdown(wait=True)  # every fold done (the settle that would wait may be the one removed)
    shadow = ema._shadow
    ema.close()
    if waits:
        assert all(torch.equal(shadow[k], v) for k, v in expected[-1].items())
    else:
        assert not all(torch.isfinite(v).all() for v in shadow.values())


# -- 5. negative controls the lag catches (and the poison model cannot): a copy not ordered after compute ------------
def _no_wait_for_compute(owner):
    def remove(monkeypatch):
        real = SimStream.wait_stream

        def wait_stream(self, other):
            if self.name == owner and not other.side:
                return  # the bug: this owner's copies are not ordered after the compute stream's queued work
            real(self, other)
        monkeypatch.setattr(SimStream, "wait_stream", wait_stream)
    return remove


LAG_CONTROLS = {
    # a slot refilled while the block that last used it may still be running: LayerOffload._fetch's wait (slots
    # not poisoned: else the last compute op on a slot is the poisoning fill, a hazard too, that hides the matmul)
    "slot_refill": (_no_wait_for_compute("layers"), Strategy.of(offload_fraction=1.0, **FP32),
                    {("layers", "writes (a copy)")}),
    # an activation copied out before the kernel that makes it ran (pack), and one brought back into memory compute
    # may still read (_bring_back: allocated on the compute stream, perhaps another tensor's bytes)
    "activations": (_no_wait_for_compute("acts"), Strategy.of(checkpoint="all", activation_offload=True, **FP32),
                    {("acts", "reads (a copy)"), ("acts", "writes (a copy)")}),
    # a gradient copied to the host before backward made it (HostOptimizer._copy)
    "gradient_out": (_no_wait_for_compute("optimizer"), Strategy.of(optimizer_offload=True, **FP32),
                     {("optimizer", "reads (a copy)")}),
}


@pytest.mark.parametrize("name", list(LAG_CONTROLS))
def test_a_copy_not_ordered_after_compute_is_caught_by_the_lag(branches, sim, monkeypatch, name):
    """On a GPU these races show only when the compute stream runs late (gpu-check's sleep rows); the poison model
    runs compute at once, so the numbers come out right here: only the compute log sees them."""
    remove, strategy, expected = LAG_CONTROLS[name]
    remove(monkeypatch)
    result, _ = _run(strategy, steps=2, poison_slots=name != "slot_refill")
    assert_equivalent(result)  # what a lagging GPU would get wrong, the CPU did in order
    found = sim.take_hazards()
    # the removed wait's own hazards; others may follow from it (a host that synchronised with these copies'
    # events learnt nothing of compute's progress either)
    assert expected <= set(_kinds(found)), _kinds(found)
    if name == "slot_refill":  # the race itself: a block's matmul reading the slot a copy refills
        assert any(h.who == "layers" and h.does.startswith("writes") and "mm" in h.op for h in found)


def test_an_ema_copy_not_ordered_after_the_gather_is_caught_by_the_lag(branches, sim, monkeypatch):
    """CpuEma.update copies the LoRA gathered on the compute stream: without waiting for compute first, the copy may
    read the gather's output before the kernel wrote it."""
    _no_wait_for_compute("ema")(monkeypatch)
    params, g = lora_like_weights(), torch.Generator().manual_seed(1)
    ema = CpuEma(params, 0.9)
    change_weights(params, g)
    ema.update()
    ema.close()
    found = sim.take_hazards()
    # (its host buffer's allocation, logged as compute's, is written unordered too: the model's stricter side)
    assert {(h.who, h.does, h.op) for h in found if h.does.startswith("reads")} == {
        ("ema", "reads (a copy)", "aten.cat.default")}


# -- 6. negative controls for lifetimes: a record_stream removed ------------------------------------------------------
def _no_record_stream(owner):
    def remove(monkeypatch, sim):
        real = sim.record_stream

        def record_stream(tensor, stream):
            if getattr(stream, "name", None) != owner:
                real(tensor, stream)
        monkeypatch.setattr(sim, "record_stream", record_stream)
    return remove


RECORD_CONTROLS = {
    # an activation copied out, dropped by the forward before its copy ran (ActivationOffload.pack)
    "activation_out": (_no_record_stream("acts"), Strategy.of(checkpoint="all", activation_offload=True, **FP32),
                       ("acts", "reads")),
    # a gradient copied to the host, freed at once (p.grad = None) while its copy is queued (HostOptimizer._copy)
    "gradient_out": (_no_record_stream("optimizer"), Strategy.of(optimizer_offload=True, **FP32),
                     ("optimizer", "reads")),
    # a step's inputs, allocated and copied on their own stream and read by compute, freed at the next step's copies
    # (InputCopies: record_stream on compute)
    "inputs_in": (_no_record_stream("compute"), Strategy.of(**FP32), ("inputs", "reuses")),
}


@pytest.mark.parametrize("name", list(RECORD_CONTROLS))
def test_a_missing_record_stream_is_caught(branches, sim, monkeypatch, name):
    remove, strategy, (owner, does) = RECORD_CONTROLS[name]
    remove(monkeypatch, sim)
    result, _ = _run(strategy, steps=2)
    assert_equivalent(result)  # the queue kept the memory: the numbers cannot show it
    found = sim.take_hazards()
    assert found and {(h.who, h.does.split(" memory")[0]) for h in found} == {(owner, does)}, [str(h) for h in found if h.who != owner]

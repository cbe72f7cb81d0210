"""CUDA streams and events modelled on the CPU, so the runtime's CUDA branches run (and can fail) in CPU tests.

The model is a GPU whose host runs ahead as far as it may:
- The compute ("current", default) stream executes at once: its work is the plain CPU ops (but see the lag below).
- A side stream (`torch.cuda.Stream(...)`) defers its copies. Inside `with torch.cuda.stream(side):` a dispatch mode
  (pushed on that thread only, for that block) takes every `aten.copy_`: the destination is poisoned at once (NaN
  for floats, all-ones bytes for uint8, -1 for other integers) and the copy is queued on the stream, to run later
  and read its source as it is THEN (a source changed before the copy runs gives the changed bytes). Every other op
  there runs at once. A blocking copy (`non_blocking=False`) flushes its stream's queue, then runs.
- A queued copy runs (for real, the dispatch mode off) when something waits for it: `Event.synchronize()`,
  `Event.query()`, `Event.wait()`, `<stream>.wait_event(e)` flush e's stream up to where e was recorded (an event
  recorded on the compute stream, or never recorded, is complete); `s.wait_stream(other)` flushes all of `other`
  (conservative); `Stream.synchronize()` flushes it; `torch.cuda.synchronize()` flushes every stream. Running a
  copy earlier than a GPU might is always a schedule the GPU could have picked: waits never hide a bug, they only
  land copies no later than the hardware guarantees.
- Within one stream copies keep their order: before a copy poisons its destination, the copies queued before it on
  the same stream that read those bytes run first (the hardware would run them first). A copy on another stream
  that still reads them is not protected: that reuse is a race, and the poison shows it.
- `torch.Tensor.record_stream` is counted (and marks the queued copies it covers: lifetimes, below). Timing events
  report 0 ms. Any device argument is accepted.
- Queues are shared by threads under one lock (the EMA waits for its copy on a worker thread).
- The compute stream lags (ordering is checked, not replayed): inside `with sim:` a dispatch mode on the main thread
  numbers every compute op and logs the byte spans it reads and writes (a fresh output, an allocation included, is a
  write; views and metadata queries touch nothing). A side stream knows how far the compute stream had got when it
  last waited for it (`wait_stream(compute)`, `wait_event` of an event recorded on compute, or transitively through
  another side stream's event or queue); the host knows how far it synchronised (an event's or stream's
  `synchronize`/`query`, `torch.cuda.synchronize`). A side-stream copy that writes bytes compute touched later than
  its stream waited for (a slot refilled under a block a GPU may still be running; memory handed to a copy while its
  previous owner is still read) or reads bytes compute wrote later than that (an activation copied out before the
  kernel that makes it ran), and a host op (one of a `sim.host_side()` region, as the host optimizer's AdamW and
  gradient sums, or any op but a copy on memory page-locked through `sim.cudart`) that writes bytes compute touched
  later than the host synchronised, is a `Hazard`: recorded in `sim.hazards` (with the compute op last seen there)
  and raised as an AssertionError when the `with` ends, unless the test took them (`sim.take_hazards()`). On a GPU
  such a race shows only when the compute stream runs late (gpu-check's `torch.cuda._sleep` rows); here it is caught
  whatever the timing. A tensor made from Python data (torch.tensor: the log sees only its `lift_fresh`) has no past
  there, though the CPU allocator may have put it where a freed tensor that compute touched was.
- Lifetimes: a queued copy holds aliases of its tensors that keep no view's base alive; when it runs, a tensor
  whose memory only queued copies still hold (the program let go of it) and that was not `record_stream`ed on the
  copy's stream while queued is a Hazard too: the caching allocator would have handed that memory out again (a
  host buffer dropped under its copy shows the same way). So is host memory unregistered through
  sim_branches.cuda_branches' driver model while a copy on it is queued.
- Side streams' pools: memory allocated while a side stream is current is that stream's pool's (compute's earlier
  use of the bytes is forgotten: on a GPU the two never share a block). Such a tensor is tracked (an alias keeps
  its address from other tensors); when its stream allocates again and the program has let go of it, the caching
  allocator may give it back to the stream: if compute used it later than the stream last waited for compute and
  it was not `record_stream`ed on compute, that is a Hazard (the stream's next copies may overwrite bytes
  compute's queued kernels still read).

What it cannot see:
- Host code on pageable memory outside a `host_side()` region runs as compute ops here (the model cannot tell a
  pageable host tensor from a device one, unless told: `pageable_host`, which sim_branches fills with the host
  optimizer's buffers when they are not page-locked); that is stricter (more waits required), never laxer, for the
  copies, and unchecked for the host. Host reads are not checked at all: the host reads device results only through
  copies, and a copy on the compute stream runs at once here (a non-blocking device-to-host copy read before its
  event is not seen).
- A blocking copy to the host (`.cpu()`) waits for the compute stream on a GPU; on the "cpu" device it is a no-op
  or an ordinary op, so the host's knowledge of compute advances only at the waits listed above, at `.item()` on
  the main thread (a value read on the host: `aten._local_scalar_dense`), and where sim_branches.cuda_branches says
  so (HostGradScaler's `.cpu()` copies). Stricter, never laxer.
- The caching allocator itself: memory is never really handed out again (the lifetime checks above say when it
  could be); a `record_stream` made before its copy was queued is not seen (the runtime makes it after). A side
  stream's pool block is checked only at that stream's next allocation (its sizes are not compared: any freed
  block could be the one reused, stricter), and only for allocations made on the main thread.
- Ops other than `aten.copy_` issued on a side stream (none in the runtime) run eagerly.
"""
from __future__ import annotations

import collections
import contextlib
import threading
from dataclasses import dataclass

import torch
from sim_order import COPY, ComputeLog, Hazard, SpanIndex, Timeline, overlap, span
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass
class Counters:
    deferred: int = 0          # copies queued on side streams
    deferred_bytes: int = 0
    flushed: int = 0           # queued copies run (landed)
    blocking: int = 0          # blocking copies issued on a side stream (each flushed its stream first)
    ordered_flushes: int = 0   # queued copies run early: a later copy on their stream writes what they read
    events_recorded: int = 0   # on a side stream (an event on the compute stream is complete at once)
    event_syncs: int = 0       # Event.synchronize / query / wait
    wait_events: int = 0       # <stream>.wait_event
    wait_streams: int = 0      # <stream>.wait_stream
    stream_syncs: int = 0      # Stream.synchronize
    device_syncs: int = 0      # torch.cuda.synchronize
    record_streams: int = 0    # Tensor.record_stream calls
    max_pending: int = 0       # the most copies queued at once on one stream
    pending_at_exit: int = 0   # copies still queued when the simulation ended (it ran them)
    compute_ops: int = 0       # compute ops numbered by the ordering log (inside `with sim:`)
    checked_copies: int = 0    # side-stream copies checked against it
    host_ops: int = 0          # ops of host_side() regions checked against it


@dataclass
class CopyRecord:
    """One deferred copy: its stream and the [start, end) byte spans of its destination and source."""
    stream: "SimStream"
    dst: tuple[int, int]
    src: tuple[int, int]
    nbytes: int


def poison(t: torch.Tensor) -> None:
    """All-ones bytes where it is cheap to say so, NaN for floats: what a copy not yet landed leaves."""
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    elif t.dtype == torch.uint8:
        t.fill_(255)
    else:
        t.fill_(-1)


def _storage_refs(t: torch.Tensor) -> tuple[int, int]:
    """(the storage's address, how many tensors and storage objects hold it, not counting this call's own)."""
    storage = t.untyped_storage()
    return storage.data_ptr(), torch._C._storage_Use_Count(storage._cdata) - 1


class _Entry:
    """A queued copy. It holds detached aliases of its tensors (no view's base kept alive), so whether the program
    still holds their memory shows in the storages' use counts (check_alive)."""
    __slots__ = ("seq", "dst", "src", "dst_span", "src_span", "recorded")

    def __init__(self, seq, dst, src):
        self.seq, self.dst, self.src = seq, dst.detach(), src.detach()
        self.dst_span, self.src_span = span(dst), span(src)
        self.recorded = set()  # "dst" / "src": record_stream(this stream) was called on its memory while queued

    def check_alive(self, sim: "StreamSim", stream: "SimStream") -> None:
        """Before the copy runs: a tensor the program has let go of (only queued copies hold its memory) and that was
        not record_stream'd on this stream would have been handed out again by the caching allocator, the copy then
        reading or writing another tensor's bytes."""
        for name in ("dst", "src"):
            t = getattr(self, name)
            if name in self.recorded or not t.numel():
                continue
            ptr, refs = _storage_refs(t)
            if refs <= sim.held(extra=self)[ptr]:
                does = "writes into" if name == "dst" else "reads"
                sim.hazards.append(Hazard(stream.name, f"{does} memory freed while its copy was queued, with no "
                                          "record_stream on this stream (the caching allocator may have handed it "
                                          "out again)", getattr(self, name + "_span"), 0, "", 0))


class _PoolBlock:
    """A tensor allocated while a side stream was current: a block of that stream's pool in the caching allocator.
    Held through an alias (so the CPU allocator cannot give its address to another tensor while it is tracked);
    `recorded`: record_stream(compute) was called on its memory."""
    __slots__ = ("stream", "alias", "span", "recorded")

    def __init__(self, stream: "SimStream", t: torch.Tensor):
        self.stream, self.alias, self.span, self.recorded = stream, t.detach(), span(t), False


class SimStream:
    """A stream of the model. The compute stream (`side=False`) never queues anything."""

    def __init__(self, sim: "StreamSim", name: str, side: bool, device=None):
        self.sim, self.name, self.side, self.device = sim, name, side, device
        self.queue: collections.deque[_Entry] = collections.deque()
        self.enqueued = 0  # copies ever queued (an event's mark is this count when recorded)
        self.deferred = 0
        self.flushed = 0
        self.compute_seen = 0  # a side stream: the compute op it last waited for (its later work runs after it)

    def __repr__(self) -> str:
        return f"<SimStream {self.name}: {len(self.queue)} pending>"

    # -- what the runtime calls ----------------------------------------------------------------------------------
    def wait_event(self, event: "SimEvent") -> None:
        self.sim.counters.wait_events += 1
        event._land()
        self._saw(event.compute_seen)

    def wait_stream(self, other: "SimStream") -> None:
        self.sim.counters.wait_streams += 1
        other.flush()
        self._saw(other.compute_seen if other.side else self.sim.timeline.pos)

    def synchronize(self) -> None:
        self.sim.counters.stream_syncs += 1
        self.flush()
        self.sim._host_saw(self.compute_seen if self.side else self.sim.timeline.pos)

    def query(self) -> bool:
        self.flush()
        self.sim._host_saw(self.compute_seen if self.side else self.sim.timeline.pos)
        return True

    def _saw(self, compute_op: int) -> None:
        if self.side:  # the compute stream's own order is program order
            self.compute_seen = max(self.compute_seen, compute_op)

    def check_copy(self, dst: tuple[int, int], src: tuple[int, int]) -> None:
        """A copy on this side stream, against the compute stream's log (the module's docstring: the lag)."""
        sim = self.sim
        if not sim.checking:
            return
        sim.counters.checked_copies += 1
        for sp, writes_only, does in ((dst, False, "writes"), (src, True, "reads")):
            n, op = sim.timeline.last(sp, writes_only)
            if n > self.compute_seen:
                sim.hazards.append(Hazard(self.name, f"{does} (a copy)", sp, n, op, self.compute_seen))

    def record_event(self, event: "SimEvent | None" = None) -> "SimEvent":
        event = event if event is not None else SimEvent(self.sim)
        event.record(self)
        return event

    # -- the queue -------------------------------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        return len(self.queue)

    def enqueue(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        sim = self.sim
        with sim.lock:
            entry = _Entry(self.enqueued, dst, src)
            self.check_copy(entry.dst_span, entry.src_span)
            # same stream, FIFO: a queued copy that reads (or writes) these bytes runs before this one writes them
            last = max((e.seq for e in self.queue if overlap(e.src_span, entry.dst_span)), default=None)
            if last is not None:
                n = self.flush(upto=last + 1)
                sim.counters.ordered_flushes += n
            poison(dst)
            self.queue.append(entry)
            self.enqueued += 1
            self.deferred += 1
            c = sim.counters
            c.deferred += 1
            c.deferred_bytes += dst.numel() * dst.element_size()
            c.max_pending = max(c.max_pending, len(self.queue))
            sim.log.append(CopyRecord(self, entry.dst_span, entry.src_span, dst.numel() * dst.element_size()))

    def flush(self, upto: int | None = None) -> int:
        """Run the queued copies whose position is below `upto` (all by default), in order; how many ran."""
        sim, ran = self.sim, 0
        with sim.lock:
            while self.queue and (upto is None or self.queue[0].seq < upto):
                entry = self.queue.popleft()
                if sim.checking:
                    entry.check_alive(sim, self)
                sim._execute(entry)
                self.flushed += 1
                sim.counters.flushed += 1
                ran += 1
        return ran


class SimEvent:
    def __init__(self, sim: "StreamSim", enable_timing: bool = False, **_):
        self.sim = sim
        self.enable_timing = enable_timing
        self.stream: SimStream | None = None
        self.mark: int | None = None  # the stream's copy count when recorded: the copies before it
        self.compute_seen = 0  # the compute op a wait for this event orders after (0: never recorded)

    def record(self, stream: SimStream | None = None) -> None:
        stream = stream if stream is not None else self.sim.current()
        with self.sim.lock:
            if stream.side:
                self.stream, self.mark = stream, stream.enqueued
                self.compute_seen = stream.compute_seen
                self.sim.counters.events_recorded += 1
            else:
                self.stream, self.mark = None, None  # the compute stream ran everything already
                self.compute_seen = self.sim.timeline.pos  # ... in program order; a lagging GPU, up to here

    def _land(self) -> None:
        if self.stream is not None:
            self.stream.flush(upto=self.mark)

    def synchronize(self) -> None:
        self.sim.counters.event_syncs += 1
        self._land()
        self.sim._host_saw(self.compute_seen)

    def query(self) -> bool:
        self.sim.counters.event_syncs += 1
        self._land()
        self.sim._host_saw(self.compute_seen)
        return True

    def wait(self, stream: SimStream | None = None) -> None:
        self.sim.counters.event_syncs += 1
        self._land()
        (stream if stream is not None else self.sim.current())._saw(self.compute_seen)

    def elapsed_time(self, end: "SimEvent") -> float:
        return 0.0


class _SideStreamCopies(TorchDispatchMode):
    """Pushed on one thread while a side stream is current there: defers its copies."""

    def __init__(self, sim: "StreamSim"):
        super().__init__()
        self.sim = sim

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        sim = self.sim
        stream = sim.current()
        if func is COPY and stream.side and not getattr(sim._local, "executing", False):
            dst, src = args[0], args[1]
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            if not non_blocking:
                sim.counters.blocking += 1
                stream.check_copy(span(dst), span(src))
                stream.flush()
                return func(*args, **kwargs)
            stream.enqueue(dst, src)
            return dst
        return func(*args, **kwargs)


class StreamSim:
    """The state of the model: its streams, their queues, the counters, and every deferred copy (`log`)."""

    def __init__(self):
        self.lock = threading.RLock()
        self.counters = Counters()
        self.log: list[CopyRecord] = []
        self.flush_threads: set[str] = set()  # names of the threads that ran queued copies
        self.compute = SimStream(self, "compute", side=False)
        self.streams: list[SimStream] = []
        self._local = threading.local()
        self.timeline = Timeline()
        self.cudart = None  # the driver model page-locking host memory (cuda_branches): its ranges are host memory
        self._registered = (None, SpanIndex())  # (cudart's call counts, its live ranges) cached
        self.pageable_host = SpanIndex()  # host-only buffers that are not page-locked (sim_branches marks them)
        self.host_seen = 0  # the compute op the host last synchronised past
        self.hazards: list[Hazard] = []
        self.checking = False  # inside `with sim:`
        self._log: ComputeLog | None = None
        self.pools: list[_PoolBlock] = []  # tensors allocated on side streams, until their stream may reuse them

    # -- torch.cuda's functions, simulated -------------------------------------------------------------------------
    def new_stream(self, device=None, priority: int = 0, **_) -> SimStream:
        with self.lock:
            s = SimStream(self, f"side{len(self.streams)}", side=True, device=device)
            self.streams.append(s)
        return s

    def new_event(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False, **_):
        return SimEvent(self, enable_timing=enable_timing)

    def _stack(self) -> list[SimStream]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def current(self, device=None) -> SimStream:
        stack = self._stack()
        return stack[-1] if stack else self.compute

    def default_stream(self, device=None) -> SimStream:
        return self.compute

    @contextlib.contextmanager
    def stream(self, s: SimStream | None):
        if s is None:  # torch.cuda.stream(None) changes nothing
            yield
            return
        stack = self._stack()
        stack.append(s)
        mode = _SideStreamCopies(self) if s.side else None
        if mode is not None:
            mode.__enter__()
        try:
            yield
        finally:
            if mode is not None:
                mode.__exit__(None, None, None)
            stack.pop()

    def synchronize(self, device=None) -> None:
        self.counters.device_syncs += 1
        self.flush_all()
        self._host_saw(self.timeline.pos)

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        """Counted; the copies queued on `stream` that use the tensor's memory are marked (check_alive). A call
        made before the copy is queued is not seen (the runtime records after queueing)."""
        self.counters.record_streams += 1
        if not isinstance(stream, SimStream) or not tensor.numel():
            return
        ptr = tensor.untyped_storage().data_ptr()
        with self.lock:
            if not stream.side:  # a side stream's pool block that compute uses: kept from the pool until compute's done
                for block in self.pools:
                    if block.alias.untyped_storage().data_ptr() == ptr:
                        block.recorded = True
            for entry in stream.queue:
                for name in ("dst", "src"):
                    if getattr(entry, name).untyped_storage().data_ptr() == ptr:
                        entry.recorded.add(name)

    # -- side streams' pools -----------------------------------------------------------------------------------------
    def held(self, extra: _Entry | None = None) -> collections.Counter:
        """Storage address -> how many of the simulation's own aliases hold it (queued copies, `extra` (a copy
        being run, out of its queue), pool blocks): memory held only by these, the program has let go of."""
        held = collections.Counter(b.alias.untyped_storage().data_ptr() for b in self.pools)
        for q in [*([extra] if extra is not None else []), *(e for st in self.streams for e in st.queue)]:
            for other in (q.dst, q.src):
                held[other.untyped_storage().data_ptr()] += 1
        return held

    def pool_allocation(self, stream: SimStream, t: torch.Tensor) -> None:
        """`t` was just allocated on side stream `stream` (called by ComputeLog, under the lock). The caching
        allocator may have given it any block of that stream's pool the program had freed: a freed block compute
        used later than `stream` last waited for compute, with no record_stream on compute, is a hazard (the
        stream's new work may overwrite bytes compute's queued kernels still read). Then `t` is tracked."""
        held = self.held()
        kept = []
        for block in self.pools:
            ptr, refs = _storage_refs(block.alias)
            if block.stream is not stream or refs > held[ptr]:
                kept.append(block)  # another pool's, or still the program's
                continue
            n, op = self.timeline.last(block.span, writes_only=False)
            if not block.recorded and n > stream.compute_seen:
                self.hazards.append(Hazard(stream.name, "reuses memory of its pool freed with no record_stream on "
                                           "compute, its", block.span, n, op, stream.compute_seen))
        self.pools = kept
        self.timeline.forget(span(t))
        self.pools.append(_PoolBlock(stream, t))

    # -- the lag ---------------------------------------------------------------------------------------------------
    def _host_saw(self, compute_op: int) -> None:
        self.host_seen = max(self.host_seen, compute_op)

    @contextlib.contextmanager
    def host_side(self):
        """Ops in here are the host's (it runs them at once, the GPU's queue possibly behind): checked against the
        compute log, not logged."""
        self._local.host = getattr(self._local, "host", 0) + 1
        try:
            yield
        finally:
            self._local.host -= 1

    def _in_host_memory(self, sp: tuple[int, int]) -> bool:
        if self.pageable_host.overlaps(sp):
            return True
        if self.cudart is None:
            return False
        version = (len(self.cudart.registered), len(self.cudart.unregistered))
        if self._registered[0] != version:
            self._registered = (version, SpanIndex((a, a + n) for a, n in self.cudart.live.items()))
        return self._registered[1].overlaps(sp)

    def _check_host(self, writes, op: str) -> None:
        """A host op writing bytes compute may still read or write (its reads are not checked: the host reads
        device results only through copies, which the poison model covers)."""
        if not self.checking:
            return
        self.counters.host_ops += 1
        for sp in writes:
            n, last = self.timeline.last(sp, writes_only=False)
            if n > self.host_seen:
                self.hazards.append(Hazard("host", f"writes ({op})", sp, n, last, self.host_seen))

    def check_unpinned(self, sp: tuple[int, int]) -> None:
        """Host memory about to be unregistered: a copy still queued on it would read or write memory the driver no
        longer holds (a fault, or pageable bytes copied asynchronously)."""
        if not self.checking:
            return
        with self.lock:
            for stream in self.streams:
                for entry in stream.queue:
                    for name in ("dst_span", "src_span"):
                        if overlap(getattr(entry, name), sp):
                            self.hazards.append(Hazard(stream.name, "copies page-locked memory unregistered while "
                                                       "the copy was queued", getattr(entry, name), 0, "", 0))

    def take_hazards(self) -> list[Hazard]:
        """The hazards found so far, cleared (a test that expects them takes them; any left fail the `with`)."""
        with self.lock:
            found, self.hazards = self.hazards, []
        return found

    # -- for tests -------------------------------------------------------------------------------------------------
    def flush_all(self) -> int:
        with self.lock:
            return sum(s.flush() for s in list(self.streams))

    def pending(self) -> int:
        with self.lock:
            return sum(s.pending for s in self.streams)

    def _execute(self, entry: _Entry) -> None:
        """Run a queued copy for real: the dispatch mode passes it through on this thread, and autograd neither
        records it nor bumps the destination's version (a copy landing on a GPU does neither)."""
        self._local.executing = True
        self.flush_threads.add(threading.current_thread().name)
        try:
            with torch.no_grad(), torch._C._AutoDispatchBelowADInplaceOrView():
                COPY(entry.dst, entry.src, True)
        finally:
            self._local.executing = False

    def __enter__(self) -> "StreamSim":
        """From here on this thread's compute ops are logged and every side-stream copy and host_side() op is
        checked against them."""
        self._log = ComputeLog(self)
        self._log.__enter__()
        self.checking = True
        return self

    def __exit__(self, exc_type, *exc) -> None:
        """Land what is still queued (as a GPU eventually would), counting it; then fail on hazards no test took."""
        try:
            self.counters.pending_at_exit += self.pending()
            self.flush_all()
        finally:
            self.checking = False
            self.pools = []
            if self._log is not None:
                self._log.__exit__(None, None, None)
                self._log = None
        if exc_type is None and self.hazards:
            found = self.take_hazards()
            raise AssertionError(f"{len(found)} stream-ordering hazard(s) under a lagging compute stream; the "
                                 "first: " + "; ".join(map(str, found[:3])))


def simulated_cuda(monkeypatch) -> StreamSim:
    """For the rest of the test: torch.cuda's Stream, Event, current_stream, default_stream, stream and synchronize,
    and Tensor.record_stream, simulated (see the module's docstring). Returns the simulation to inspect; usable as
    `with simulated_cuda(monkeypatch) as sim:` to land leftover copies at the end."""
    sim = StreamSim()
    monkeypatch.setattr(torch.cuda, "Stream", sim.new_stream)
    monkeypatch.setattr(torch.cuda, "Event", sim.new_event)
    monkeypatch.setattr(torch.cuda, "current_stream", sim.current)
    monkeypatch.setattr(torch.cuda, "default_stream", sim.default_stream)
    monkeypatch.setattr(torch.cuda, "stream", sim.stream)
    monkeypatch.setattr(torch.cuda, "synchronize", sim.synchronize)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: sim.record_stream(self, stream))
    return sim

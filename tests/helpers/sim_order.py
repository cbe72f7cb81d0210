"""The lagging compute stream of the stream simulation (sim_streams.py), checked rather than replayed: compute ops
numbered and logged with the byte spans they touch (Timeline), a dispatch mode that logs them (ComputeLog), and the
races a lagging GPU would expose (Hazard). The rules are in sim_streams' docstring."""
from __future__ import annotations

import collections
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

COPY = torch.ops.aten.copy_.default
ITEM = torch.ops.aten._local_scalar_dense.default
LIFT_FRESH = torch.ops.aten.lift_fresh.default  # torch.tensor(data): made outside the dispatcher, then lifted


@dataclass
class Hazard:
    """A race a lagging compute stream would expose: `who` (a side stream's name, or "host") `does` to the bytes
    `span` while compute's op number `compute_op` (`op`) may not have run yet; `who` had only waited up to `seen`."""
    who: str
    does: str
    span: tuple[int, int]
    compute_op: int
    op: str
    seen: int

    def __str__(self) -> str:
        where = f"bytes [{self.span[0]:#x}, {self.span[1]:#x})"
        if not self.compute_op:  # a lifetime hazard (_Entry.check_alive), not an ordering one
            return f"{self.who} {self.does}: {where}"
        return (f"{self.who} {self.does} {where} that compute op #{self.compute_op} ({self.op}) touched, having waited "
                f"for compute only up to op #{self.seen}")


def span(t: torch.Tensor) -> tuple[int, int]:
    """[start, end) of the bytes tensor t may touch."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


def overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


PAGE_SHIFT = 12
# ops that read only their input's shape and dtype (their output is an allocation)
LIKE = {torch.ops.aten.empty_like.default, torch.ops.aten.zeros_like.default, torch.ops.aten.ones_like.default,
         torch.ops.aten.full_like.default, torch.ops.aten.rand_like.default, torch.ops.aten.randn_like.default}
# ops that read a tensor's metadata, never its bytes
METADATA = {torch.ops.aten.is_pinned.default, torch.ops.aten.is_same_size.default, torch.ops.aten.sym_size.int,
             torch.ops.aten.sym_stride.int, torch.ops.aten.sym_numel.default, torch.ops.aten.sym_storage_offset.default}


class SpanIndex:
    """Byte spans indexed by 4 KiB page, to find the ones overlapping a span."""

    def __init__(self, spans=()):
        self.spans: dict[tuple[int, int], object] = {}
        self.pages: dict[int, set] = collections.defaultdict(set)
        for sp in spans:
            self.add(sp)

    def add(self, sp: tuple[int, int], value=None):
        if sp not in self.spans and sp[0] < sp[1]:
            for page in range(sp[0] >> PAGE_SHIFT, ((sp[1] - 1) >> PAGE_SHIFT) + 1):
                self.pages[page].add(sp)
        self.spans[sp] = value
        return value

    def overlaps(self, sp: tuple[int, int]) -> bool:
        return bool(self._overlapping(sp))

    def _overlapping(self, sp: tuple[int, int]) -> list:
        if sp[0] >= sp[1]:
            return []
        found = set()
        for page in range(sp[0] >> PAGE_SHIFT, ((sp[1] - 1) >> PAGE_SHIFT) + 1):
            found |= self.pages.get(page, set())
        return [other for other in found if overlap(other, sp)]


class Timeline(SpanIndex):
    """The compute stream's ops in program order: for each byte span an op touched, the number of the last op that
    touched it and of the last that wrote it."""

    def __init__(self):
        super().__init__()
        self.pos = 0

    def record(self, reads, writes, op: str) -> None:
        self.pos += 1
        for sp, write in [(r, False) for r in reads] + [(w, True) for w in writes]:
            rec = self.spans.get(sp)
            if rec is None:
                rec = self.add(sp, [0, 0, op])  # span -> [last access, last write, op name]
            rec[0], rec[2] = self.pos, op
            if write:
                rec[1] = self.pos

    def forget(self, sp: tuple[int, int]) -> None:
        """The bytes of `sp` are a new host tensor's: what compute did to a freed tensor there is not its past (on a
        GPU the two never share memory; on the CPU the allocator reuses the address)."""
        for other in self._overlapping(sp):
            rec = self.spans[other]
            rec[0] = rec[1] = 0

    def last(self, sp: tuple[int, int], writes_only: bool) -> tuple[int, str]:
        """The last compute op (number, name) that touched (or wrote) bytes of `sp`; (0, "") if none."""
        best = (0, "")
        for other in self._overlapping(sp):
            rec = self.spans[other]
            n = rec[1] if writes_only else rec[0]
            if n > best[0]:
                best = (n, rec[2])
        return best


def _tensors(value) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor) and t.layout == torch.strided
            and t.device.type == "cpu" and t.numel() and t.data_ptr()]


def tensor_spans(value) -> list[tuple[int, int]]:
    return [span(t) for t in _tensors(value)]


def accesses(func, args, kwargs) -> tuple[list, list]:
    """The byte spans an op's arguments give it to read and to write: those its schema marks written (in place,
    out=) are writes, other tensor arguments reads. (What it returns is written too: ComputeLog adds that.)"""
    reads, writes = [], []
    for i, arg in enumerate(func._schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        if value is None:
            continue
        written = arg.alias_info is not None and arg.alias_info.is_write
        (writes if written else reads).extend(tensor_spans(value))
    return reads, writes


class ComputeLog(TorchDispatchMode):
    """Pushed on the main thread inside `with sim:`: numbers the compute stream's ops and logs what they touch
    (Timeline). The host's ops are checked instead: those of a host_side() region, and every op but a copy that
    touches page-locked host memory (registered through `sim.cudart`): no kernel in the runtime reads host memory,
    only copies do. Side-stream ops, landing copies and views (no bytes touched) are left out, but an allocation on a
    side stream is that stream's pool's (StreamSim.pool_allocation: what compute did to those bytes is forgotten,
    what compute does to them later is checked when the pool reuses them); `*_like` ops read only their input's
    shape; a tensor made from Python data (torch.tensor, seen only as `lift_fresh`) is new memory: what compute did
    to a freed tensor at its address is forgotten (_fresh_from_data)."""

    def __init__(self, sim):
        super().__init__()
        self.sim = sim  # the StreamSim (its lock, timeline, host checks and thread-local state)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        sim, local = self.sim, self.sim._local
        if func is LIFT_FRESH and not getattr(local, "executing", False):
            self._fresh_from_data(out)
            return out
        if func.is_view or func in METADATA or getattr(local, "executing", False):
            return out
        host = getattr(local, "host", 0)
        reads, writes = ([], []) if func in LIKE else accesses(func, args, kwargs)
        if not host and sim.current().side:
            # memory allocated on a side stream is from that stream's pool of the caching allocator: not compute's
            # past, but compute may use it from here on (StreamSim.pool_allocation checks the pool's reuse)
            with sim.lock:
                for t in _tensors(out):
                    if not any(overlap(span(t), a) for a in reads + writes):
                        sim.pool_allocation(sim.current(), t)
            return out
        outs = tensor_spans(out)
        with sim.lock:
            if host or (func is not COPY and any(map(sim._in_host_memory, reads + writes))):
                sim._check_host(writes, str(func))
                for sp in outs:  # a fresh host tensor: what compute did to freed memory there is not its past
                    if not any(overlap(sp, a) for a in reads + writes):
                        sim.timeline.forget(sp)
            else:
                sim.timeline.record(reads, writes + outs, str(func))
                sim.counters.compute_ops += 1
                if func is ITEM:  # .item() (a tensor's value read on the host) waits for compute up to here
                    sim._host_saw(sim.timeline.pos)
        return out

    def _fresh_from_data(self, t: torch.Tensor) -> None:
        """torch.tensor(...) / as_tensor(list) (Adafactor's host `step`): memory the allocator just gave out, with
        no allocation op on the log (`lift_fresh`, the only op seen, is an alias of its input: a view here). On a GPU
        such a tensor has no past on the compute stream (a host tensor; or a device one, whose blocking copy from
        the host waited for compute), but the CPU allocator may have put it where a freed tensor compute touched
        was: forget that one's past, as for any fresh host tensor. Not for memory it does not own (from_numpy,
        as_tensor(ndarray): not resizable): those bytes live on, their past is theirs."""
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel() and t.untyped_storage().resizable():
            with self.sim.lock:
                self.sim.timeline.forget(span(t))

"""Layer offload: offloaded blocks' frozen weights stream host -> device through a preallocated area of slots.

- One host copy of the weights: a frozen weight already in host memory in the weight dtype (the headless model's,
  or ComfyUI's own) is the source of its host-to-device copies, page-locked in place on CUDA (host_pinning), so the
  run adds no host memory; so do quantized storage subclasses, as bytes (tensor_kinds). Only weights that cannot
  stream from where they are (on the device, in another dtype than weight_dtype, or non-contiguous) get a host copy:
  one flat buffer per block, freed at detach. Memory the system refuses to page-lock stays pageable (`pinned`).
- Undo copies no weights: each param gets its original tensor back (a weight that lived on the device and so was
  dropped while offloaded is copied back there from its host copy).
- Frozen weights travel host-to-device only: they never change, so eviction is free (nothing is copied back).
- The device side is one preallocated flat byte area, so streaming causes no allocator churn: prefetch_depth + 1
  cells, each the size of the largest offloaded block (packed). A block takes a slot: a whole cell, or, when it is
  at most half a cell, one of the cell // size sub-slots of a cell (a slot never straddles cells). Models with
  blocks of two sizes (Flux: 648 MiB double and 270 MiB single blocks) so stream their small blocks deeper at no
  extra memory: while single blocks stream, the two cells of depth 1 hold four of them. A block's params become
  views into its slot while it is loaded, and an expanded NaN scalar while it is not, so any use of an unloaded
  block poisons the loss instead of silently reading another block's weights.
- Copies run on a side CUDA stream, ahead of the block being computed, in forward order and, during backward, in
  reverse order: `prefetch_depth` offloaded blocks at least, and more while the current block and the window fit
  the cells by share (a block takes 1 / (cell // size) of a cell; see prefetch_window). Slots are reused lazily
  (slots whose blocks are furthest behind the current one go first), so blocks left loaded by a recompute that
  stopped early are simply evicted when a slot is needed.
- Weights that autograd saves for backward are packed as (block, offset within its slot) references and unpacked by
  loading the block again, wherever its slot is then, so saving a weight never pins a slot. Whether a tensor is a
  slot view is decided by its storage (the area's data pointer), never by comparing device objects ("cuda" vs
  "cuda:0").
On a CPU device the same schedule runs with real copies from the host sources into the "device" slots (simulation)."""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from .devices import normalize_device
from .host_pinning import PinnedRanges
from .tensor_kinds import held_dtype, keeps_bytes, plain_view

_ALIGN = 256  # bytes; keeps every param view aligned for any dtype and for vectorised kernels


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass (recompute and saved-tensor unpacking happen there)."""
    return torch._C._current_graph_task_id() != -1


def streams_in_place(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether an offloaded weight can be copied to its slot straight from its own storage (no host copy)."""
    return keeps_bytes(t) and t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous()


@dataclass
class _Layout:
    params: list[tuple[nn.Parameter, int, torch.Size, torch.dtype]]  # (param, byte offset in a slot, shape, dtype)
    nbytes: int                                    # slot bytes (each param aligned)
    sources: list[torch.Tensor]                    # per param: the host tensor its slot bytes are copied from
    copy: torch.Tensor | None = None               # flat uint8 host copy of the params that cannot stream in place
    splits: list = field(default_factory=list)     # per source: byte ranges wholly in or out of page-locked memory,
                                                   # or None (one copy); see host_pinning


@dataclass(frozen=True)
class WeightRef:
    """What autograd keeps for a saved view of an offloaded weight: enough to rebuild it after reloading."""
    block: int
    offset: int
    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class TransferCounters:
    h2d_bytes: int = 0
    loads: int = 0
    cuda_wait_events: list = field(default_factory=list)
    live_views: int = 0       # unpacked weight views (slot views handed to autograd) not yet freed
    peak_live_views: int = 0
    stale_views: int = 0      # slots refilled while a view of their previous block was alive (must stay 0)
    peak_resident: int = 0    # the most blocks loaded at once (more than cells when small blocks share a cell)


class LayerOffload:
    def __init__(self, blocks: list[nn.Module], offloaded: list[int], device: torch.device, *,
                 prefetch_depth: int, pin_memory: bool, weight_dtype: torch.dtype | None,
                 poison_slots: bool = False):
        self.blocks = blocks
        self.offloaded = sorted(offloaded)
        self.device = normalize_device(device)
        self.depth = prefetch_depth
        self.cuda = self.device.type == "cuda"
        self.pin = pin_memory and self.cuda
        self.pinned = self.pin  # False once the system refused to page-lock some host weights in place
        self.weight_dtype = weight_dtype
        self.poison_slots = poison_slots
        self.counters = TransferCounters()
        self.layouts: dict[int, _Layout] = {}
        self.area: torch.Tensor | None = None       # the cells, one flat byte buffer on the device
        self.cell_bytes = 0
        self.n_cells = 0
        self.resident: dict[int, int] = {}          # block -> byte offset of its slot in the area
        self.ready: dict[int, torch.cuda.Event | None] = {}
        self._area_ptr: int | None = None
        self._placeholders: dict[tuple, torch.Tensor] = {}
        self._restore: list[tuple[nn.Parameter, torch.Tensor | None, torch.device, torch.dtype]] = []
        self._pinned = PinnedRanges(self.device)
        self._current: tuple[int, bool] | None = None
        self._views: list[tuple[weakref.ref, int, int, int]] = []  # (unpacked view, slot start, end, block)
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None

    # -- setup and teardown ------------------------------------------------------------------------------------
    def attach(self) -> None:
        for i in self.offloaded:
            self._layout(i)
        if self.pin:
            self._pinned.register(src for lay in self.layouts.values() for src in lay.sources)
            self.pinned = self._pinned.refused_bytes == 0
            for lay in self.layouts.values():
                lay.splits = [self._pinned.split(src.data_ptr(), src.numel() * src.element_size())
                              for src in lay.sources]
        self.n_cells = min(self.depth + 1, len(self.offloaded))
        self.cell_bytes = max((self.layouts[i].nbytes for i in self.offloaded), default=0)
        self.area = torch.empty(self.n_cells * self.cell_bytes, dtype=torch.uint8, device=self.device)
        self._area_ptr = self.area.untyped_storage().data_ptr()

    def _layout(self, index: int) -> None:
        """Block `index`'s layout, registered before any param is swapped (detach undoes a half-made one)."""
        block, entries, offset = self.blocks[index], [], 0
        for p in block.parameters():
            if not p.requires_grad:  # a storage subclass's bytes stream as they are (tensor_kinds.py)
                dtype = held_dtype(p, self.weight_dtype) if type(p.data) is torch.Tensor else p.dtype
                entries.append((p, offset, p.size(), dtype))
                offset += _aligned(p.numel() * dtype.itemsize)
        copied = [k for k, (p, _, _, dtype) in enumerate(entries) if not streams_in_place(p.data, dtype)]
        copy_offsets, n = {}, 0
        for k in copied:
            copy_offsets[k] = n
            n += _aligned(entries[k][0].numel() * entries[k][3].itemsize)
        layout = self.layouts[index] = _Layout(entries, offset, [], torch.empty(n, dtype=torch.uint8) if n else None)
        for k, (p, _, shape, dtype) in enumerate(entries):
            original = p.data
            if k in copy_offsets:
                source = _view(layout.copy, copy_offsets[k], shape, dtype)
                source.copy_(plain_view(original))
            else:
                source = plain_view(original)
            layout.sources.append(source)
            # the original goes back on detach unless it lived on the device, where dropping it is the point
            keep = original if original.device.type == "cpu" or dtype != original.dtype else None
            self._restore.append((p, keep, original.device, original.dtype))
            p.data = self._placeholder(shape, dtype)

    def detach(self) -> None:
        """Give every offloaded param back its original tensor (no copy of host weights), then release the slots,
        the host copies and the page-locking."""
        try:
            if self.cuda:
                torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)
                self.copy_stream.synchronize()  # no copy may still read host memory about to be unpinned or freed
        finally:
            self._pinned.release()  # before the copies back below: they read whole host buffers (host_pinning)
        try:
            sources = {id(p): src for lay in self.layouts.values() for (p, *_), src in zip(lay.params, lay.sources)}
            for p, kept, dev, dtype in self._restore:
                p.data = kept if kept is not None else sources[id(p)].to(dev, dtype)
        finally:
            self._restore.clear()
            self.layouts.clear()
            self.area, self._area_ptr, self.resident, self.ready = None, None, {}, {}
            self._views = []

    def host_source(self, p: nn.Parameter) -> torch.Tensor | None:
        """The host tensor an offloaded frozen parameter streams from (the model's own tensor, or its host copy in
        weight_dtype), or None for a parameter this object does not offload. Valid whether or not its block is
        loaded, while attached."""
        for lay in self.layouts.values():
            for (q, *_), src in zip(lay.params, lay.sources):
                if q is p:
                    return src
        return None

    def host_copy_bytes(self) -> int:
        """Host bytes this object allocated: copies of weights that could not stream from their own storage."""
        return sum(lay.copy.numel() for lay in self.layouts.values() if lay.copy is not None)

    def pinned_bytes(self) -> int:
        """Host bytes page-locked in place for this run (0 off CUDA, or where pinning was refused)."""
        return self._pinned.pinned_bytes

    def slot_bytes(self) -> int:
        """Device bytes of the slot area (all cells)."""
        return self.area.numel() if self.area is not None else 0

    def device_storage_ptrs(self) -> set[int]:
        """Storages this object owns on the device: the slot area and the tiny NaN placeholders."""
        area = {self._area_ptr} if self._area_ptr is not None else set()
        return area | {t.untyped_storage().data_ptr() for t in self._placeholders.values()}

    def slot_positions(self, nbytes: int) -> list[int]:
        """Byte offsets in the area where a block of `nbytes` (packed) may be placed: cell // nbytes per cell."""
        per_cell = self.cell_bytes // nbytes if nbytes else 1
        return [c * self.cell_bytes + k * nbytes for c in range(self.n_cells) for k in range(per_cell)]

    # -- the schedule --------------------------------------------------------------------------------------------
    def load(self, index: int) -> None:
        """Block `index` is about to run (forward, or recompute/backward): make it resident, then prefetch ahead."""
        backward = in_backward()
        if self._current == (index, backward) and (index not in self.layouts or index in self.resident):
            return
        self._current = (index, backward)
        window = self._window(index, backward)
        if index in self.layouts:
            if index not in self.resident:
                self._fetch(index, protect={index, *window})
            self._wait(index)
        for j in window:
            if j not in self.resident and not self._fetch(j, protect={index, *window}):
                break

    def _window(self, index: int, backward: bool) -> list[int]:
        ahead = [j for j in self.offloaded if (j < index if backward else j > index)]
        ahead = ahead[::-1] if backward else ahead
        current = self.layouts[index].nbytes if index in self.layouts else None
        n = prefetch_window([self.layouts[j].nbytes for j in ahead], current, self.cell_bytes, self.n_cells,
                            self.depth)
        return ahead[:n]

    def _fetch(self, index: int, protect: set[int]) -> bool:
        layout = self.layouts[index]
        start = self._free_slot(index, layout.nbytes, protect)
        if start is None:
            return False
        dst = self.area[start: start + layout.nbytes]
        self._check_views(start, start + layout.nbytes, index)
        if self.poison_slots:
            dst.fill_(0xFF)  # all-ones bytes are NaN in every float dtype: stale views of the old owner read NaN
        if self.cuda:
            # the slot's previous owner may still be read by kernels queued on the compute stream
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.copy_stream):
                views = self._copy_in(layout, dst, non_blocking=True)
                event = torch.cuda.Event(enable_timing=False)
                event.record(self.copy_stream)
            self.ready[index] = event
        else:
            views = self._copy_in(layout, dst, non_blocking=self.pin)  # pinning emulated by a test: as on CUDA
            self.ready[index] = None
        for (p, *_), view in zip(layout.params, views):
            p.data = view
        self.resident[index] = start
        self.counters.peak_resident = max(self.counters.peak_resident, len(self.resident))
        self.counters.h2d_bytes += sum(src.numel() * src.element_size() for src in layout.sources)
        self.counters.loads += 1
        return True

    @staticmethod
    def _copy_in(layout: _Layout, dst: torch.Tensor, non_blocking: bool) -> list[torch.Tensor]:
        """One copy per param into its place in the slot (a source partly page-locked: one per part); returns the
        views. On CUDA all are queued asynchronously, pageable sources too: the driver stages those and may wait for
        the stream, a blocking copy always waits for it and for the copy, so a refused range slows only its own."""
        views = []
        splits = layout.splits or [None] * len(layout.sources)
        for (_, off, shape, dtype), src, parts in zip(layout.params, layout.sources, splits):
            view = _view(dst, off, shape, dtype)
            if parts is None:
                view.copy_(src, non_blocking=non_blocking)
            else:
                src_bytes, dst_bytes = src.reshape(-1).view(torch.uint8), dst[off: off + src.numel() * src.element_size()]
                for a, b in parts:
                    dst_bytes[a:b].copy_(src_bytes[a:b], non_blocking=non_blocking)
            views.append(view)
        return views

    def _occupants(self, start: int, end: int) -> list[int]:
        """Loaded blocks whose slots overlap bytes [start, end) of the area."""
        return [b for b, s in self.resident.items() if s < end and start < s + self.layouts[b].nbytes]

    def _free_slot(self, index: int, nbytes: int, protect: set[int]) -> int | None:
        """A slot for a block of `nbytes`: the first empty one, else the one whose blocks (none protected) are all
        behind the current one and furthest from it, else the furthest ahead (stale). Its blocks are evicted."""
        choices = [(start, self._occupants(start, start + nbytes)) for start in self.slot_positions(nbytes)]
        for start, occupants in choices:
            if not occupants:
                return start
        current = self._current[0] if self._current else index
        backward = bool(self._current and self._current[1])
        candidates = [(start, occ) for start, occ in choices if not protect.intersection(occ)]
        if not candidates:
            return None

        def behind(o: int) -> bool:
            return o > current if backward else o < current

        pool = [c for c in candidates if all(behind(o) for o in c[1])] or candidates
        start, occupants = max(pool, key=lambda c: min(abs(o - current) for o in c[1]))
        for o in occupants:
            self._evict(o)
        return start

    def _evict(self, index: int) -> None:
        for p, _, shape, dtype in self.layouts[index].params:
            p.data = self._placeholder(shape, dtype)
        self.resident.pop(index)
        self.ready.pop(index, None)

    def _wait(self, index: int) -> None:
        event = self.ready.get(index)
        if event is None:
            return
        stream = torch.cuda.current_stream(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        stream.wait_event(event)
        end.record(stream)
        self.counters.cuda_wait_events.append((start, end))
        self.ready[index] = None

    def collect_wait_seconds(self) -> float:
        """Time the compute stream stalled on copies since the last call (synchronises CUDA). Copies in the CPU
        simulation are synchronous and count as step time, not waiting."""
        events, self.counters.cuda_wait_events = self.counters.cuda_wait_events, []
        if not events:
            return 0.0
        torch.cuda.synchronize(self.device)
        return sum(s.elapsed_time(e) for s, e in events) / 1000.0

    # -- saved-tensor hooks for weights --------------------------------------------------------------------------
    def owns(self, t: torch.Tensor) -> bool:
        """Whether t is a view of the slot area: by its storage, so any spelling of the device matches."""
        return t.device.type == self.device.type and t.untyped_storage().data_ptr() == self._area_ptr

    def pack(self, t: torch.Tensor) -> WeightRef:
        """A reference to the block whose slot holds t, and t's offset from the slot's start (in elements)."""
        at = t.storage_offset() * t.element_size()
        owner = next(b for b, s in self.resident.items() if s <= at < s + self.layouts[b].nbytes)
        return WeightRef(owner, t.storage_offset() - self.resident[owner] // t.element_size(), t.shape, t.stride(),
                         t.dtype)

    def unpack(self, ref: WeightRef) -> torch.Tensor:
        self.load(ref.block)
        start = self.resident[ref.block]
        view = self.area.view(ref.dtype).as_strided(ref.shape, ref.stride, start // ref.dtype.itemsize + ref.offset)
        c = self.counters
        c.live_views += 1
        c.peak_live_views = max(c.peak_live_views, c.live_views)
        end = start + self.layouts[ref.block].nbytes
        self._views = [v for v in self._views if v[0]() is not None] + [(weakref.ref(view), start, end, ref.block)]
        weakref.finalize(view, self._view_freed)
        return view

    def _view_freed(self) -> None:
        self.counters.live_views -= 1

    def _check_views(self, start: int, end: int, index: int) -> None:
        """Count views of another block still alive in bytes about to be refilled (they would read `index`)."""
        self.counters.stale_views += sum(1 for v, s, e, b in self._views
                                         if s < end and start < e and b != index and v() is not None)

    def _placeholder(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        key = (tuple(shape), dtype)
        if key not in self._placeholders:
            fill = float("nan") if dtype.is_floating_point else 0
            self._placeholders[key] = torch.full((), fill, dtype=dtype, device=self.device).expand(shape)
        return self._placeholders[key]


def prefetch_window(ahead: list[int], current: int | None, cell_bytes: int, n_cells: int, depth: int) -> int:
    """How many of the offloaded blocks ahead (their packed bytes, in the order they will run) to have loaded while
    a block runs: at least `depth`, then more while the current block (its bytes; None when it is resident) and the
    window fit the cells by share, a block of n bytes taking 1 / (cell_bytes // n) of a cell. With blocks all the
    same size that is exactly `depth`; small blocks behind a large one go deeper in the same memory."""
    num, den = _add_share(0, 1, current or 0, cell_bytes)  # the cells used, num / den exactly
    n = 0
    for nbytes in ahead:
        num, den = _add_share(num, den, nbytes, cell_bytes)
        if n >= depth and num > n_cells * den:
            break
        n += 1
    return n


def _add_share(num: int, den: int, nbytes: int, cell_bytes: int) -> tuple[int, int]:
    """num / den + 1 / (cell_bytes // nbytes), exact on integers (the planner calls this millions of times: as
    `fractions.Fraction` it was most of a plan's time)."""
    if not nbytes:
        return num, den
    k = cell_bytes // nbytes
    common = math.lcm(den, k)
    return num * (common // den) + common // k, common


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _view(buf: torch.Tensor, offset: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    n = int(torch.Size(shape).numel()) * dtype.itemsize
    return buf[offset: offset + n].view(dtype).view(shape)

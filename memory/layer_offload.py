"""Layer offload: offloaded blocks' frozen weights stream host -> device through a ring of preallocated slots.

- One master copy per block in host memory (pinned where CUDA exists), in one flat byte buffer.
- Frozen weights travel host-to-device only: they never change, so eviction is free (nothing is copied back).
- Device slots are preallocated flat byte buffers, so streaming causes no allocator churn; a block's params become
  views into its slot while it is loaded, and an expanded NaN scalar while it is not, so any use of an unloaded
  block poisons the loss instead of silently reading another block's weights.
- Copies run on a side CUDA stream, `prefetch_depth` offloaded blocks ahead of the block being computed, in forward
  order and, during backward, in reverse order. Slots are reused lazily (the block furthest behind the current one
  goes first), so blocks left loaded by a recompute that stopped early are simply evicted when a slot is needed.
- Weights that autograd saves for backward are packed as (block, offset) references and unpacked by loading the
  block again, so saving a weight never pins a slot. Whether a tensor is a slot view is decided by its storage (the
  slots' data pointers), never by comparing device objects ("cuda" vs "cuda:0").
- Host copies that the system refuses to page-lock are pageable; copies from them are blocking (`pinned` says so).
On a CPU device the same schedule runs with real copies between a host buffer and the "device" slots (simulation).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from .devices import host_buffer, normalize_device

_ALIGN = 256  # bytes; keeps every param view aligned for any dtype and for vectorised kernels


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass (recompute and saved-tensor unpacking happen there)."""
    return torch._C._current_graph_task_id() != -1


@dataclass
class _Layout:
    params: list[tuple[nn.Parameter, int, torch.Size, torch.dtype]]  # (param, byte offset, shape, dtype)
    nbytes: int
    host: torch.Tensor | None = None  # flat uint8 master copy
    pinned: bool = False              # page-locked, so copies from it are asynchronous


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
        self.pinned = self.pin  # False once the system refused page-locked memory for a master copy
        self.weight_dtype = weight_dtype
        self.poison_slots = poison_slots
        self.counters = TransferCounters()
        self.layouts: dict[int, _Layout] = {}
        self.slots: list[torch.Tensor] = []
        self.slot_owner: list[int | None] = []
        self.resident: dict[int, int] = {}          # block -> slot
        self.ready: dict[int, torch.cuda.Event | None] = {}
        self._slot_ptrs: dict[int, int] = {}       # storage data_ptr -> slot
        self._placeholders: dict[tuple, torch.Tensor] = {}
        self._restore: list[tuple[nn.Parameter, torch.Tensor | None, torch.device, torch.dtype]] = []
        self._current: tuple[int, bool] | None = None
        self._views: list[tuple[weakref.ref, int, int]] = []  # (unpacked view, slot, block)
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None

    # -- setup and teardown ------------------------------------------------------------------------------------
    def attach(self) -> None:
        for i in self.offloaded:
            frozen = [p for p in self.blocks[i].parameters() if not p.requires_grad]
            offset, entries = 0, []
            for p in frozen:
                dtype = self.weight_dtype or p.dtype
                entries.append((p, offset, p.shape, dtype))
                offset += _aligned(p.numel() * dtype.itemsize)
            layout = _Layout(entries, offset)
            layout.host = host_buffer(lambda pin: torch.empty(offset, dtype=torch.uint8, pin_memory=pin), self.pin)
            layout.pinned = layout.host.is_pinned()
            self.pinned = self.pinned and layout.pinned
            for p, off, shape, dtype in entries:
                _view(layout.host, off, shape, dtype).copy_(p.detach())
                # keep the user's tensor only when our copy is not an exact stand-in for it (dtype changed)
                keep = p.data if dtype != p.dtype else None
                self._restore.append((p, keep, p.device, p.dtype))
                p.data = self._placeholder(shape, dtype)
            self.layouts[i] = layout
        n_slots = min(self.depth + 1, len(self.offloaded))
        slot_bytes = max((self.layouts[i].nbytes for i in self.offloaded), default=0)
        self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, device=self.device) for _ in range(n_slots)]
        self.slot_owner = [None] * n_slots
        self._slot_ptrs = {s.untyped_storage().data_ptr(): k for k, s in enumerate(self.slots)}

    def detach(self) -> None:
        """Give every offloaded param back on its original device and dtype, with its original values."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)
        by_param = {id(p): (i, off, shape, dtype) for i, lay in self.layouts.items()
                    for p, off, shape, dtype in lay.params}
        for p, kept, dev, dtype in self._restore:
            if kept is not None:
                p.data = kept
            else:
                i, off, shape, wdtype = by_param[id(p)]
                p.data = _view(self.layouts[i].host, off, shape, wdtype).to(dev, dtype, copy=True)
        self._restore.clear()
        self.layouts.clear()
        self.slots, self.slot_owner, self.resident, self.ready, self._slot_ptrs = [], [], {}, {}, {}
        self._views = []

    def slot_bytes(self) -> int:
        return sum(s.numel() for s in self.slots)

    def device_storage_ptrs(self) -> set[int]:
        """Storages this object owns on the device: the slots and the tiny NaN placeholders."""
        return set(self._slot_ptrs) | {t.untyped_storage().data_ptr() for t in self._placeholders.values()}

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
        return (ahead[::-1] if backward else ahead)[: self.depth]

    def _fetch(self, index: int, protect: set[int]) -> bool:
        slot = self._free_slot(index, protect)
        if slot is None:
            return False
        layout = self.layouts[index]
        dst = self.slots[slot]
        self._check_views(slot, index)
        if self.poison_slots:
            dst.fill_(0xFF)  # all-ones bytes are NaN in every float dtype: stale views of the old owner read NaN
        if self.cuda:
            # the slot's previous owner may still be read by kernels queued on the compute stream
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.copy_stream):
                dst[: layout.nbytes].copy_(layout.host, non_blocking=layout.pinned)  # pageable: blocking, honestly
                event = torch.cuda.Event(enable_timing=False)
                event.record(self.copy_stream)
            self.ready[index] = event
        else:
            dst[: layout.nbytes].copy_(layout.host)
            self.ready[index] = None
        for p, off, shape, dtype in layout.params:
            p.data = _view(dst, off, shape, dtype)
        self.slot_owner[slot] = index
        self.resident[index] = slot
        self.counters.h2d_bytes += layout.nbytes
        self.counters.loads += 1
        return True

    def _free_slot(self, index: int, protect: set[int]) -> int | None:
        for k, owner in enumerate(self.slot_owner):
            if owner is None:
                return k
        current = self._current[0] if self._current else index
        backward = bool(self._current and self._current[1])
        candidates = [(k, o) for k, o in enumerate(self.slot_owner) if o not in protect]
        if not candidates:
            return None
        # evict the block furthest behind the current one in this direction, else the furthest ahead (stale)
        behind = [(k, o) for k, o in candidates if (o > current if backward else o < current)]
        pool = behind or candidates
        k, owner = max(pool, key=lambda c: abs(c[1] - current))
        self._evict(owner)
        return k

    def _evict(self, index: int) -> None:
        for p, _, shape, dtype in self.layouts[index].params:
            p.data = self._placeholder(shape, dtype)
        self.slot_owner[self.resident.pop(index)] = None
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
        """Whether t is a view of a slot: by its storage, so any spelling of the device matches."""
        return t.device.type == self.device.type and t.untyped_storage().data_ptr() in self._slot_ptrs

    def pack(self, t: torch.Tensor) -> WeightRef:
        owner = self.slot_owner[self._slot_ptrs[t.untyped_storage().data_ptr()]]
        return WeightRef(owner, t.storage_offset(), t.shape, t.stride(), t.dtype)

    def unpack(self, ref: WeightRef) -> torch.Tensor:
        self.load(ref.block)
        slot = self.resident[ref.block]
        view = self.slots[slot].view(ref.dtype).as_strided(ref.shape, ref.stride, ref.offset)
        c = self.counters
        c.live_views += 1
        c.peak_live_views = max(c.peak_live_views, c.live_views)
        self._views = [v for v in self._views if v[0]() is not None] + [(weakref.ref(view), slot, ref.block)]
        weakref.finalize(view, self._view_freed)
        return view

    def _view_freed(self) -> None:
        self.counters.live_views -= 1

    def _check_views(self, slot: int, index: int) -> None:
        """Count views of another block still alive in a slot about to be refilled (they would read `index`)."""
        self.counters.stale_views += sum(1 for v, s, b in self._views if s == slot and b != index and v() is not None)

    def _placeholder(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        key = (tuple(shape), dtype)
        if key not in self._placeholders:
            fill = float("nan") if dtype.is_floating_point else 0
            self._placeholders[key] = torch.full((), fill, dtype=dtype, device=self.device).expand(shape)
        return self._placeholders[key]


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _view(buf: torch.Tensor, offset: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    n = int(torch.Size(shape).numel()) * dtype.itemsize
    return buf[offset: offset + n].view(dtype).view(shape)

"""A model of torch's CUDA caching allocator, to predict reserved memory from a sequence of allocations and frees.

Budgets cap reserved memory (what the process holds from the GPU), while shapes give only allocated bytes; the first
H100 run measured reserved 1.8 GiB above allocated at the 2048 px headline (benchmarks/results/h100-2026-11-23).
This replays the allocator's placement rules (c10/cuda/CUDACachingAllocator.cpp, torch 2.x) on sizes alone:

- a request is rounded up to a multiple of 512 bytes (at least 512); up to 1 MiB it goes to the small pool, above to
  the large pool; each pool (and stream) caches the blocks freed in it and never gives them to the other;
- a request takes the smallest free block of its pool and stream that fits it (lowest address among equals), and
  splits it when the rest is worth keeping (small pool: at least 512 B left; large pool: more than 1 MiB left, or
  at least 512 B with expandable segments); a freed block merges with free neighbours of its segment;
- with no fitting block, default mode asks the GPU for a new segment: 2 MiB for small requests, 20 MiB for requests
  under 10 MiB, else the request rounded up to 2 MiB; segments are only returned by empty_cache;
- with expandable segments (`expandable_segments:True`, which tightrope sets) each pool and stream has one segment
  of virtual address space that maps physical pages (2 MiB small pool, 20 MiB large pool) at the lowest address
  where free plus unmapped space fits the request, usually its end; the best fit looks past the block at the
  segment's end while a block that cannot grow fits (so the end is kept for growth); empty_cache unmaps whole free
  pages.

Not modelled: max_split_size / roundup_power2_divisions / garbage_collection_threshold (torch's defaults leave them
off), frees delayed by record_stream until another stream's work is done, out-of-memory retries, CUDA graphs.
Reserved = segments (default) or mapped pages (expandable); allocated = the sizes of blocks handed out (a request of
1.5 MiB given an unsplit 2.4 MiB block counts 2.4 MiB, as torch's allocated_bytes does).
"""
from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20          # largest small-pool request
SMALL_BUFFER = 2 << 20        # a small-pool segment / page
LARGE_BUFFER = 20 << 20       # a segment for requests under MIN_LARGE_ALLOC / a large-pool page
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20
SEGMENT_SPACE = 1 << 44       # the virtual space of one expandable segment (torch reserves 1.125 x the GPU's memory)


def round_size(size: int) -> int:
    return MIN_BLOCK if size < MIN_BLOCK else -(-size // MIN_BLOCK) * MIN_BLOCK


def allocation_size(size: int) -> int:
    """Default mode: the segment a request of `size` (rounded) makes when no cached block fits."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass(eq=False)
class _Block:
    addr: int
    size: int
    small: bool
    stream: int
    page: int = 0                  # expandable: the segment's page size; 0: a cudaMalloc segment
    allocated: bool = False
    mapped: bool = True
    prev: "_Block | None" = None
    next: "_Block | None" = None

    def key(self) -> tuple[int, int, int]:
        return (self.stream, self.size, self.addr)


@dataclass
class _Pool:
    free: list = field(default_factory=list)        # sorted (stream, size, addr, block) of free mapped blocks
    unmapped: list = field(default_factory=list)    # sorted (stream, addr, block) of unmapped ranges

    def add(self, b: _Block) -> None:
        if b.mapped:
            bisect.insort(self.free, (*b.key(), id(b), b))
        else:
            bisect.insort(self.unmapped, (b.stream, b.addr, id(b), b))

    def remove(self, b: _Block) -> None:
        lst, k = (self.free, (*b.key(), id(b), b)) if b.mapped else (self.unmapped, (b.stream, b.addr, id(b), b))
        i = bisect.bisect_left(lst, k[:-1])
        assert lst[i][-1] is b, "allocator model: block not in its pool"
        del lst[i]


def _split(pool: _Pool, block: _Block, n: int) -> None:
    """Keep the first `n` bytes in `block`; the rest becomes a block of its own (mapped as `block` is) in the pool."""
    rest = _Block(block.addr + n, block.size - n, block.small, block.stream, block.page, mapped=block.mapped)
    rest.prev, rest.next = block, block.next
    if block.next is not None:
        block.next.prev = rest
    block.next, block.size = rest, n
    pool.add(rest)


class CachingAllocatorModel:
    """malloc(size, stream) -> handle, free(handle), empty_cache(); allocated/reserved now and at their peaks."""

    def __init__(self, expandable_segments: bool = True, history: list | None = None):
        self.expandable = expandable_segments
        self.history = history  # when a list: ("malloc" or "free", size, allocated, reserved) after each
        self.pools = {True: _Pool(), False: _Pool()}
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0

        self._next_addr = itertools.count(1)
        self._segments: dict[tuple[bool, int], _Block] = {}   # expandable: (small, stream) -> the first block

    # --- requests --------------------------------------------------------------------------------------------------
    def malloc(self, size: int, stream: int = 0) -> _Block:
        rs = round_size(size)
        small = rs <= SMALL_SIZE
        pool = self.pools[small]
        block = self._best_fit(pool, rs, stream)
        if block is None:
            block = self._grow(pool, small, rs, stream)
        remaining = block.size - rs
        if remaining >= MIN_BLOCK if (small or self.expandable) else remaining > SMALL_SIZE:
            _split(pool, block, rs)
        block.allocated = True
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        if self.history is not None:
            self.history.append(("malloc", block.size, self.allocated, self.reserved))
        return block

    def free(self, block: _Block) -> None:
        assert block.allocated, "allocator model: double free"
        size = block.size
        block.allocated = False
        self.allocated -= block.size
        pool = self.pools[block.small]
        for other in (block.prev, block.next):
            self._merge(pool, block, other)
        pool.add(block)
        if self.history is not None:
            self.history.append(("free", size, self.allocated, self.reserved))

    def empty_cache(self) -> None:
        """Return what the cache holds: whole free segments (default) or the whole pages of free blocks (expandable)."""
        for pool in self.pools.values():
            for *_, b in list(pool.free):
                if b.page == 0:
                    if b.prev is None and b.next is None:
                        pool.remove(b)
                        self.reserved -= b.size
                else:
                    self._unmap(pool, b)

    # --- placement -------------------------------------------------------------------------------------------------
    def _best_fit(self, pool: _Pool, size: int, stream: int) -> _Block | None:
        i = bisect.bisect_left(pool.free, (stream, size))
        if i == len(pool.free) or pool.free[i][0] != stream:
            return None
        if pool.free[i][-1].page:  # expandable: keep the block that can grow for when nothing else fits
            def growable(b: _Block) -> int:
                return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)
            while i + 1 < len(pool.free) and pool.free[i + 1][0] == stream \
                    and growable(pool.free[i + 1][-1]) < growable(pool.free[i][-1]):
                i += 1
        block = pool.free.pop(i)[-1]
        return block

    def _grow(self, pool: _Pool, small: bool, size: int, stream: int) -> _Block:
        if not self.expandable:
            n = allocation_size(size)
            block = _Block(next(self._next_addr) * SEGMENT_SPACE, n, small, stream)
            self._reserve(n)
            return block
        block = self._expandable_candidate(pool, small, size, stream)  # stays in its pool while it grows
        if not block.mapped:
            block = self._map(pool, block, min(block.size, size))
        while block.size < size:
            block = self._map(pool, block.next, min(size - block.size, block.next.size))
        pool.remove(block)
        return block

    def _expandable_candidate(self, pool: _Pool, small: bool, size: int, stream: int) -> _Block:
        """The lowest address where free and unmapped space together fit `size` (a new segment if none)."""
        free = lambda b: b is not None and not b.allocated  # noqa: E731
        for *_, c in [u for u in pool.unmapped if u[0] == stream]:
            start = c.prev if free(c.prev) else c
            room, b = 0, start
            while room < size and free(b):
                room, b = room + b.size, b.next
            if room >= size:
                return start
        page = SMALL_BUFFER if small else LARGE_BUFFER
        seg = _Block(next(self._next_addr) * SEGMENT_SPACE, SEGMENT_SPACE, small, stream, page, mapped=False)
        pool.add(seg)
        return seg

    def _map(self, pool: _Pool, block: _Block, size: int) -> _Block:
        """Map whole pages of unmapped `block` from its start to cover `size`; merge with a free mapped neighbour."""
        n = min(block.size, -(-size // block.page) * block.page)
        pool.remove(block)
        if n < block.size:
            _split(pool, block, n)
        block.mapped = True
        self._reserve(n)
        for other in (block.prev, block.next):
            self._merge(pool, block, other)
        pool.add(block)
        return block

    def _unmap(self, pool: _Pool, block: _Block) -> None:
        """Unmap the whole pages inside free `block`; its ends that share a page with a used block stay mapped."""
        base, end = block.addr - block.addr % SEGMENT_SPACE, block.addr + block.size
        lo = base + -(-(block.addr - base) // block.page) * block.page
        hi = base + (end - base) // block.page * block.page
        if hi <= lo:
            return
        pool.remove(block)
        if hi < end:
            _split(pool, block, hi - block.addr)   # the tail stays mapped, free
        if lo > block.addr:
            _split(pool, block, lo - block.addr)   # the head stays mapped, free; the pages between are its next
            pool.add(block)
            block = block.next
            pool.remove(block)
        block.mapped = False
        self.reserved -= block.size
        for other in (block.prev, block.next):
            self._merge(pool, block, other)
        pool.add(block)

    def _merge(self, pool: _Pool, block: _Block, other: _Block | None) -> None:
        """Absorb `other` (a free neighbour with the same mapping) into `block`; `block` is not in the pool."""
        if other is None or other.allocated or other.mapped != block.mapped:
            return
        pool.remove(other)
        if other is block.prev:
            block.addr, block.prev = other.addr, other.prev
            if other.prev is not None:
                other.prev.next = block
        else:
            block.next = other.next
            if other.next is not None:
                other.next.prev = block
        block.size += other.size

    def reset_peaks(self) -> None:
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    def _reserve(self, n: int) -> None:
        self.reserved += n
        self.peak_reserved = max(self.peak_reserved, self.reserved)

"""The allocator model against the CUDA caching allocator's rules, worked by hand (memory/allocator_model.py's
docstring cites them). Sizes are exact: every expectation below is the arithmetic of those rules."""
import random

import pytest

from tightrope.memory.allocator_model import (LARGE_BUFFER, SMALL_BUFFER, CachingAllocatorModel, allocation_size,
                                              round_size)

MiB = 1 << 20


def test_requests_round_to_512_bytes_and_segments_follow_the_size_classes():
    assert [round_size(n) for n in (0, 1, 512, 513)] == [512, 512, 512, 1024]
    assert allocation_size(MiB) == SMALL_BUFFER                  # small pool: 2 MiB segments
    assert allocation_size(MiB + 512) == LARGE_BUFFER            # 1-10 MiB: one 20 MiB segment, split
    assert allocation_size(10 * MiB) == 10 * MiB                 # from 10 MiB: rounded up to 2 MiB
    assert allocation_size(12 * MiB + 1) == 14 * MiB


def test_default_mode_segments_and_splits():
    a = CachingAllocatorModel(expandable_segments=False)
    a.malloc(100)
    assert (a.allocated, a.reserved) == (512, 2 * MiB)
    a.malloc(3 * MiB)                      # a 20 MiB segment, split: 17 MiB stay cached
    assert (a.allocated, a.reserved) == (512 + 3 * MiB, 22 * MiB)
    a.malloc(17 * MiB)                     # fits the cached rest exactly
    assert a.reserved == 22 * MiB
    b = a.malloc(12 * MiB + 1)             # 14 MiB segment; the 2 MiB - 1 KiB rest (> 1 MiB) is split off
    assert b.size == 12 * MiB + 512 and a.reserved == 36 * MiB


def test_a_large_block_is_not_split_for_less_than_a_mebibyte_left_in_default_mode():
    a = CachingAllocatorModel(expandable_segments=False)
    x = a.malloc(20 * MiB)
    a.free(x)
    y = a.malloc(19 * MiB + 512)           # 1 MiB - 512 B left: not split, the whole block counts as allocated
    assert y.size == 20 * MiB and a.allocated == 20 * MiB


def test_a_freed_hole_too_small_for_the_next_request_costs_a_new_segment():
    for expandable, reserved in ((False, 350 * MiB), (True, 360 * MiB)):
        a = CachingAllocatorModel(expandable_segments=expandable)
        x, _ = a.malloc(100 * MiB), a.malloc(100 * MiB)
        a.free(x)
        a.malloc(150 * MiB)                # the 100 MiB hole cannot hold it (expandable: 8 pages of 20 MiB)
        assert (a.allocated, a.reserved, a.peak_reserved) == (250 * MiB, reserved, reserved), expandable


def test_expandable_segments_grow_a_free_end_instead_of_a_new_segment():
    e, d = CachingAllocatorModel(expandable_segments=True), CachingAllocatorModel(expandable_segments=False)
    for a in (e, d):
        a.free(a.malloc(100 * MiB))
        a.malloc(150 * MiB)
    assert e.reserved == 160 * MiB         # the free 100 MiB end plus 3 new pages, 10 MiB left free
    assert d.reserved == 250 * MiB


def test_best_fit_prefers_the_smallest_block_and_keeps_the_growable_end():
    a = CachingAllocatorModel(expandable_segments=True)
    x, _, y, _ = a.malloc(40 * MiB), a.malloc(2 * MiB), a.malloc(60 * MiB), a.malloc(2 * MiB)
    a.free(x)
    a.free(y)
    z = a.malloc(30 * MiB)                 # the 40 MiB hole, not the 60 MiB one
    assert z.addr == x.addr
    # a request the end could take by growing, while an inner block fits: the inner block is used
    b = CachingAllocatorModel(expandable_segments=True)
    p, _ = b.malloc(50 * MiB), b.malloc(2 * MiB)  # 3 pages: 50 + 2 MiB used, 8 MiB free at the end
    b.free(p)
    q = b.malloc(5 * MiB)                  # the 8 MiB end is the smallest that fits, but it can grow: skipped
    assert q.addr == p.addr


def test_streams_and_pools_do_not_share_cached_blocks():
    a = CachingAllocatorModel(expandable_segments=False)
    a.free(a.malloc(40 * MiB, stream=0))
    a.malloc(40 * MiB, stream=1)
    assert a.reserved == 80 * MiB
    b = CachingAllocatorModel(expandable_segments=False)
    b.free(b.malloc(MiB))                  # small pool: a 2 MiB segment, cached
    b.malloc(MiB + 512)                    # large pool: a new 20 MiB segment
    assert b.reserved == 22 * MiB


def test_empty_cache_returns_whole_free_segments_and_whole_free_pages():
    d = CachingAllocatorModel(expandable_segments=False)
    keep = d.malloc(3 * MiB)               # its 20 MiB segment is split: stays
    d.free(d.malloc(40 * MiB))
    d.empty_cache()
    assert d.reserved == 20 * MiB and keep.allocated
    e = CachingAllocatorModel(expandable_segments=True)
    keep = e.malloc(30 * MiB)              # pages 0-1 mapped: `keep`, then 10 MiB free
    e.free(e.malloc(50 * MiB))             # the free 10 MiB + pages 2-3: 30-80 MiB, then freed
    e.empty_cache()
    assert e.reserved == 40 * MiB          # pages 2-3 unmapped; page 1 stays: it holds the end of `keep`
    e.malloc(50 * MiB)                     # the lowest address that fits: the free 10 MiB of page 1 + 2 new pages
    assert e.reserved == 80 * MiB


def test_a_random_sequence_keeps_the_books():
    """Invariants on 3000 random requests and frees in both modes: allocated equals the live blocks' sizes, free and
    live blocks tile each mapped range exactly, nothing overlaps, and an empty cache after freeing everything
    reserves nothing."""
    rng = random.Random(0)
    for expandable in (False, True):
        a = CachingAllocatorModel(expandable_segments=expandable)
        live = []
        for _ in range(3000):
            if live and rng.random() < 0.45:
                a.free(live.pop(rng.randrange(len(live))))
            else:
                live.append(a.malloc(rng.choice([rng.randrange(1, 4096), rng.randrange(1, 3 * MiB),
                                                 rng.randrange(1, 200 * MiB)]), stream=rng.choice([0, 0, 1])))
            assert a.allocated == sum(b.size for b in live)
            assert a.allocated <= a.reserved
        spans = sorted((b.addr, b.addr + b.size) for b in live)
        spans += sorted((t[2], t[2] + t[1]) for pool in a.pools.values() for t in pool.free)
        spans.sort()
        assert all(x[1] <= y[0] for x, y in zip(spans, spans[1:])), "blocks overlap"
        assert sum(e - s for s, e in spans) == a.reserved
        for b in live:
            a.free(b)
        a.empty_cache()
        assert (a.allocated, a.reserved) == (0, 0)


@pytest.mark.parametrize("expandable", [False, True])
def test_freeing_merges_neighbours_back_into_one_block(expandable):
    a = CachingAllocatorModel(expandable_segments=expandable)
    blocks = [a.malloc(4 * MiB) for _ in range(4)]  # one 20 MiB segment (default) / one page (expandable)
    for b in (blocks[1], blocks[3], blocks[0], blocks[2]):
        a.free(b)
    pool = a.pools[False]
    assert len(pool.free) == 1 and pool.free[0][1] == 20 * MiB


def test_empty_cache_keeps_a_free_tail_that_shares_a_page_and_maps_the_hole_again_first():
    a = CachingAllocatorModel(expandable_segments=True)
    first = a.malloc(30 * MiB)             # pages 0-1: 0-30 MiB, 10 MiB free
    a.malloc(30 * MiB)                     # 30-60 MiB: the free 10 MiB + page 2
    a.malloc(5 * MiB)                      # page 3: 60-65 MiB, 65-80 free
    a.free(first)
    a.empty_cache()                        # page 0 unmapped; 20-30 MiB stays (page 1 holds the second tensor too)
    assert a.reserved == 60 * MiB
    a.malloc(15 * MiB)                     # the free 65-80 MiB: no mapping
    assert a.reserved == 60 * MiB
    low = a.malloc(25 * MiB)               # the lowest place: page 0 mapped again, with the free 20-30 MiB after it
    assert a.reserved == 80 * MiB and low.addr == first.addr

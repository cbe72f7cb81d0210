"""Activation offload's host memory (memory/activation_host.py) under the driver's rules (tests/helpers/fake_cudart.py):
one arena page-locked in place, of exactly the bytes a step holds (no power-of-two rounding), reused from the second
step on, never a copy that straddles a registration's edge, given back at undo; refused page-locking is a note."""
import mmap
import threading
import warnings

import pytest
import torch
from equivalence import assert_equivalent
from fake_cudart import FakeCudart, StraddleCheck
from two_stream import make_lora_model, train_steps

from tightrope.memory import host_pinning
from tightrope.memory.activation_host import ALIGN, ActivationHost, aligned
from tightrope.memory.activation_offload import ActivationOffload
from tightrope.memory.runtime import MemoryRuntime
from tightrope.memory.strategy import Strategy

PAGE = mmap.PAGESIZE
ACT_OFFLOAD = Strategy.of(checkpoint="all", activation_offload=True, compute_dtype="fp32")


def _step(host: ActivationHost, sizes, dtype=torch.float32):
    """One step's host copies (tensors of `sizes` elements), alive together as a graph keeps them."""
    return [host.buffer_like(torch.empty(n, dtype=dtype)) for n in sizes]


def test_from_the_second_step_the_copies_live_in_one_registered_arena_of_the_step_s_bytes():
    fake = FakeCudart()
    host = ActivationHost(torch.device("cpu"), cudart=fake)
    sizes = [3000, 70_000, 129, 70_000, 5]  # bytes 4x these: none a multiple of ALIGN, some over a page
    first = _step(host, sizes)
    assert host.pageable_buffers == len(sizes) and not fake.registered  # nothing to reuse yet: exact pageable buffers
    assert not any(b.pinned for b in first) and not host.pinned  # no arena yet: the step's copies block
    expected = sum(aligned(4 * n) for n in sizes)
    assert host.high_water == host.held == expected
    del first
    assert host.held == 0 and host.outgrown()
    host.settle()
    assert len(fake.registered) == 1 and host.arena_bytes == -(-expected // PAGE) * PAGE and host.pinned
    # the arena is the step's bytes, where torch's pinned allocator takes a power of two per buffer
    assert host.arena_bytes < sum(1 << (4 * n - 1).bit_length() for n in sizes)
    (start, nbytes), = fake.registered
    ptrs = []
    for _ in range(3):  # steps 2-4: every copy in the arena, the same places each step, one registration
        bufs = _step(host, sizes)
        assert all(b.pinned and b.parts is None for b in bufs)
        addresses = [b.tensor.data_ptr() for b in bufs]
        assert all(start <= a and a + 4 * n <= start + nbytes for a, n in zip(addresses, sizes))
        assert all(a % ALIGN == 0 for a in addresses)
        ptrs.append(addresses)
        del bufs
        host.settle()
    assert ptrs[0] == ptrs[1] == ptrs[2] and host.pageable_buffers == len(sizes) and len(fake.registered) == 1
    host.release()
    assert not fake.live and host.arena_bytes == 0


def test_a_larger_step_spills_to_pageable_once_and_the_arena_grows_to_it():
    fake = FakeCudart()
    host = ActivationHost(torch.device("cpu"), cudart=fake)
    small, large = [2000] * 3, [2000] * 5
    _step(host, small)
    host.settle()
    arena = host.arena_bytes
    bufs = _step(host, large)  # a larger bucket: the arena holds 3 of them, 2 go pageable
    assert [b.pinned for b in bufs] == [True] * 3 + [False] * 2 and host.pageable_buffers == 3 + 2
    assert not host.outgrown()  # alive: the arena is never replaced under live buffers
    host.settle()
    assert host.arena_bytes == arena and len(fake.registered) == 1
    del bufs
    host.settle()
    assert host.arena_bytes == -(-5 * aligned(8000) // PAGE) * PAGE > arena
    assert fake.unregistered == [fake.registered[0][0]] and len(fake.live) == 1  # the old one given back first
    assert all(b.pinned for b in _step(host, large)) and host.pageable_buffers == 5  # then it fits
    _step(host, small)
    host.settle()
    assert len(fake.registered) == 2  # a smaller step reuses the larger arena: it never shrinks mid-run


def test_micro_batches_reuse_the_arena_from_its_start():
    host = ActivationHost(torch.device("cpu"), cudart=FakeCudart())
    _step(host, [1000, 1000])
    host.settle()
    first = [b.tensor.data_ptr() for b in _step(host, [1000, 1000])]
    second = [b.tensor.data_ptr() for b in _step(host, [1000, 1000])]  # the first micro-batch's graph is gone
    assert first == second


@pytest.fixture
def activation_cudart(monkeypatch):
    """Activation offload on the CPU device page-locking through the modelled CUDA runtime (its arena, its parts)."""
    fake = FakeCudart()
    real_init = ActivationOffload.__init__

    def init(self, device, **kwargs):
        real_init(self, device, **kwargs, cudart=fake)
    monkeypatch.setattr(ActivationOffload, "__init__", init)
    return fake


@pytest.mark.parametrize("registration_bytes", [host_pinning.CHUNK_BYTES, PAGE])
def test_a_run_copies_into_the_arena_wholly_in_or_out_of_each_registration(activation_cudart, monkeypatch,
                                                                            registration_bytes):
    """With one registration per page (as 1 GiB pieces cut a large arena) buffers cross registrations' edges: each is
    copied in parts, never a copy across an edge (the driver's 'invalid argument'), and the run trains as plain
    PyTorch does."""
    monkeypatch.setattr(host_pinning, "CHUNK_BYTES", registration_bytes)
    model = make_lora_model()
    packed = []
    real_pack = ActivationOffload.pack

    def pack(self, t, block):
        out = real_pack(self, t, block)
        if out is not t and out.pending == 1:  # a new host copy (a shared input packed again counts once)
            packed.append((out.host.data_ptr(), out.pinned, out.parts))
        return out
    monkeypatch.setattr(ActivationOffload, "pack", pack)
    with MemoryRuntime(model, ACT_OFFLOAD, "cpu", activation_min_bytes=0) as rt, \
            StraddleCheck(activation_cudart) as check:
        result = train_steps(model, steps=3, runtime=rt)
        arena = rt.acts.host
        per_step = len(packed) // 3
        assert arena.pageable_buffers == per_step  # the first step's only
        assert all(pinned for _, pinned, _ in packed[per_step:])
        assert rt.host_memory_pinned() is False  # a CPU device: no transfer is asynchronous there
        assert rt.acts.pinned
    assert_equivalent(result, steps=3)
    assert check.pinned_copies > 0 and check.blocking_pinned_copies == 0
    if registration_bytes == PAGE:
        assert len(activation_cudart.registered) > 1 and any(parts for _, _, parts in packed)
    else:
        assert len(activation_cudart.registered) == 1 and not any(parts for _, _, parts in packed)
    assert not activation_cudart.live  # the arena was given back at undo


def test_refused_page_locking_is_one_note_and_the_run_trains_the_same(monkeypatch):
    fake = FakeCudart(refuse=2)  # out of memory the driver can page-lock
    real_init = ActivationOffload.__init__
    monkeypatch.setattr(ActivationOffload, "__init__",
                        lambda self, device, **kw: real_init(self, device, **kw, cudart=fake))
    model = make_lora_model()
    with warnings.catch_warnings(record=True) as notes:
        warnings.simplefilter("always")
        with MemoryRuntime(model, ACT_OFFLOAD, "cpu", activation_min_bytes=0) as rt:
            result = train_steps(model, steps=3, runtime=rt)
            assert not rt.acts.pinned
    refusals = [str(w.message) for w in notes if "page-lock" in str(w.message)]
    assert len(refusals) == 1, refusals
    assert refusals[0].startswith("tightrope: could not page-lock ") and \
        "of host memory for offloaded activations in place (out of memory that can be page-locked: out of memory, " \
        "error 2); their copies block the host (slower copies; free host RAM)" in refusals[0]
    assert_equivalent(result, steps=3)


def test_without_page_locking_the_copies_are_plain_host_tensors():
    """pin_memory off (or a CPU device): exact pageable buffers, as before, and no arena."""
    model = make_lora_model()
    with MemoryRuntime(model, ACT_OFFLOAD, "cpu", activation_min_bytes=0) as rt:
        assert rt.acts.host is None and not rt.acts.pinned
        result = train_steps(model, steps=2, runtime=rt)
    assert_equivalent(result)


def test_a_buffer_freed_while_its_arena_holds_the_lock_does_not_deadlock():
    """A garbage collection inside the arena's locked section can free a buffer held in a reference cycle (a caught
    out-of-memory error's traceback): its finalizer takes the same lock again on the same thread."""
    host = ActivationHost(torch.device("cpu"), cudart=FakeCudart())
    done = threading.Event()

    def free_inside_the_lock():
        buf = host.buffer_like(torch.empty(10))
        with host._lock:
            del buf  # its finalizer runs here, on this thread
        done.set()

    worker = threading.Thread(target=free_inside_the_lock, daemon=True)
    worker.start()
    assert done.wait(10), "the finalizer waited for a lock its own thread held"
    assert host.held == 0


def test_an_arena_page_locked_after_a_refusal_copies_asynchronously_again():
    """A refusal (host memory the driver could not lock at that moment) makes that arena's copies block, not the
    next one's."""
    host = ActivationHost(torch.device("cpu"), cudart=FakeCudart(refuse=2, refuse_first=1))
    _step(host, [1000])
    with pytest.warns(RuntimeWarning, match="could not page-lock"):
        host.settle()
    assert not host.pinned and not any(b.pinned for b in _step(host, [1000]))
    _step(host, [1000, 1000])  # a larger step: a new arena, accepted
    host.settle()
    assert host.pinned and all(b.pinned for b in _step(host, [1000, 1000]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locking and copy streams exist only with CUDA")
def test_on_cuda_copies_split_at_page_sized_registrations_train_as_the_cpu(monkeypatch):
    """On a GPU with one registration per page (as 1 GiB pieces cut GBs of activations, a LoRA of over 1 GiB): the
    activation arena's, the host optimizer's and the layer offload's copies cross registrations' edges only in
    parts, and 3 steps of 2 micro-batches (nothing synchronised between them) train as plain PyTorch on the CPU."""
    monkeypatch.setattr(host_pinning, "CHUNK_BYTES", PAGE)
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 both sides: only the summation order differs
    try:
        reference = train_steps(make_lora_model(), steps=3, micro=2)
        model = make_lora_model()
        strategy = Strategy.of(offload_fraction=0.5, checkpoint="all", activation_offload=True, optimizer_offload=True,
                               compute_dtype="fp32")
        with MemoryRuntime(model, strategy, "cuda", poison_slots=True, activation_min_bytes=0) as rt:
            losses, grads = train_steps(model, steps=3, runtime=rt, micro=2)
            assert rt.acts.pinned and len(rt.acts.host._pinned.registered) > 1
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference[0]), rtol=1e-4, atol=1e-5)
    for g, rg in zip(grads, reference[1]):
        for name in rg:
            torch.testing.assert_close(g[name].cpu(), rg[name], rtol=1e-4, atol=1e-5)

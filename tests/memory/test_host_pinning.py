"""Page-locking weights in place (memory/host_pinning.py) under the driver's rules (tests/helpers/fake_cudart.py):
only pages wholly inside one storage are registered, so no other allocation shares one; every copy of the run reads
host memory wholly in or wholly out of a registered range; every range is unregistered at undo, before the copies
back; refusals and failed unregistrations are notes whose CUDA error is cleared, never a crash later."""
import gc
import mmap
import warnings
import weakref

import pytest
import torch
from equivalence import assert_equivalent, run_managed
from fake_cudart import FakeCudart, StraddleCheck

from tightrope.memory import host_pinning
from tightrope.memory.host_pinning import READ_ONLY, PinnedRanges, interior_ranges
from tightrope.memory.layer_offload import LayerOffload
from tightrope.memory.runtime import MemoryRuntime
from tightrope.memory.strategy import Strategy
from two_stream import make_lora_model, train_steps

PAGE = mmap.PAGESIZE
OFFLOAD_ALL = Strategy.of(offload_fraction=1.0, compute_dtype="fp32")


def test_interior_ranges_are_the_whole_pages_inside_each_span():
    page = 4096
    spans = [(page + 10, 100), (3 * page, page), (4 * page + 5, 3 * page), (8 * page - 1, 2 * page + 2)]
    # under a page: nothing; exactly a page: itself; otherwise the pages strictly inside, never a shared page
    assert interior_ranges(spans, page) == [(3 * page, page), (5 * page, 2 * page), (8 * page, 2 * page)]


def test_split_cuts_a_buffer_where_registered_memory_begins_and_ends():
    pins = PinnedRanges(torch.device("cpu"), cudart=FakeCudart())
    pins.registered[:] = [(1000, 500), (2000, 100)]
    assert pins.split(1000, 500) is None and pins.split(0, 900) is None  # wholly in, wholly out
    assert pins.split(900, 700) == [(0, 100), (100, 600), (600, 700)]
    assert pins.split(1200, 1000) == [(0, 300), (300, 800), (800, 900), (900, 1000)]
    pins.registered.clear()  # made up: nothing to unregister when the ranges are collected


def test_split_cuts_once_where_two_registered_ranges_meet():
    """Chunks of one interior are adjacent: the edge between them is one cut, not an empty part (a no-op copy)."""
    pins = PinnedRanges(torch.device("cpu"), cudart=FakeCudart())
    pins.registered[:] = [(0, 100), (100, 100), (300, 100)]
    assert pins.split(50, 100) == [(0, 50), (50, 100)]
    assert pins.split(0, 400) == [(0, 100), (100, 200), (200, 300), (300, 400)]
    pins.registered.clear()


@pytest.fixture
def pinned(monkeypatch):
    """LayerOffload on the CPU device, page-locking through the modelled CUDA runtime (the CUDA path's bookkeeping
    and copies)."""
    fake = FakeCudart()
    real_attach = LayerOffload.attach

    def attach(self):
        self.pin, self._pinned = True, PinnedRanges(self.device, cudart=fake)
        real_attach(self)
    monkeypatch.setattr(LayerOffload, "attach", attach)
    return fake


def test_only_pages_wholly_inside_one_weight_storage_are_registered(pinned):
    model = make_lora_model()
    with MemoryRuntime(model, OFFLOAD_ALL, "cpu") as rt:
        sources = [src for lay in rt.offload.layouts.values() for src in lay.sources]
        spans = host_pinning.storage_spans(sources)
        # the regression: widened to whole pages, a range held other allocations' bytes (`grad.cpu()`'s result on
        # the first H100 run), and copies of those failed
        for a, n in pinned.registered:
            assert a % PAGE == 0 and n % PAGE == 0
            assert any(s <= a and a + n <= s + m for s, m in spans), "a registered page holds foreign bytes"
        # and all of each storage's interior is registered: nothing pinnable is left pageable
        assert sorted(pinned.registered) == interior_ranges(spans)
        assert rt.offload.pinned and sum(n for _, n in pinned.registered) > 0
        assert not pinned.unregistered
    assert sorted(pinned.unregistered) == sorted(a for a, _ in pinned.registered) and not pinned.live


def test_every_copy_reads_memory_wholly_in_or_out_of_a_registered_range(pinned):
    """The run under the driver's rule for copies: a weight whose storage is partly page-locked is copied in parts.
    Unrelated host tensors made during the run (inputs, `grad.cpu()`) are never partly page-locked."""
    model = make_lora_model()
    with MemoryRuntime(model, OFFLOAD_ALL, "cpu", poison_slots=True, activation_min_bytes=0) as rt, \
            StraddleCheck(pinned) as check:
        losses, grads = train_steps(model, steps=2, runtime=rt)
        strays = [torch.randn(n) for n in (3, 100, 1000, 5000)]
        assert not any(pinned.straddles(t.data_ptr(), t.nbytes) for t in strays)
    assert check.pinned_copies > 0 and check.copies > check.pinned_copies  # both kinds of part were copied
    assert_equivalent((losses, grads))


def _misalign(weight):
    """Moves `weight` to a storage one element longer, at an offset where it does not start on a page: its storage
    then holds whole pages that are registered and bytes that are not, wherever the allocator puts it (a weight of
    exactly 3 pages that happened to start on a page was wholly page-locked, and CI failed on that)."""
    buf = torch.empty(weight.numel() + 1, dtype=weight.dtype)
    off = 1 if buf.data_ptr() % PAGE == 0 else 0
    weight.data = buf[off:off + weight.numel()].view_as(weight).copy_(weight)
    assert weight.data_ptr() % PAGE != 0 and weight.nbytes > 2 * PAGE


def test_undo_unregisters_before_copying_device_weights_back(pinned):
    """A weight that lived on the device comes back from its host source, a copy of the whole buffer, so it must
    run after the unregistration (the driver refuses it before). On the CPU every weight lives on the "host", so
    one entry is made to look like a device weight of another dtype."""
    model = make_lora_model()
    weight = model.double_blocks[0].qkv.base_layer.weight  # 3 pages of fp32
    _misalign(weight)
    rt = MemoryRuntime(model, OFFLOAD_ALL, "cpu")
    rt.apply()
    k, (p, _, dev, _) = next((k, e) for k, e in enumerate(rt.offload._restore) if e[0] is weight)
    source = rt.offload.host_source(p)
    assert pinned.straddles(source.data_ptr(), source.nbytes)  # partly page-locked: the case the order matters for
    rt.offload._restore[k] = (p, None, dev, torch.bfloat16)
    with StraddleCheck(pinned):
        rt.undo()
    assert not pinned.live and p.dtype == torch.bfloat16


def test_pinning_refused_falls_back_to_pageable_with_a_note(pinned):
    pinned.refuse = 2  # cudaErrorMemoryAllocation: the host has no more memory the driver can page-lock
    with pytest.warns(RuntimeWarning, match=r"could not page-lock [\d.]+ KiB of host weights in place \(out of memory "
                                            r"that can be page-locked: out of memory, error 2\); streaming them from "
                                            r"pageable memory \(slower copies; free host RAM\)$") as notes:
        result = run_managed(OFFLOAD_ALL)
    assert_equivalent(result)
    assert not pinned.unregistered and not any("ulimit" in str(w.message) for w in notes)


def test_memory_pinned_by_someone_else_is_left_to_them(monkeypatch):
    fake, weight = FakeCudart(), torch.ones(4 * PAGE)
    cleared = []
    monkeypatch.setattr(host_pinning, "_clear_last_error", lambda device, text: cleared.append(text))
    first, second = (PinnedRanges(torch.device("cpu"), cudart=fake) for _ in range(2))
    first.register([weight])
    owned = dict(fake.live)
    second.register([weight])  # already mapped: not a refusal (no note), not ours to unpin, its error cleared
    assert not second.registered and second.refused_bytes == 0
    assert cleared == ["part or all of the requested memory range is already mapped"]
    second.release()
    assert fake.live == owned
    first.release()
    assert not fake.live


@pytest.mark.parametrize("released", [True, False])
def test_registered_memory_is_not_freed_until_it_is_unregistered(released):
    """Freed while registered, memory comes back from malloc to a later buffer that the driver still maps to the old
    pinned pages: the ranges hold their tensors until release(), and ranges dropped unreleased (a run that never got
    to its `finally`) unregister when collected, before letting go of them."""
    fake = FakeCudart()
    pins = PinnedRanges(torch.device("cpu"), cudart=fake)
    t = torch.ones(4 * PAGE)
    pins.register([t])
    ref, start = weakref.ref(t), t.data_ptr()
    del t
    gc.collect()
    assert ref() is not None and fake.live  # registered: still allocated
    alive_at_unregister = []
    real = fake.cudaHostUnregister
    fake.cudaHostUnregister = lambda ptr: alive_at_unregister.append(ref() is not None) or real(ptr)
    if released:
        pins.release()
    else:
        del pins
        gc.collect()
    assert not fake.live and alive_at_unregister == [True]
    assert ref() is None  # and freed after
    assert min(fake.unregistered) >= start


def test_a_refused_unregistration_is_a_note_and_its_error_is_cleared(monkeypatch):
    fake = FakeCudart()
    pins = PinnedRanges(torch.device("cpu"), cudart=fake)
    pins.register([torch.ones(4 * PAGE)])
    cleared = []
    monkeypatch.setattr(host_pinning, "_clear_last_error", lambda device, text: cleared.append(text))
    fake.live.clear()  # as if the driver had lost them: every unregistration is refused
    with pytest.warns(RuntimeWarning, match=r"CUDA refused to unpin 1 host range\(s\) \(\d+ B at 0x[0-9a-f]+: "
                                            r"pointer does not correspond to a registered memory region, error 713"):
        pins.release()
    assert cleared == ["pointer does not correspond to a registered memory region"]
    assert pins.unregister_failures and not pins.registered


def test_pinning_without_a_cuda_runtime_is_a_note_not_a_crash(monkeypatch):
    def no_cuda():
        raise AssertionError("Torch not compiled with CUDA enabled")
    monkeypatch.setattr(torch.cuda, "cudart", no_cuda)
    pins = PinnedRanges(torch.device("cpu"))
    with pytest.warns(RuntimeWarning, match="CUDA runtime unavailable: Torch not compiled with CUDA enabled"):
        pins.register([torch.ones(1024)])
    assert pins.pinned_bytes == 0 and pins.refused_bytes == 4096
    pins.release()


def _read_only(tensors, folder):
    """The tensors' bytes in a file, each at a page boundary, mapped read-only (as ComfyUI's dynamic VRAM maps a
    model file): views of the mapping, the mapping. A write to any of them kills the process (SIGSEGV)."""
    path, offsets, n = folder / "weights.bin", [], 0
    with open(path, "wb") as f:
        for t in tensors:
            offsets.append(n)
            f.seek(n)
            f.write(t.detach().contiguous().numpy().tobytes())
            n = -(-(n + t.nbytes) // PAGE) * PAGE
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        views = [torch.frombuffer(mapping, dtype=t.dtype, count=t.numel(), offset=o).view(t.shape)
                 for t, o in zip(tensors, offsets)]
    return views, mapping


def test_a_read_only_mapping_is_registered_read_only(tmp_path):
    """The default registration is refused for a read-only mapping; the read-only one is all a host-to-device copy
    needs, so the weights are pinned, with no note (the old code left them pageable with a warning)."""
    fake = FakeCudart()
    (view,), mapping = _read_only([torch.ones(4 * PAGE)], tmp_path)
    writable = torch.ones(4 * PAGE)
    pins = PinnedRanges(torch.device("cpu"), cudart=fake)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no note
        pins.register([view, writable])
    assert pins.refused_bytes == 0
    assert sorted(pins.registered) == interior_ranges(host_pinning.storage_spans([view, writable]))
    flags = {fake.flags[a] for a, _ in pins.registered if a >= view.data_ptr() and a < view.data_ptr() + view.nbytes}
    assert flags == {host_pinning.READ_ONLY}
    assert {fake.flags[a] for a, _ in pins.registered} == {0, host_pinning.READ_ONLY}
    pins.release()
    assert not fake.live


def test_offload_streams_from_read_only_weights_without_writing_them(pinned, tmp_path):
    """Offloaded weights that live in a read-only mapping (ComfyUI's dynamic VRAM) stream from it, page-locked
    read-only, through apply, two steps and undo: the same losses and gradients, and they are never written (a write
    would kill the process), nor copied: after undo each weight is its mapping's view again."""
    model = make_lora_model()
    frozen = [p for p in model.parameters() if not p.requires_grad]
    views, mapping = _read_only(frozen, tmp_path)
    for p, v in zip(frozen, views):
        p.data = v
    with MemoryRuntime(model, OFFLOAD_ALL, "cpu", poison_slots=True, activation_min_bytes=0) as rt, \
            StraddleCheck(pinned) as check:
        assert rt.offload.host_copy_bytes() == 0
        losses, grads = train_steps(model, steps=2, runtime=rt)
    assert_equivalent((losses, grads))
    assert check.pinned_copies > 0 and set(pinned.flags.values()) == {host_pinning.READ_ONLY}
    assert [p.data_ptr() for p in frozen] == [v.data_ptr() for v in views] and not pinned.live


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locking needs a CUDA driver")
def test_on_cuda_offload_streams_from_a_read_only_mapping_page_locked(tmp_path, monkeypatch):
    """The real driver (run by `make gpu-check`): weights in a read-only file mapping, as ComfyUI's dynamic VRAM holds
    them, are page-locked read-only and stream to the GPU; the run equals the CPU reference and gives every page
    back. A GPU/driver without read-only registration (801: cudaDevAttrHostRegisterReadOnlySupported = 0, as reported
    for some recent GPUs and drivers) streams them pageable instead, and its note must say that, not another cause."""
    model = make_lora_model()
    frozen = [p for p in model.parameters() if not p.requires_grad]
    views, mapping = _read_only(frozen, tmp_path)
    for p, v in zip(frozen, views):
        p.data = v
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # fp32 against the CPU reference
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    with warnings.catch_warnings(record=True) as notes:
        warnings.simplefilter("always")
        with MemoryRuntime(model, OFFLOAD_ALL, "cuda", poison_slots=True, activation_min_bytes=0) as rt:
            pins = rt.offload._pinned
            losses, grads = train_steps(model, steps=2, runtime=rt)
            assert rt.offload.host_copy_bytes() == 0
    notes = [str(n.message) for n in notes if "page-lock" in str(n.message)]
    if pins.refused_bytes:
        assert pins.pinned_bytes == 0 and len(notes) == 1, notes
        assert "cannot page-lock read-only memory" in notes[0] and "error 801" in notes[0], notes[0]
    else:
        assert pins.pinned_bytes > 0 and not notes, notes
    assert_equivalent((losses, grads), rtol=1e-4, atol=1e-5)  # CUDA against the CPU: bench/cuda_checks.TOLERANCE
    assert not pins.registered and [p.data_ptr() for p in frozen] == [v.data_ptr() for v in views]


def test_a_partly_refused_registration_leaves_the_page_locked_copies_asynchronous(pinned):
    """One range refused (page-lockable memory running out part-way) must not turn every copy blocking: a blocking
    copy waits for the copy stream, which waits for the compute queued before it, so no block would prefetch any
    more."""
    pinned.refuse, pinned.refuse_first = 2, 2  # the first two ranges: out of memory (no read-only retry)
    with pytest.warns(RuntimeWarning, match="could not page-lock"), StraddleCheck(pinned) as check:
        result = run_managed(OFFLOAD_ALL)
    assert_equivalent(result)
    assert check.pinned_copies > 0 and check.blocking_pinned_copies == 0


@pytest.mark.parametrize("fake, read_only, cause, fix", [
    (dict(read_only_supported=False), True, r"this GPU/driver cannot page-lock read-only memory: operation not "
     r"supported, error 801", r"; nothing to fix for a read-only mapping of a model file but to accept that speed; "
     r"under ComfyUI, --disable-dynamic-vram loads models into ordinary memory, which can be page-locked"),
    (dict(refuse=2), False, r"out of memory that can be page-locked: out of memory, error 2", r"; free host RAM"),
    (dict(refuse=1), False, r"refused by the driver: invalid argument, error 1", r""),
    # writable memory the driver pins only in part (1) is retried read-only, which this GPU lacks (801): the cause
    # is the first refusal, not the retry's
    (dict(max_bytes=PAGE, read_only_supported=False), False, r"refused by the driver: invalid argument, error 1", r""),
], ids=["read-only-unsupported", "out-of-memory", "refused", "writable-refused-read-only-unsupported"])
def test_a_refusal_is_noted_by_its_cause_with_the_last_attempts_error(tmp_path, fake, read_only, cause, fix):
    """The note names the error of the attempt made last (for a read-only mapping: the read-only one, 801 where the
    GPU/driver lacks it, not the default one's 1), how much stays pageable, and a fix only where one exists;
    never `ulimit -l`, which does not bound cudaHostRegister (NVIDIA's kernel module charges no RLIMIT_MEMLOCK)."""
    fake = FakeCudart(**fake)
    weight = _read_only([torch.ones(4 * PAGE)], tmp_path)[0][0] if read_only else torch.ones(4 * PAGE)
    pins = PinnedRanges(torch.device("cpu"), cudart=fake)
    (_, nbytes), = interior_ranges(host_pinning.storage_spans([weight]))
    size = f"{nbytes / 2**10:.1f} KiB"
    with pytest.warns(RuntimeWarning, match=rf"^tightrope: could not page-lock {size} of host weights in place \("
                                            rf"{cause}\); streaming them from pageable memory \(slower copies"
                                            rf"{fix}\)$") as notes:
        pins.register([weight])
    text = str(notes[0].message)
    assert len(notes) == 1 and "ulimit" not in text and "\n" not in text
    assert pins.refused_bytes == nbytes and not pins.registered and not fake.live


def test_a_storage_too_large_for_one_registration_is_registered_in_chunks():
    """A driver that pins a 4 GiB range only in part refuses the whole call (invalid argument); in 1 GiB chunks the
    whole storage is page-locked, its copies cut where one chunk ends and the next begins, and every chunk is
    unregistered at release. The mapping is address space only: no page of it is touched."""
    chunk = host_pinning.CHUNK_BYTES
    assert chunk == 2**30 and chunk % PAGE == 0
    try:
        space = mmap.mmap(-1, 4 * chunk, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:
        pytest.skip("no 4 GiB of address space")
    storage = torch.frombuffer(space, dtype=torch.uint8)
    fake = FakeCudart(max_bytes=chunk)
    pins = PinnedRanges(torch.device("cpu"), cudart=fake)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing refused, no note
        pins.register([storage])
    start = storage.data_ptr()
    assert pins.registered == [(start + k * chunk, chunk) for k in range(4)] and pins.refused_bytes == 0
    assert pins.split(start, 4 * chunk) == [(k * chunk, (k + 1) * chunk) for k in range(4)]
    assert pins.split(start + chunk // 2, chunk) == [(0, chunk // 2), (chunk // 2, chunk)]
    pins.release()
    assert not fake.live and fake.unregistered == [a for a, _ in fake.registered]
    del storage
    space.close()


def test_a_refused_chunk_leaves_only_itself_pageable(pinned, monkeypatch):
    """One chunk of a weight's interior refused (pinned only in part by the kernel): the chunks around it stay
    page-locked, the weight's copies are cut at every registered edge (no copy straddles, none is empty), the run
    equals the reference, and release leaves nothing registered."""
    monkeypatch.setattr(host_pinning, "CHUNK_BYTES", PAGE)  # the test model's weights are a few pages each
    model = make_lora_model()
    frozen = [p for p in model.parameters() if not p.requires_grad]
    interiors = interior_ranges(host_pinning.storage_spans(frozen))
    start, nbytes = next(r for r in interiors if r[1] >= 2 * PAGE)
    pinned.refuse_at = {start + PAGE}  # a chunk with a registered one before it
    with pytest.warns(RuntimeWarning, match=rf"could not page-lock {PAGE / 2**10:.1f} KiB of host weights in place "
                                            r"\(refused by the driver: invalid argument, error 1\)"), \
            MemoryRuntime(model, OFFLOAD_ALL, "cpu", poison_slots=True, activation_min_bytes=0) as rt, \
            StraddleCheck(pinned) as check:
        pins = rt.offload._pinned
        assert pins.refused_bytes == PAGE and pins.pinned_bytes == sum(n for _, n in interiors) - PAGE
        assert sorted(pins.registered) == [(a, PAGE) for a, n in interiors for a in range(a, a + n, PAGE)
                                           if a != start + PAGE]
        splits = [(src, parts) for lay in rt.offload.layouts.values() for src, parts in zip(lay.sources, lay.splits)]
        src, parts = next((s, p) for s, p in splits if s.data_ptr() < start + PAGE < s.data_ptr() + s.nbytes)
        offset = start + PAGE - src.data_ptr()
        assert (offset - PAGE, offset) in parts  # the registered chunk before the refused one: a part of its own
        a, b = next((a, b) for a, b in parts if a == offset)  # the refused one: pageable, with what follows it
        assert b >= offset + PAGE and not any(r < src.data_ptr() + b and src.data_ptr() + a < r + n
                                              for r, n in pins.registered)
        assert all(b > a for _, p in splits if p for a, b in p)  # no empty part
        losses, grads = train_steps(model, steps=2, runtime=rt)
    assert_equivalent((losses, grads))
    assert check.pinned_copies > 0 and check.blocking_pinned_copies == 0
    assert not pinned.live and sorted(pinned.unregistered) == sorted(a for a, _ in pinned.registered)


@pytest.mark.parametrize("read_only_supported", [True, False])
def test_a_private_file_mapping_is_only_ever_pinned_read_only(tmp_path, read_only_supported):
    """Weights in a private, writable mapping of a file (safetensors' zero-copy tensors are; torch.load(mmap=True)'s
    too): the driver's pin for writes would break copy-on-write on every page, a silent copy of the weights in host
    RAM. They are pinned read-only, or, where the GPU/driver cannot, left pageable; never pinned for writes."""
    (tmp_path / "w.bin").write_bytes(torch.arange(8 * PAGE // 4, dtype=torch.float32).numpy().tobytes())
    storage = torch.UntypedStorage.from_file(str(tmp_path / "w.bin"), shared=False, nbytes=8 * PAGE)
    weight = torch.empty(0).set_(storage, 0, (8 * PAGE // 4,))
    anonymous = torch.ones(8 * PAGE // 4)
    maps = open("/proc/self/maps").read().splitlines()
    assert any(line.split()[1] == "rw-p" and line.endswith("w.bin") for line in maps)  # the case: private, writable
    fake = FakeCudart(read_only_supported=read_only_supported)
    pins = PinnedRanges(torch.device("cpu"), cudart=fake)
    with warnings.catch_warnings(record=True) as notes:
        warnings.simplefilter("always")
        pins.register([weight, anonymous])
    in_file = [s for s in fake.live if weight.data_ptr() <= s < weight.data_ptr() + weight.nbytes]
    elsewhere = [s for s in fake.live if s not in in_file]
    assert elsewhere and all(fake.flags[s] == 0 for s in elsewhere)  # anonymous memory: pinned for writes
    if read_only_supported:
        assert in_file and all(fake.flags[s] == READ_ONLY for s in in_file) and not notes
    else:
        assert not in_file and pins.refused_bytes > 0
        (note,) = [str(n.message) for n in notes]
        assert "this GPU/driver cannot page-lock read-only memory" in note and "error 801" in note
    pins.release()
    assert not fake.live

"""Host RAM in the plan: what a strategy needs in host memory, the budget it must fit, and what would fit instead.

A run's host memory is the model's own weights (already loaded: offloaded blocks stream from them, see
layer_offload) plus what the strategy adds: a host copy of each offloaded block whose weights cannot stream in place
(a weight_dtype other than the model's, weights on the device, non-contiguous ones), the activations offloaded to
the host, and under optimizer offload the LoRA's host copy, its gradients and the optimizer's state (plan_cost).
The budget is host RAM the run may occupy, the model included; by default what is available now plus the model's
own anonymous bytes, minus a margin. Weights in a mapping of a file on disk (ComfyUI's dynamic VRAM maps the model
file) are not added: the kernel counts their cached pages as available already, and the run page-locks them, so they
come out of what is available. Weights in shared memory (/dev/shm, shared by the ranks of a machine) are added: the
kernel does not count them as available.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import itertools
import math
import os
from dataclasses import dataclass

import torch
from torch import nn

from .blocks import discover_blocks
from .dtypes import TORCH_DTYPES
from .layer_offload import _aligned, streams_in_place
from .plan_cost import Prediction
from .process_maps import mappings
from .strategy import Strategy, StrategyError
from .tensor_kinds import held_dtype

AUTO_HOST_MARGIN_BYTES = 2 << 30  # left free by the default budget: the OS page cache, other programs, the UI


def available_host_bytes() -> int | None:
    """Host memory available now: psutil's where installed (peft and ComfyUI require it; an install made without
    dependencies may lack it), else the OS's own count (/proc/meminfo's MemAvailable, Windows' GlobalMemoryStatusEx);
    None when unknown."""
    try:
        import psutil
        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    if os.path.exists("/proc/meminfo"):
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    return _windows_available_bytes()


class _MemoryStatusEx(ctypes.Structure):  # Windows' MEMORYSTATUSEX
    _fields_ = [("dwLength", ctypes.c_uint32), ("dwMemoryLoad", ctypes.c_uint32),
                *((name, ctypes.c_uint64) for name in ("ullTotalPhys", "ullAvailPhys", "ullTotalPageFile",
                                                       "ullAvailPageFile", "ullTotalVirtual", "ullAvailVirtual",
                                                       "ullAvailExtendedVirtual"))]


def _windows_available_bytes() -> int | None:
    """Windows' available physical memory (what psutil reports there); None elsewhere or if the call fails."""
    windll = getattr(ctypes, "windll", None)
    if windll is None:
        return None
    status = _MemoryStatusEx(dwLength=ctypes.sizeof(_MemoryStatusEx))
    return int(status.ullAvailPhys) if windll.kernel32.GlobalMemoryStatusEx(ctypes.byref(status)) else None


def file_backed_bytes(spans: dict[int, int]) -> int:
    """Bytes of the (address -> nbytes) spans that lie in a mapping of a file on disk in this process
    (/proc/self/maps; 0 where the system has none). Files in memory file systems (tmpfs: /dev/shm, where the ranks
    of a machine share their weights, shared_host) are not page cache: available memory leaves them out already."""
    memory_fs = _memory_file_systems()
    files = [m for m in mappings() or () if m.path.startswith("/") and not m.path.startswith(tuple(memory_fs))]
    return sum(n for a, n in spans.items() if any(m.start <= a and a + n <= m.end for m in files))


def _memory_file_systems() -> list[str]:
    """Mount points of tmpfs file systems, each ending in '/' (from /proc/mounts; /dev/shm/ where unreadable)."""
    try:
        with open("/proc/mounts", encoding="utf-8", errors="surrogateescape") as f:
            points = [fields[1] for fields in (line.split() for line in f) if len(fields) > 2 and fields[2] == "tmpfs"]
    except OSError:
        points = ["/dev/shm"]
    return [p.rstrip("/") + "/" for p in points]


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


@functools.cache
def _glibc_malloc_trim():
    """glibc's malloc_trim, or None (musl, macOS, Windows: their allocators are not glibc's)."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def malloc_in_use_bytes() -> int | None:
    """Bytes glibc's malloc has handed out and not had back (mallinfo2: in use in the heaps + mmapped chunks); None
    without glibc >= 2.33. What a run left allocated in C++ (not trimmable: freeing it is the owner's job)."""
    info = getattr(_libc(), "mallinfo2", None)
    if info is None:
        return None
    info.restype = _Mallinfo2
    m = info()
    return m.uordblks + m.hblkhd


@functools.cache
def _mkl_free_buffers():
    """oneMKL's mkl_free_buffers in the MKL torch runs (linked into libtorch_cpu, exported there as its service
    function mkl_serv_free_buffers; found through libtorch_cpu's dependencies when MKL is a shared library), or None
    (no MKL: Apple, ARM, OpenBLAS builds)."""
    lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        handle = ctypes.CDLL(lib) if os.path.exists(lib) else None
    except OSError:
        return None
    for name in ("mkl_free_buffers", "mkl_serv_free_buffers"):
        fn = getattr(handle, name, None)
        if fn is not None:
            fn.argtypes, fn.restype = [], None
            return fn
    return None


def _empty_pinned_host_cache() -> None:
    """Page-locked blocks freed by the run go back to the OS. PyTorch's caching host allocator (behind
    `pin_memory=True`: the probe's bandwidth measurement; activation offload has its own arena, activation_host.py)
    keeps every freed pinned block cached for the life of the process, each rounded up to a power of two, so a
    ComfyUI server would keep them page-locked after the run. Only when CUDA is initialised: otherwise nothing was
    pinned."""
    if not torch.cuda.is_initialized():
        return
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) \
        or getattr(torch._C, "_host_emptyCache", None)  # older torch: the CUDA binding
    if empty is not None:
        empty()


def release_freed_host_memory() -> bool:
    """Give the host memory a run freed back to the OS; True if glibc returned anything.

    0. Pinned blocks cached by PyTorch's host allocator (`_empty_pinned_host_cache`).

    1. oneMKL's buffers (mkl_free_buffers): MKL's memory manager keeps the packing buffers of every GEMM in
       per-thread pools for reuse, for the life of the process: ~21 MiB after a step of the hidden-1024 benchmark
       model on 2 threads (more threads, more pools), 1.6 % of its 1.3 GB of weights that a ComfyUI server would
       keep after every run. mkl_free_buffers frees the pooled buffers no call is using (Intel's reference: "frees
       unused memory"); the next GEMM allocates them again.
    2. glibc's heap (malloc_trim(0)): a training step frees most of what it allocates (activations, gradients of the
       graph), but glibc keeps freed memory in its heaps: requests below its mmap threshold (raised at run time up
       to 32 MiB once a large block has been freed, so most activations qualify) come from the main heap or a
       per-thread arena (autograd and OpenMP worker threads), and free memory goes back to the OS only when it sits
       at the top of the main heap above the trim threshold. So a long-lived process (a ComfyUI server) would keep
       its peak of freed activations after every run. malloc_trim(0) walks every arena and releases each whole free
       page (madvise(MADV_DONTNEED)): live objects are not moved, nothing is freed twice, it costs a walk of the
       free lists (milliseconds). Not glibc: nothing to do, False."""
    _empty_pinned_host_cache()
    free_buffers = _mkl_free_buffers()
    if free_buffers is not None:
        free_buffers()
    trim = _glibc_malloc_trim()
    return bool(trim(0)) if trim is not None else False


def _gib(n: float, up: bool = False) -> str:
    """GiB to 1/100 (MiB to 1/10 under 128 MiB); `up`: rounded up, for a least amount that must suffice."""
    unit, size, digits = ("GiB", 2**30, 2) if n >= 2**27 else ("MiB", 2**20, 1)
    value = math.ceil(n / size * 10**digits) / 10**digits if up else n / size
    return f"{value:.{digits}f} {unit}"


def _activations(p: Prediction) -> int:
    """Host bytes of p's offloaded activations as their buffers take them (pinned ones rounded up: plan_cost)."""
    return p.breakdown.get("host_activations_pinned", p.breakdown.get("host_activations", 0))


def _optimizer(p: Prediction) -> int:
    """Host bytes of p's optimizer offload: the LoRA's host copy, its gradients, the optimizer state (plan_cost)."""
    return p.breakdown.get("host_optimizer", 0)


@dataclass(frozen=True)
class HostNeeds:
    budget_bytes: int
    model_bytes: int        # the model's weights and buffers in host memory now (each storage once)
    model_8bit_bytes: int   # the same with every floating-point weight stored in 8 bits (e.g. fp8)
    copy_bytes: list[int]   # per block: the host copy the block needs when offloaded (0: streams in place)
    # the same run after each change a refusal may name, (the change, its needs): measured, see `measure`
    changes: tuple[tuple[str, "HostNeeds"], ...] = ()

    @classmethod
    def measure(cls, model: nn.Module, blocks: list[nn.Module], weight_dtype: torch.dtype | None,
                budget_bytes: int | None = None) -> "HostNeeds":
        """`budget_bytes` None: available host memory + the model's own anonymous host bytes (not those in a file
        mapping) - AUTO_HOST_MARGIN_BYTES. The changes measured with it: weight_dtype auto, where the run converts
        weights and the model's own dtype is no larger on the device; 8-bit weights, where the model has larger
        floating-point ones (streamed in place, so with weight_dtype auto)."""
        spans, small = {}, {}
        for t in itertools.chain(model.parameters(), model.buffers()):
            if t.device.type == "cpu":
                s = t.untyped_storage()
                spans[s.data_ptr()] = s.nbytes()
                small[s.data_ptr()] = t.numel() * (1 if t.is_floating_point() else t.element_size())
        frozen = [[p for p in b.parameters() if not p.requires_grad] for b in blocks]
        copies = [sum(_aligned(p.numel() * held_dtype(p, weight_dtype).itemsize) for p in ps
                      if not streams_in_place(p.data, held_dtype(p, weight_dtype))) for ps in frozen]
        model_bytes = sum(spans.values())
        if budget_bytes is None:
            free = available_host_bytes()
            if free is None:
                raise StrategyError("the available host RAM cannot be read on this system: give host_ram_budget_gb, "
                                    "or install psutil (pip install psutil)")
            budget_bytes = free + model_bytes - file_backed_bytes(spans) - AUTO_HOST_MARGIN_BYTES
        budget, model_8bit = int(budget_bytes), sum(small.values())
        copied = [[p for p in ps if not streams_in_place(p.data, p.dtype)] for ps in frozen]  # in any dtype
        changes = []
        auto = [sum(_aligned(p.numel() * p.element_size()) for p in ps) for ps in copied]
        if weight_dtype is not None and auto != copies and all(p.element_size() <= weight_dtype.itemsize
                                                               for ps in frozen for p in ps):
            changes.append(("set weight_dtype auto (offloaded blocks stream from the model's own weights)",
                            cls(budget, model_bytes, model_8bit, auto)))
        if model_8bit < model_bytes:
            auto_8bit = [sum(_aligned(p.numel() * (1 if p.is_floating_point() else p.element_size())) for p in ps)
                         for ps in copied]
            changes.append(("load the model with 8-bit weights (e.g. weight_dtype fp8_e4m3fn in Load Diffusion Model"
                            + (", and weight_dtype auto here)" if weight_dtype is not None else ")"),
                            cls(budget, model_8bit, model_8bit, auto_8bit)))
        return cls(budget, model_bytes, model_8bit, copies, tuple(changes))

    def need(self, p: Prediction) -> int:
        return self.model_bytes + self._copies(p) + _activations(p) + _optimizer(p)

    def _copies(self, p: Prediction) -> int:
        return sum(self.copy_bytes[i] for i in p.offloaded)

    def keep_fitting(self, fitting: list[tuple[Prediction, object]],
                     scored: list[tuple[Prediction, object]] = ()) -> list[tuple[Prediction, object]]:
        """The (prediction, strategy) pairs that also fit host RAM. If none does, a refusal naming only what would
        fit by this model: each of `changes` whose needs fit with one of `fitting`, a larger VRAM budget where one of
        `scored` (every candidate predicted, fitting the VRAM budget or not) fits host RAM, and the least host RAM
        this run needs as it is."""
        kept = [(p, s) for p, s in fitting if self.need(p) <= self.budget_bytes]
        if kept or not fitting:
            return kept
        raise StrategyError(self._refusal([p for p, _ in fitting], [p for p, _ in scored]))

    def _refusal(self, fitting: list[Prediction], scored: list[Prediction]) -> str:
        budget = f"host-RAM budget of {_gib(self.budget_bytes)} (host_ram_budget_gb)"
        least = min(fitting, key=self.need)
        if self.model_bytes > self.budget_bytes:
            head = f"the model's own weights take {_gib(self.model_bytes)} of host memory, more than the {budget}"
        else:
            head = (f"no strategy that fits the VRAM budget fits the {budget}: the one needing the least host memory "
                    f"needs {_gib(self.need(least))} (the model's {_gib(self.model_bytes)} + "
                    f"{_gib(self._copies(least))} of converted weight copies + {_gib(_activations(least))} of "
                    "offloaded activations" + (f" + {_gib(_optimizer(least))} of the LoRA's optimizer state, gradients "
                                               "and weights (optimizer offload)" if _optimizer(least) else "") + ")")
        fixes = []
        for change, needs in self.changes:
            need = min(needs.need(p) for p in fitting)
            if need <= self.budget_bytes:
                fixes.append(f"{change}: {_gib(need)} of host RAM")
        roomier = [p for p in scored if self.need(p) <= self.budget_bytes]
        if roomier:
            p = min(roomier, key=lambda p: p.peak_bytes)
            k = len(p.offloaded)
            what = [f"{k or 'no'} block{'s' * (k > 1)}"] + ["the activations"] * bool(_activations(p)) + \
                ["the optimizer"] * bool(_optimizer(p))
            fixes.append(f"raise the VRAM budget (vram_budget_gb) to {_gib(p.peak_bytes, up=True)} for a plan "
                         f"offloading {', '.join(what[:-1]) + ' and ' + what[-1] if len(what) > 1 else what[0]}"
                         f": {_gib(self.need(p))} of host RAM")
        least_ram = f"raise host_ram_budget_gb to at least {_gib(self.need(least), up=True)}"
        if fixes:
            return f"{head}; what would fit: {'; or '.join(fixes)}; or {least_ram}"
        return f"{head}; nothing the planner can change fits it: {least_ram}, or free host memory"

    def explain(self, p: Prediction) -> str:
        copies = self._copies(p)
        extra = (f"+ {_gib(copies)} of host copies of offloaded weights in another dtype" if copies else
                 "offloaded blocks stream from those weights, no copy")
        opt = f", {_gib(_optimizer(p))} of the LoRA's optimizer state, gradients and weights" if _optimizer(p) else ""
        return (f"Host RAM: {_gib(self.need(p))} of your {_gib(self.budget_bytes)} (the model's "
                f"{_gib(self.model_bytes)}, {extra}, {_gib(_activations(p))} of offloaded activations{opt}).")


def host_needs(model: nn.Module, strategy: Strategy, budget_gb: float = 0.0) -> HostNeeds:
    """HostNeeds of `model` under `strategy`'s weight dtype and block lists; budget_gb 0: the default budget."""
    blocks = [b.module for b in discover_blocks(model, strategy.block_lists)]
    weight_dtype = strategy.precision.weight_dtype
    dtype = None if weight_dtype == "auto" else TORCH_DTYPES[weight_dtype]
    return HostNeeds.measure(model, blocks, dtype, int(budget_gb * 2**30) if budget_gb else None)

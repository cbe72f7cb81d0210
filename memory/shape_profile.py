"""One block's memory and FLOPs from its shapes alone: a forward + backward under torch's FakeTensorMode.

The probe (probe.py) measures a model by running it; a 12 B model at 2048 px cannot run on a small CPU machine,
but its memory is a matter of shapes. `measure_block` runs one block's forward and backward on fake tensors (no
data, no compute) and counts what the probe counts on CUDA:
  - saved: bytes the block saves for backward (saved-tensor hooks; parameters and their casts excluded, storages
    counted once), as `Profile.act_full`;
  - alloc: live bytes after the forward above those before it, minus the output (`Profile.act_full_alloc`);
  - peak: the most bytes alive at once over forward + backward above those alive before it, gradients of the output
    and of the inputs included (`Profile.block_peak_alloc`, which the probe reads from max_memory_allocated);
  - fwd_flops, bwd_flops: FLOPs of the forward and of the backward (torch.utils.flop_counter, attention left out),
    for step times.
Live bytes are tracked per storage (a TorchDispatchMode sees every op's outputs; a finalizer on each storage says
when it dies), so views cost nothing and in-place ops nothing more.

How close this is to what CUDA would measure:
  - Attention: the fake run dispatches scaled_dot_product_attention to the CPU flash kernel, which saves q, k, v,
    the output and a (B, H, L) fp32 logsumexp, and allocates no L x L matrix: as CUDA's flash and cuDNN kernels do
    for bf16 with head dim 128 (cuDNN's softmax statistics have the same size). The math fallback (fp32, or masks)
    would materialise B x H x L^2 scores and is not what a bf16 run on a current GPU takes.
  - Autocast: CPU autocast leaves layer_norm in bf16 where CUDA autocast runs it in fp32 (and so returns fp32);
    `cuda_autocast_policy` makes CPU autocast cast layer_norm to fp32 as CUDA's does, for the run's duration. The
    other ops in the Flux blocks cast alike on both (matmuls in the compute dtype; RMSNorm upcasts by itself).
  - The caching allocator rounds each block up (512 B small, 2 MB large segments) and keeps freed blocks cached,
    so reserved memory exceeds the allocated bytes counted here; kernels' workspaces (cuBLAS ~32 MB, attention
    backward's dq accumulator in fp32 for flash: B x L x H x D x 4 bytes, about 200 MB at 2048 px) are not tensors
    autograd sees. Both are what plan_cost's margin is for; a real probe on CUDA replaces these figures.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode
from torch.utils.weak import WeakIdKeyDictionary

from .probe_tools import output_tensors
from .tensor_kinds import inner_tensors


@dataclass(frozen=True)
class BlockShape:
    saved: int     # bytes saved for backward (activations only)
    alloc: int     # live bytes after the forward, above those before it, less the output
    peak: int      # most bytes alive over forward + backward, above those alive before
    inputs: int    # bytes of the block's tensor inputs
    fwd_flops: float
    bwd_flops: float


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storages alive now (those made under this mode), and the most alive at once."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.live = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.track(t)
        return out

    def track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage in self._seen:
            return
        self._seen[storage] = n = storage.nbytes()
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._freed, n)

    def ignore(self, tensors) -> None:
        """Never count these tensors' storages (parameters: allocated before, and views of them are not new)."""
        for t in tensors:
            self._seen[t.untyped_storage()] = 0

    def _freed(self, n: int) -> None:
        self.live -= n

    def reset_peak(self) -> None:
        self.peak = self.live


def _fp32_layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True):
    def up(t):
        return t.float() if t is not None and t.is_floating_point() else t
    with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)):
        return torch.layer_norm(up(input), normalized_shape, up(weight), up(bias), eps, cudnn_enable)


@contextlib.contextmanager
def cuda_autocast_policy() -> Iterator[None]:
    """CPU autocast casts layer_norm to fp32, as CUDA autocast does; the registration is removed on exit."""
    lib = torch.library.Library("aten", "IMPL")
    try:
        lib.impl("layer_norm", _fp32_layer_norm, "AutocastCPU")
        yield
    finally:
        lib._destroy()


def fake_parameters(module: nn.Module, mode: FakeTensorMode, skip: tuple[nn.Module, ...] = ()) -> None:
    """Give every parameter and buffer of `module` (built on `meta`) a fake CPU tensor of its shape and dtype,
    except inside the modules in `skip`."""
    inside = {id(m) for s in skip for m in s.modules()}
    with mode:
        for m in module.modules():
            if id(m) in inside:
                continue
            for name, p in list(m._parameters.items()):
                if p is not None:
                    m._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype),
                                                       requires_grad=p.requires_grad)
            for name, b in list(m._buffers.items()):
                if b is not None:
                    m._buffers[name] = torch.empty(b.shape, dtype=b.dtype)


def _autocast(compute_dtype: torch.dtype | None):
    if compute_dtype in (None, torch.float32):
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=compute_dtype)


class _SavedCounter:
    """Saved-tensor hooks that count each saved storage once, parameters excluded."""

    def __init__(self, params: list[torch.Tensor]):
        self._storages = [p.untyped_storage() for p in params]  # held, so their ids stay theirs
        self._weights = {id(s) for s in self._storages}
        self._saved = WeakIdKeyDictionary()
        self.total = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        for x in inner_tensors(t):  # a wrapper tensor (a quantized weight) by its inner tensors
            storage = x.untyped_storage()
            if id(storage) not in self._weights and storage not in self._saved:
                self._saved[storage] = True
                self.total += storage.nbytes()
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def saved_bytes_of(run, params: list[torch.Tensor], mode: FakeTensorMode, *,
                   compute_dtype: torch.dtype | None) -> tuple[int, float]:
    """(bytes saved for backward, forward FLOPs) of `run()` on fake tensors, parameters excluded."""
    counter = _SavedCounter(params)
    flops = FlopCounterMode(display=False)
    with mode, flops, cuda_autocast_policy(), counter.hooks(), _autocast(compute_dtype):
        run()
    return counter.total, float(flops_without_attention(flops))


def measure_block(forward, args: tuple, kwargs: dict[str, Any], params: list[torch.Tensor], mode: FakeTensorMode,
                  *, compute_dtype: torch.dtype | None) -> BlockShape:
    """Run `forward(*args, **kwargs)` and its backward on fake tensors (made under `mode`); count as described
    above. `params` are the block's parameters (never counted as saved activations). FLOPs are counted in a run of
    their own: FlopCounterMode's module tracker keeps the tensors a recompute region makes in backward alive (a
    token-chunked block then measured every chunk's recompute at once)."""
    counter = _SavedCounter(params)
    live = LiveBytes()
    live.ignore(params)
    with mode, live, cuda_autocast_policy():
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        for t in inputs:
            live.track(t)
        before = live.live
        live.reset_peak()
        with counter.hooks(), _autocast(compute_dtype):
            out = forward(*args, **kwargs)
        outs = [o for o in output_tensors(out) if o.requires_grad]
        alloc = live.live - before - sum(o.untyped_storage().nbytes() for o in output_tensors(out))
        torch.autograd.backward(outs, [torch.empty_like(o) for o in outs])
        peak = live.peak - before
        del out, outs
    fwd_flops, bwd_flops = _flops(forward, args, kwargs, mode, compute_dtype)
    return BlockShape(saved=counter.total, alloc=max(0, alloc), peak=peak,
                      inputs=sum(t.untyped_storage().nbytes() for t in inputs), fwd_flops=fwd_flops,
                      bwd_flops=bwd_flops)


def _flops(forward, args: tuple, kwargs: dict[str, Any], mode: FakeTensorMode,
           compute_dtype: torch.dtype | None) -> tuple[float, float]:
    """(forward, backward) FLOPs of `forward(*args, **kwargs)` on fake tensors; backward includes recomputes."""
    flops = FlopCounterMode(display=False)
    with mode, flops, cuda_autocast_policy():
        with _autocast(compute_dtype):
            out = forward(*args, **kwargs)
        fwd = flops_without_attention(flops)
        outs = [o for o in output_tensors(out) if o.requires_grad]
        torch.autograd.backward(outs, [torch.empty_like(o) for o in outs])
    return float(fwd), float(flops_without_attention(flops) - fwd)


def flops_without_attention(counter: FlopCounterMode, module: str = "Global") -> int:
    """`counter`'s FLOPs so far in `module` (FlopCounterMode's name; 'Global': all), attention left out. The fake
    runs dispatch attention to the CPU flash kernel, which FlopCounterMode counts from torch 2.15 on and not before:
    left out on every torch, the counts (and the step times made from them) are the same whichever torch measured
    them."""
    return sum(n for op, n in counter.get_flop_counts().get(module, {}).items() if "scaled_dot_product" not in str(op))

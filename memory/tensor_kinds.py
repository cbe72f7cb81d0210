"""Which weights the runtime can alias and stream by their bytes.

Plain tensors, and tensor subclasses that keep their data in their own storage and run through the ordinary
kernels: their class only adds Python attributes saying how a layer reads the bytes (ComfyUI-GGUF's GGMLTensor: a
quantization type and the logical shape; its layer dequantizes in forward). A frozen `nn.Parameter` of such a class
*is* that object (torch keeps custom subclasses as they are), so swapping its `.data` for a slot view keeps the class
and the attributes, and the layer reads the bytes it always read. `size()` is the bytes' shape; `shape` may be
overridden to the logical one, so byte layouts use `size()`.

Wrapper subclasses (their own `__torch_dispatch__`: torchao's quantized tensors, DTensor) hold their data in inner
tensors: no storage of their own to stream, alias or page-lock. They are refused (offload_selection.check_streamable)
or copied whole (training/models/adapter.ordinary_alias). A model adapter may keep such a weight's inner tensors as
plain parameters and build the wrapper in forward (training/models/comfy_quant.py); autograd then saves the wrapper,
which the runtime's saved-tensor hooks take apart (PackedWrapper: each inner tensor packed as any saved tensor).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch


def is_wrapper(t: torch.Tensor) -> bool:
    """A subclass that dispatches in Python (a wrapper around inner tensors)."""
    return type(t) is not torch.Tensor and torch._C._dispatch_keys(t).has(torch._C.DispatchKey.Python)


def keeps_bytes(t: torch.Tensor) -> bool:
    """Whether t's data is its own storage, read by ordinary kernels: a plain tensor or a storage subclass."""
    return not is_wrapper(t)


def plain_view(t: torch.Tensor) -> torch.Tensor:
    """t as a plain tensor over the same bytes (its raw `size()`, no subclass): what copies read and write."""
    return t if type(t) is torch.Tensor else t.as_subclass(torch.Tensor)


def alias_like(t: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """`data` (a plain tensor) in the class of `t`'s data with a copy of `t`'s Python attributes (lists copied, so
    patches added to one are not added to the other): a storage subclass like `t` over other bytes; `data` itself for
    a plain tensor or Parameter."""
    cls = type(t.data)
    if cls is torch.Tensor:
        return data
    out = data.as_subclass(cls)
    out.__dict__.update({k: copy.copy(v) if isinstance(v, (list, dict)) else v
                         for k, v in t.__dict__.items() if k != "_is_param"})
    return out


def inner_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors holding t's data: t itself, or a traceable wrapper's inner tensors (`__tensor_flatten__`)."""
    if not is_wrapper(t) or not hasattr(t, "__tensor_flatten__"):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [x for n in names for x in inner_tensors(getattr(t, n))]


_OWN_DTYPE = "_tightrope_own_dtype"  # on a frozen Parameter: held in its own dtype, whatever weight_dtype says


def keep_own_dtype(p: torch.Tensor) -> torch.Tensor:
    """Mark frozen parameter `p` to be held and streamed in its own dtype under any weight_dtype: a part of a weight
    its layer wraps in forward (fp8 data and its fp32 scale, training/models/comfy_quant.py), which the wrapper reads
    as stored (cast, ComfyUI's dequantization refused the data, and a scale cast to bf16 moved every weight)."""
    setattr(p, _OWN_DTYPE, True)
    return p


def keeps_own_dtype(p: torch.Tensor) -> bool:
    """Whether keep_own_dtype marked `p`."""
    return getattr(p, _OWN_DTYPE, False)


def held_dtype(p: torch.Tensor, weight_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype frozen floating-point parameter `p` is held in: the strategy's weight_dtype (None: auto, its own),
    or its own where keep_own_dtype marked it."""
    return p.dtype if weight_dtype is None or keeps_own_dtype(p) else weight_dtype


@dataclass(frozen=True)
class PackedWrapper:
    """A traceable wrapper tensor saved for backward as its packed inner tensors (see the module docstring)."""
    cls: type
    context: Any
    inner: dict[str, Any]
    size: torch.Size
    stride: tuple[int, ...]

    @staticmethod
    def packs(t: torch.Tensor) -> bool:
        return is_wrapper(t) and hasattr(t, "__tensor_flatten__") and hasattr(type(t), "__tensor_unflatten__")

    @classmethod
    def of(cls, t: torch.Tensor, pack: Callable[[torch.Tensor], Any]) -> "PackedWrapper":
        names, context = t.__tensor_flatten__()
        return cls(type(t), context, {n: pack(getattr(t, n)) for n in names}, t.size(), t.stride())

    def unpack(self, unpack: Callable[[Any], torch.Tensor]) -> torch.Tensor:
        return self.cls.__tensor_unflatten__({n: unpack(v) for n, v in self.inner.items()}, self.context, self.size,
                                             self.stride)

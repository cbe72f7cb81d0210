"""ComfyUI's quantized layers (comfy.ops.mixed_precision_ops: a "scaled fp8" or "fp8 mixed" file) in the training
copy: LoRA targets whose weights the memory runtime handles as plain tensors.

Their weight is a QuantizedTensor, a wrapper tensor class whose data are inner tensors (fp8 `_qdata`, an fp32
scale): no bytes of its own to alias, stream or page-lock (memory/tensor_kinds.py). In the training copy each such
weight is taken apart (the tensor-subclass protocol, `__tensor_flatten__`) into frozen plain parameters on its layer,
`weight_qdata` and `weight_param_scale`, aliasing ComfyUI's bytes (no copy); the layer's forward puts the
QuantizedTensor back together from whatever those parameters hold at that moment (an offloaded block's slot views)
and runs ComfyUI's own forward. So layer offload streams the fp8 bytes (half of bf16's), checkpointing recomputes
through the same forward, and the planner's FakeTensors are plain.

ComfyUI's forward runs in its full-precision mode (the file's `full_precision_matrix_mult`, always the case on a CPU
or a GPU without fp8 matmuls): the weight is dequantized (qdata * scale) to the activations' dtype and multiplied
there, as a bf16 model loaded as fp8 is; autograd saves the QuantizedTensor for the input's gradient, which the
runtime's saved-tensor hooks take apart like any wrapper (memory/tensor_kinds.PackedWrapper). Its fp8-matmul training
path (QuantLinearFunc: the input quantized to fp8 too) is left off: it changes the base output and the input's
gradient the LoRA trains against, and no GPU here has run it under the memory runtime.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from ...memory.tensor_kinds import keep_own_dtype
from .adapter import ordinary_alias

_PARTS = "_tightrope_quantized_weight"  # on a layer: (class, flatten context, inner names, size, stride)


def is_quantized_weight(t) -> bool:
    return type(t).__name__ == "QuantizedTensor" and hasattr(t, "__tensor_flatten__")


def unwrap_quantized_weights(module: nn.Module) -> int:
    """Replace each QuantizedTensor weight in `module` by plain frozen parameters aliasing its inner tensors, and
    make its layer rebuild it in forward (see the module docstring). Returns the number of layers changed."""
    count = 0
    for layer in module.modules():
        weight = layer._parameters.get("weight")
        if not is_quantized_weight(weight):
            continue
        names, context = weight.__tensor_flatten__()
        setattr(layer, _PARTS, (type(weight), context, tuple(names), weight.size(), weight.stride()))
        del layer._parameters["weight"]
        for name in names:
            part = nn.Parameter(ordinary_alias(getattr(weight, name)), requires_grad=False)
            layer.register_parameter(f"weight{name}", keep_own_dtype(part))  # fp8 data, fp32 scale: as stored
        layer._full_precision_mm = True
        layer.forward = functools.partial(_forward, layer, type(layer).forward)
        layer.__class__ = _with_weight_attribute(type(layer))
        count += 1
    return count


def quantized_weight(layer: nn.Module) -> torch.Tensor:
    """The QuantizedTensor of an unwrapped layer, built from the parameters it holds now."""
    cls, context, names, size, stride = getattr(layer, _PARTS)
    return cls.__tensor_unflatten__({n: layer._parameters[f"weight{n}"] for n in names}, context, size, stride)


@functools.cache
def _with_weight_attribute(cls: type) -> type:
    """`cls` whose instances still have a `weight` attribute outside their forward: the QuantizedTensor built from
    the parameters they hold (ComfyUI reads it so: Wan's FFN passes its last Linear to comfy.ops.linear_input_act,
    which reads `.weight` and calls the layer). A fallback lookup (`__getattr__`): in forward, the instance's own
    attribute set there is found first."""
    def __getattr__(self, name):
        if name == "weight" and _PARTS in self.__dict__:
            return quantized_weight(self)
        return cls.__getattr__(self, name)
    return type(cls.__name__, (cls,), {"__getattr__": __getattr__, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})


def _forward(layer: nn.Module, forward, *args, **kwargs):
    layer.__dict__["weight"] = quantized_weight(layer)  # an attribute for this call only (not a parameter)
    try:
        return forward(layer, *args, **kwargs)
    finally:
        del layer.__dict__["weight"]

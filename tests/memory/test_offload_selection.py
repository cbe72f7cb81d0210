"""Frozen weights held in tensor subclasses (memory/tensor_kinds.py): storage subclasses shaped like ComfyUI-GGUF's
GGMLTensor stream as bytes and train as resident; wrapper subclasses are refused before anything is moved
(memory/offload_selection.py: check_streamable). Which blocks are offloaded: tests/memory/test_blocks.py."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_map_only

from tightrope.memory.offload_selection import UnstreamableWeightError
from tightrope.memory.runtime import MemoryRuntime
from tightrope.memory.strategy import Strategy, StrategyError
from tightrope.memory.tensor_kinds import alias_like, is_wrapper, keeps_bytes, plain_view
from tightrope.training.models.adapter import ordinary_alias


class Quantized(torch.Tensor):
    """Shaped like ComfyUI-GGUF's GGMLTensor: raw bytes whose class carries the logical shape its layer dequantizes
    to, `shape` reporting that logical shape (`size()` is the bytes'), `detach` returning itself (so nn.Parameter
    keeps the object and its attributes, as there)."""

    def __new__(cls, data, *, tensor_shape, patches=()):
        return super().__new__(cls, data)

    def __init__(self, data, *, tensor_shape, patches=()):
        super().__init__()
        self.tensor_shape, self.patches = tensor_shape, list(patches)

    def detach(self, *args, **kwargs):
        return self

    @property
    def shape(self):
        return self.tensor_shape if "tensor_shape" in self.__dict__ else self.size()


class Wrapped(torch.Tensor):
    """A wrapper subclass: its data in an inner tensor, dispatching in Python (like torchao's quantized tensors)."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.size(), dtype=inner.dtype, device=inner.device)

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        args, kwargs = tree_map_only(Wrapped, lambda t: t.inner, (args, kwargs or {}))
        out = func(*args, **kwargs)
        return Wrapped(out) if func is torch.ops.aten.detach.default else out


class QuantizedLinear(nn.Linear):
    def forward(self, x):
        w = self.weight  # dequantized to the input's dtype, as ComfyUI-GGUF's layers do
        if isinstance(w, Quantized):  # the bytes are fp32 values, read in the logical shape
            w = plain_view(w).view(torch.float32).reshape(w.tensor_shape)
        return F.linear(x, w.to(x.dtype), self.bias.to(x.dtype))


def model(kind="quantized"):
    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Sequential(QuantizedLinear(8, 8), nn.Linear(8, 8)) for _ in range(3))
    for block in blocks:
        for p in block.parameters():
            p.requires_grad_(False)
        q, w = block[0], block[0].weight.detach()
        data = Quantized(w.reshape(-1).view(torch.uint8).clone(), tensor_shape=w.shape) if kind == "quantized" \
            else Wrapped(w.clone())
        q.weight = nn.Parameter(data, requires_grad=False)
    m = nn.Module()
    m.blocks, m.scale = blocks, nn.Parameter(torch.ones(8))
    return m


def step(m, runtime=None, bf16=False):
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    if runtime is not None:
        runtime.start_step()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):  # as the trainer runs bf16 compute
        for block in m.blocks:
            x = x + block(x)
        loss = (x * m.scale).float().sum()
    loss.backward()
    if runtime is not None:
        runtime.end_step()
    return loss.detach(), m.scale.grad.clone()


def test_the_test_classes_are_the_two_kinds():
    q, w = model().blocks[0][0].weight, model("wrapped").blocks[0][0].weight
    assert type(q) is Quantized and q.shape == (8, 8) and q.size() == (256,) and keeps_bytes(q) and not is_wrapper(q)
    assert type(w) is Wrapped and is_wrapper(w) and not keeps_bytes(w)


@pytest.mark.parametrize("kw", [dict(checkpoint="all"), dict(checkpoint="off"),
                                dict(checkpoint="all", activation_offload=True, offload_fraction=0.5),
                                dict(compute_dtype="bf16", weight_dtype="bf16")])
def test_quantized_weights_stream_as_their_bytes(kw):
    """Offloaded, a GGMLTensor-like weight streams from its own bytes (no host copy), stays the same object with its
    class and attributes, and trains exactly as resident. Before: refused; earlier, a shape error in the first
    forward (the layout read the logical `shape`), and weight_dtype would have converted the raw bytes."""
    kw = {"compute_dtype": "fp32", "offload_fraction": 1.0, **kw}
    resident = model()
    with MemoryRuntime(resident, Strategy.of(**{**kw, "offload_fraction": 0.0}), "cpu") as rt:
        expected = step(resident, rt, bf16=kw["compute_dtype"] == "bf16")
    m = model()
    weights = [b[0].weight for b in m.blocks]
    originals = [w.data_ptr() for w in weights]
    with MemoryRuntime(m, Strategy.of(**kw), "cpu", poison_slots=True) as rt:
        assert rt.offloaded and all(rt.offload.host_source(weights[i]).data_ptr() == originals[i]
                                    for i in rt.offloaded)
        got = step(m, rt, bf16=kw["compute_dtype"] == "bf16")
        assert [b[0].weight for b in m.blocks] == weights
        assert all(type(w) is Quantized and w.tensor_shape == (8, 8) for w in weights)
    assert got[0].item() == expected[0].item() and torch.equal(got[1], expected[1])
    assert [w.data_ptr() for w in weights] == originals  # undo gave each its own bytes back, no copy


def test_wrapper_subclass_weights_in_blocks_to_offload_are_refused_before_anything_moves():
    m = model("wrapped")
    weights = [b[0].weight for b in m.blocks]
    with pytest.raises(UnstreamableWeightError, match=r"3 frozen weight\(s\) of the blocks to offload are Wrapped "
                                                      r"tensors \(e.g. blocks.0.0.weight\), which keep no bytes.*"
                                                      r"offload_fraction 0.*Load Diffusion Model.*GGUF"):
        MemoryRuntime(m, Strategy.of(compute_dtype="fp32", offload_fraction=1.0), "cpu")
    assert [b[0].weight for b in m.blocks] == weights and all(type(w) is Wrapped for w in weights)
    assert issubclass(UnstreamableWeightError, StrategyError)  # a user error: printed without a traceback


def test_wrapper_subclass_weights_in_resident_blocks_are_left_to_their_layers():
    plain = model()
    expected = step(plain)
    m = model("wrapped")
    with MemoryRuntime(m, Strategy.of(compute_dtype="fp32", offload_fraction=0.0, checkpoint="all"), "cpu") as rt:
        got = step(m, rt)
    assert got[0].item() == expected[0].item() and torch.equal(got[1], expected[1])


def test_an_alias_of_a_quantized_weight_keeps_its_class_attributes_and_bytes():
    """The ComfyUI adapter's training copy (training/models/adapter.ordinary_alias) of a GGUF weight: same bytes, same
    class and attributes, an ordinary tensor even if the original is an inference tensor, and its own patch list
    (a LoRA patch added to the copy is not added to the user's model). Before: a clone that returned the same object
    without its attributes, which the layer then read as plain bytes."""
    with torch.inference_mode():
        original = nn.Parameter(Quantized(torch.arange(32, dtype=torch.uint8), tensor_shape=torch.Size([2, 4]),
                                          patches=["p"]), requires_grad=False)
    alias = ordinary_alias(original)
    assert type(alias) is Quantized and isinstance(alias, nn.Parameter) and not alias.requires_grad
    assert alias.tensor_shape == (2, 4) and alias.patches == ["p"] and alias.patches is not original.patches
    assert alias.data_ptr() == original.data_ptr() and alias.size() == (32,) and not alias.is_inference()
    assert type(alias_like(nn.Parameter(torch.ones(2)), torch.zeros(2))) is torch.Tensor  # plain stays plain
    wrapped = ordinary_alias(nn.Parameter(Wrapped(torch.ones(3)), requires_grad=False))
    assert wrapped.tolist() == [1.0, 1.0, 1.0] and not wrapped.requires_grad  # cloned, as before

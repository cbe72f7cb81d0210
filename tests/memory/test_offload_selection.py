"""Blocks whose frozen weights layer offload cannot stream are refused before anything is moved
(memory/offload_selection.py: check_streamable). Which blocks are offloaded: tests/memory/test_blocks.py."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tightrope.memory.offload_selection import UnstreamableWeightError
from tightrope.memory.runtime import MemoryRuntime
from tightrope.memory.strategy import Strategy, StrategyError


class Quantized(torch.Tensor):
    """Shaped like ComfyUI-GGUF's GGMLTensor: raw bytes whose class carries the logical shape its layer dequantizes
    to (`detach` returns itself, so nn.Parameter keeps the attribute, as there)."""

    def __new__(cls, data, *, tensor_shape):
        return super().__new__(cls, data)

    def __init__(self, data, *, tensor_shape):
        super().__init__()
        self.tensor_shape = tensor_shape

    def detach(self, *args, **kwargs):
        return self


class QuantizedLinear(nn.Linear):
    def forward(self, x):
        w = self.weight
        if isinstance(w, Quantized):
            w = w.as_subclass(torch.Tensor).view(torch.float32).reshape(w.tensor_shape)
        return F.linear(x, w, self.bias)


def model():
    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Sequential(QuantizedLinear(8, 8), nn.Linear(8, 8)) for _ in range(3))
    for block in blocks:
        for p in block.parameters():
            p.requires_grad_(False)
        q = block[0]
        q.weight = nn.Parameter(Quantized(q.weight.detach().reshape(-1).view(torch.uint8).clone(),
                                          tensor_shape=q.weight.shape), requires_grad=False)
    m = nn.Module()
    m.blocks, m.scale = blocks, nn.Parameter(torch.ones(8))
    return m


def loss(m):
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    for block in m.blocks:
        x = x + block(x)
    return (x * m.scale).sum()


def test_quantized_weights_in_blocks_to_offload_are_refused_before_anything_moves():
    """Streamed, such a weight's bytes would land in a plain slot view without the class that says how to read them
    (before: a shape error deep in the first forward)."""
    m = model()
    weights = [b[0].weight for b in m.blocks]
    with pytest.raises(UnstreamableWeightError, match=r"3 frozen weight\(s\) of the blocks to offload are Quantized "
                                                      r"tensors \(e.g. blocks.0.0.weight\).*GGUF.*Load Diffusion Model"):
        MemoryRuntime(m, Strategy.of(compute_dtype="fp32", offload_fraction=1.0), "cpu")
    assert [b[0].weight for b in m.blocks] == weights and all(isinstance(w, Quantized) for w in weights)
    assert issubclass(UnstreamableWeightError, StrategyError)  # a user error: printed without a traceback


def test_quantized_weights_in_resident_blocks_are_left_to_their_layers():
    m = model()
    expected = loss(m).item()
    with MemoryRuntime(m, Strategy.of(compute_dtype="fp32", offload_fraction=0.0, checkpoint="all"), "cpu") as rt:
        rt.start_step()
        value = loss(m)
        value.backward()
        rt.end_step()
    assert value.item() == expected and m.scale.grad is not None

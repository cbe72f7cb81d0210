"""A weight held as plain frozen parameters (fp8 bytes and a scale) that its layer wraps in forward into a traceable
wrapper tensor (`__tensor_flatten__`), as training/models/comfy_quant.py does with ComfyUI's QuantizedTensor:
autograd saves the wrapper for backward, and the runtime's saved-tensor hooks take it apart (tensor_kinds.
PackedWrapper), so layer offload streams the plain bytes and every strategy trains as resident, exactly. Before, the
first saved wrapper failed in layer offload's storage check ("invalid python storage")."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_map_only

from tightrope.memory.runtime import MemoryRuntime
from tightrope.memory.strategy import Strategy
from tightrope.memory.tensor_kinds import PackedWrapper, inner_tensors, keep_own_dtype


class Scaled(torch.Tensor):
    """fp8 values times an fp32 scale: a traceable wrapper whose every op runs on the dequantized values."""

    @staticmethod
    def __new__(cls, qdata, scale):
        return torch.Tensor._make_wrapper_subclass(cls, qdata.size(), dtype=torch.float32, device=qdata.device)

    def __init__(self, qdata, scale):
        self.qdata, self.scale = qdata, scale

    def __tensor_flatten__(self):
        return ["qdata", "scale"], None

    @staticmethod
    def __tensor_unflatten__(inner, context, size, stride):
        return Scaled(inner["qdata"], inner["scale"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.t.default:  # a transposed wrapper over a view, as ComfyUI's QuantizedTensor does
            return Scaled(args[0].qdata.t(), args[0].scale)
        args, kwargs = tree_map_only(Scaled, lambda t: t.qdata.float() * t.scale, (args, kwargs or {}))
        return func(*args, **kwargs)


class ScaledLinear(nn.Module):
    def __init__(self, n, g):
        super().__init__()
        w = torch.randn(n, n, generator=g) / n ** 0.5
        scale = w.abs().max() / 448.0
        # marked as comfy_quant.unwrap_quantized_weights marks ComfyUI's: held as stored under any weight_dtype
        self.qdata = keep_own_dtype(nn.Parameter((w / scale).to(torch.float8_e4m3fn), requires_grad=False))
        self.scale = keep_own_dtype(nn.Parameter(scale.reshape(()), requires_grad=False))

    def forward(self, x):
        return F.linear(x, Scaled(self.qdata, self.scale))  # saves the transposed wrapper for the input's gradient


def model():
    """Blocks whose only weights are wrapped in forward: nothing else saved makes backward load them again."""
    g = torch.Generator().manual_seed(0)
    blocks = nn.ModuleList(nn.Sequential(ScaledLinear(8, g), nn.GELU()) for _ in range(4))
    m = nn.Module()
    m.blocks, m.scale = blocks, nn.Parameter(torch.ones(8))
    return m


def step(m, runtime):
    x0 = torch.randn(2, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    runtime.start_step()
    x = x0
    for block in m.blocks:
        x = x + block(x)
    loss = (x * m.scale).sum()
    loss.backward()
    runtime.end_step()
    return loss.detach(), m.scale.grad.clone(), x0.grad  # x0's gradient runs through every block's weight


def test_a_wrapper_is_packed_by_its_inner_tensors():
    q = torch.ones(2, 2).to(torch.float8_e4m3fn)
    w = Scaled(q, torch.tensor(0.5))
    assert inner_tensors(w)[0] is q and inner_tensors(q) == [q] and PackedWrapper.packs(w)
    packed = PackedWrapper.of(w, lambda t: ("ref", t))
    assert packed.inner["qdata"] == ("ref", q)
    rebuilt = packed.unpack(lambda r: r[1])
    assert type(rebuilt) is Scaled and rebuilt.qdata is q and torch.equal(rebuilt + 0, torch.full((2, 2), 0.5))


@pytest.mark.parametrize("kw", [dict(offload_fraction=1.0), dict(offload_fraction=1.0, checkpoint="all"),
                                dict(offload_fraction=0.5, activation_offload=True, checkpoint="every_n"),
                                dict(offload_fraction=0.0, activation_offload=True, checkpoint="all")])
def test_weights_wrapped_in_forward_train_offloaded_as_resident(kw):
    resident = model()
    with MemoryRuntime(resident, Strategy.of(compute_dtype="fp32", offload_fraction=0.0), "cpu") as rt:
        expected = step(resident, rt)
    m = model()
    with MemoryRuntime(m, Strategy.of(compute_dtype="fp32", **kw), "cpu", poison_slots=True) as rt:
        assert bool(rt.offloaded) == (kw["offload_fraction"] > 0)
        if rt.offloaded:
            assert rt.offload.host_copy_bytes() == 0  # the fp8 bytes stream from where they are
        got = step(m, rt)
    assert got[0].item() == expected[0].item() and torch.equal(got[1], expected[1]) and torch.equal(got[2], expected[2])


@pytest.mark.parametrize("weight_dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("offload_fraction", [0.0, 1.0])
def test_weight_dtype_leaves_the_parts_of_a_wrapped_weight_as_stored(weight_dtype, offload_fraction):
    """weight_dtype casts the frozen weights a layer reads as they are; the parts of a weight wrapped in forward are
    read by the wrapper as stored: cast with the rest, ComfyUI's dequantization refused the bf16/fp32 data of a
    'scaled fp8' model at the first step (NoCapableBackendError), and a scale cast to bf16 moves every weight by up
    to 2^-9. They keep their dtype: the run is the weight_dtype auto one, exactly."""
    resident = model()
    with MemoryRuntime(resident, Strategy.of(compute_dtype=weight_dtype, offload_fraction=offload_fraction),
                       "cpu") as rt:
        expected = step(resident, rt)
        sizes = rt.sizes  # what the planner and offload selection count: the bytes as held
    m = model()
    with MemoryRuntime(m, Strategy.of(compute_dtype=weight_dtype, weight_dtype=weight_dtype,
                                      offload_fraction=offload_fraction), "cpu", poison_slots=True) as rt:
        layer = m.blocks[0][0]
        assert rt.sizes == sizes
        if not rt.offloaded:
            assert (layer.qdata.dtype, layer.scale.dtype) == (torch.float8_e4m3fn, torch.float32)
        else:
            assert rt.offload.host_copy_bytes() == 0  # streamed from the model's own bytes, as with auto
        got = step(m, rt)
    assert got[0].item() == expected[0].item() and torch.equal(got[1], expected[1]) and torch.equal(got[2], expected[2])

"""linear_columns (training/lora/linear_columns.py): some output columns of a Linear layer from those weight rows
only, equal to the whole layer's output sliced, values and gradients; every layer it cannot compute by rows takes
the whole-layer path."""
import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from tightrope.memory.layer_offload import LayerOffload, WeightRef
from tightrope.training.lora import linear_columns as lc
from tightrope.training.lora.layers import LoraSpec, inject_lora, lora_parameters

IN, OUT = 24, 56  # a linear1 of hidden 8: 3 x 8 qkv columns, then 4 x 8 MLP columns
COLS = (slice(0, 24), slice(24, 56), slice(5, 31))  # the qkv part, the MLP part, one across both


def holder(**spec):
    """A module holding one Linear `lin` (random weights), with a LoRA `spec` on it when given (B random too, so
    every factor matters)."""
    torch.manual_seed(0)
    m = nn.Module()
    m.lin = nn.Linear(IN, OUT)
    if spec:
        torch.manual_seed(1)
        inject_lora(m, LoraSpec(target_regex="lin", **spec), "flux")
        with torch.no_grad():
            for p in lora_parameters(m).values():
                p.normal_(0, 0.3)
    return m


def run(layer, cols, columns, seed=5):
    """Output columns and the gradients of x and of every trainable parameter, dropout drawn from `seed`."""
    x = torch.randn(2, 7, IN, generator=torch.Generator().manual_seed(3), requires_grad=True)
    torch.manual_seed(seed)
    out = columns(layer, x, cols)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    params = [p for p in layer.parameters() if p.requires_grad]
    return out, torch.autograd.grad((out * w).sum(), [x, *params])


def count_fallbacks(monkeypatch):
    calls = []
    real = lc.full_columns
    monkeypatch.setattr(lc, "full_columns", lambda *a: calls.append(1) or real(*a))
    return calls


CASES = {"plain Linear": {}, "LoRA": {"rank": 4, "alpha": 8.0},
         "LoRA, rsLoRA, dropout 0.3": {"rank": 4, "alpha": 8.0, "rslora": True, "dropout": 0.3}}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("cols", COLS, ids=str)
def test_columns_by_rows_equal_the_whole_layer_sliced(case, cols, monkeypatch):
    m = holder(**CASES[case])
    if not CASES[case]:
        m.lin.requires_grad_(True)  # the plain Linear: its weight and bias gradients too
    m.train()
    fallbacks = count_fallbacks(monkeypatch)
    ref_out, ref_grads = run(m.lin, cols, lc.full_columns)
    fallbacks.clear()
    out, grads = run(m.lin, cols, lc.linear_columns)
    assert fallbacks == []  # computed by rows
    # fp32: the same products over the same 24 inputs per output; only the BLAS may block a product of another
    # width differently (measured: at most 1.3e-7 of the largest entry, one ulp; the LoRA cases bit-equal). 1e-6 of
    # the largest entry is ~8 ulp, while a wrong row, scale or dropout mask is O(1).
    assert len(grads) == 3  # x, and (weight, bias) or (lora_A, lora_B)
    for a, b in zip((out, *grads), (ref_out, *ref_grads)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * b.abs().max().item())
    if CASES[case].get("dropout"):  # the same RNG state draws the same mask: another seed gives other values
        other, _ = run(m.lin, cols, lc.linear_columns, seed=6)
        assert not torch.allclose(other, ref_out)


def _merged(m):
    m.lin.merge()


def _disabled(m):
    m.lin.enable_adapters(False)


def _hooked(m):
    m.lin.base_layer.register_forward_hook(lambda mod, a, out: out * 2)


def _own_forward(m):
    m.lin.forward = lambda x: nn.Linear.forward(m.lin, x) + 1


class _Marked(torch.Tensor):
    """A tensor subclass, as quantized weights are."""


def _subclass_weight(m):
    m.lin.weight = nn.Parameter(m.lin.weight.detach().as_subclass(_Marked), requires_grad=False)


class _OtherLinear(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 0.5


def _other_linear(m):
    other = _OtherLinear(IN, OUT)
    other.load_state_dict(m.lin.state_dict())
    m.lin = other


FALLBACKS = {  # (LoRA spec, then a change to the holder)
    "DoRA": ({"rank": 4, "algorithm": "dora"}, None), "LoHa": ({"rank": 4, "algorithm": "loha"}, None),
    "LoKr": ({"rank": 4, "algorithm": "lokr"}, None), "merged LoRA": ({"rank": 4}, _merged),
    "disabled LoRA": ({"rank": 4}, _disabled), "hooked base layer": ({"rank": 4}, _hooked),
    "forward set on the instance": ({}, _own_forward), "tensor-subclass weight": ({}, _subclass_weight),
    "a Linear subclass with its own forward": ({}, _other_linear),
}


@pytest.mark.parametrize("case", FALLBACKS)
def test_anything_else_runs_the_whole_layer(case, monkeypatch):
    spec, change = FALLBACKS[case]
    m = holder(**spec)
    if change:
        change(m)
    fallbacks = count_fallbacks(monkeypatch)
    cols = COLS[2]
    x = torch.randn(2, 7, IN, generator=torch.Generator().manual_seed(3))
    out = lc.linear_columns(m.lin, x, cols)
    assert fallbacks == [1]
    assert torch.equal(out, m.lin(x)[..., cols])  # the whole-layer path itself: bit for bit


def test_fake_weights_are_computed_by_rows(monkeypatch):
    """The planner's probe runs the blocks on FakeTensors (bench/headline_plan.py): they take the rows path, so its
    FLOP counts are those of training."""
    fallbacks = count_fallbacks(monkeypatch)
    with FakeTensorMode():
        lin, x = nn.Linear(IN, OUT), torch.empty(3, IN)
        out = lc.linear_columns(lin, x, COLS[1])
    assert fallbacks == [] and out.shape == (3, 32)


def test_a_saved_row_slice_of_an_offloaded_weight_unpacks_to_its_rows(monkeypatch):
    """Under layer offload a frozen weight is a view into its block's slot; its row slice, which autograd saves for
    the input's gradient, is packed by (block, offset) like the whole weight and unpacked wherever the block is then.
    One cell, poisoned slots: block 0 is evicted (its bytes NaN, then block 1's) before backward reloads it."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(IN, OUT)).requires_grad_(False) for _ in range(2)]
    weights = [b[0].weight.detach().clone() for b in blocks]
    lo = LayerOffload(blocks, [0, 1], torch.device("cpu"), prefetch_depth=0, pin_memory=False, weight_dtype=None,
                      poison_slots=True)
    lo.attach()
    refs = []
    try:
        lo.load(0)
        x = torch.randn(5, IN, requires_grad=True)
        cols = COLS[1]

        def pack(t):
            if lo.owns(t):
                refs.append(lo.pack(t))
                return refs[-1]
            return t

        def unpack(r):
            return lo.unpack(r) if isinstance(r, WeightRef) else r

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            out = lc.linear_columns(blocks[0][0], x, cols)
        lo.load(1)  # block 0 leaves the only cell
        assert torch.isnan(blocks[0][0].weight).all()
        out.sum().backward()
    finally:
        lo.detach()
    assert [(r.block, r.offset, tuple(r.shape)) for r in refs] == [(0, cols.start * IN, (IN, OUT - cols.start))]
    # x.grad = ones @ W[cols]: sums of 32 fp32 terms of order 0.2, maybe in another order (1e-5 is ~100 ulp of
    # them); NaN, the other block's rows or rows at another offset are off by O(0.1) or more
    torch.testing.assert_close(x.grad, weights[0][cols].sum(0).expand(5, IN), rtol=0, atol=1e-5)

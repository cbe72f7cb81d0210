"""The layer offload's slot area with blocks of two sizes (as Flux's double and single blocks): small blocks share
cells, so they stream deeper in the memory two large blocks take; weights stay exact, no view goes stale, and the
planner's memory and transfer model match the area the runtime allocates."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tightrope.memory import layer_offload
from tightrope.memory.layer_offload import LayerOffload, prefetch_window
from tightrope.memory.memory_model import predict_slot_bytes
from tightrope.memory.plan_cost import loaded_at_turnaround
from tightrope.memory.runtime import MemoryRuntime
from tightrope.memory.strategy import Strategy

D = 16
FP32 = {"compute_dtype": "fp32"}


class Big(nn.Module):  # frozen 2 x (D x 2D) + biases: 4608 bytes packed
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.gain = nn.Parameter(torch.ones(D))

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x * self.gain)))


class Small(nn.Module):  # frozen D x D + bias: 1280 bytes packed, 3 to a cell
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.gain = nn.Parameter(torch.ones(D))

    def forward(self, x):
        return x + torch.tanh(self.lin(x * self.gain))


class Mixed(nn.Module):
    """Two large blocks then six small ones (Flux's order), then one more large one (a large block after small ones,
    in both directions)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Big(), Big()] + [Small() for _ in range(6)] + [Big()])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _model(seed=0):
    torch.manual_seed(seed)
    model = Mixed()
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith("gain"))
        if name.endswith("gain"):
            nn.init.normal_(p, 1.0, 0.1)
    return model


def _train(model, runtime=None, steps=2):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    grads = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, target = torch.randn(4, 5, D, generator=g), torch.randn(4, 5, D, generator=g)
        if runtime:
            runtime.start_step()
        F.mse_loss(model(x), target).backward()
        if runtime:
            runtime.end_step()
        grads.append([p.grad.clone() for p in model.parameters() if p.requires_grad])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return grads


def _offload(model, depth):
    blocks = list(model.blocks)
    lo = LayerOffload(blocks, list(range(len(blocks))), torch.device("cpu"), prefetch_depth=depth, pin_memory=False,
                      weight_dtype=None, poison_slots=True)
    return blocks, lo


def _check_layout(lo, originals):
    """Every loaded block lies inside one cell, no two overlap, and each param reads its own weights exactly."""
    spans = sorted((s, s + lo.layouts[b].nbytes, b) for b, s in lo.resident.items())
    for (_, end, _), (start, _, _) in zip(spans, spans[1:]):
        assert end <= start
    for start, end, b in spans:
        assert start // lo.cell_bytes == (end - 1) // lo.cell_bytes
        for p, *_ in lo.layouts[b].params:
            assert p.data.untyped_storage().data_ptr() == lo.area.untyped_storage().data_ptr()
            assert torch.equal(p.data, originals[id(p)])


@pytest.mark.parametrize("depth", [0, 1])
def test_small_blocks_share_cells_and_stream_deeper(depth, monkeypatch):
    model = _model()
    originals = {id(p): p.detach().clone() for p in model.parameters()}
    blocks, lo = _offload(model, depth)
    lo.attach()
    try:
        big, small = lo.layouts[0].nbytes, lo.layouts[2].nbytes
        assert (big, small) == (4608, 1280) and lo.cell_bytes == big
        assert lo.slot_bytes() == (depth + 1) * big  # the area is what two large blocks took before: no more
        per_cell = big // small
        assert lo.slot_positions(small) == [c * big + k * small for c in range(depth + 1) for k in range(per_cell)]
        resident_after = {}
        for backward in (False, True):
            monkeypatch.setattr(layer_offload, "in_backward", lambda: backward)
            for i in (reversed(range(len(blocks))) if backward else range(len(blocks))):
                lo.load(i)
                _check_layout(lo, originals)
                resident_after[(backward, i)] = set(lo.resident)
        # while small blocks stream, the cells hold per_cell of them each: the current block and the window
        assert resident_after[(False, 2)] == set(range(2, 2 + (depth + 1) * per_cell))
        assert lo.counters.peak_resident == (depth + 1) * per_cell
        # a large block still comes in `depth` ahead of need, in both directions
        if depth:
            assert 8 in resident_after[(False, 7)] and 1 in resident_after[(True, 2)]
        assert lo.counters.stale_views == 0
    finally:
        lo.detach()
    for p in model.parameters():
        assert torch.equal(p.detach(), originals[id(p)])


def test_prefetch_window():
    # blocks all one size: exactly `depth`, as before sub-slots existed
    assert [prefetch_window([100] * 9, 100, 100, d + 1, d) for d in (0, 1, 2)] == [0, 1, 2]
    # a resident current block leaves every cell to the window
    assert prefetch_window([100] * 9, None, 100, 2, 1) == 2
    # small blocks (40 bytes: 2 to a 100-byte cell) go deeper; a large one after them waits for room, but `depth`
    # blocks ahead always come
    assert prefetch_window([40] * 9, 40, 100, 2, 1) == 3
    assert prefetch_window([40, 40, 100], 40, 100, 2, 1) == 2
    assert prefetch_window([100, 40], 40, 100, 1, 0) == 0
    assert prefetch_window([40, 40], 40, 100, 1, 0) == 1  # depth 0: one cell still holds two small blocks


def test_prefetch_window_counts_shares_exactly():
    """The window is computed on integers (the planner calls it millions of times); it must agree with the rule
    written in fractions for every mix of sizes, the exact ties (shares summing to a whole number of cells) included,
    where a float sum lands on either side: 4 x 1/2 + 3 x 1/3 adds up to 3.0000000000000004 in floats."""
    import random
    from fractions import Fraction

    def by_fractions(ahead, current, cell, n_cells, depth):
        used = Fraction(1, cell // current) if current else Fraction(0)
        n = 0
        for nbytes in ahead:
            used += Fraction(1, cell // nbytes) if nbytes else 0
            if n >= depth and used > n_cells:
                break
            n += 1
        return n

    cell = 3 * 5 * 7 * 8
    tie = ([cell // 2] * 3 + [cell // 3] * 3 + [cell], cell // 2, cell, 3, 0)
    assert prefetch_window(*tie) == by_fractions(*tie) == 6  # exactly 3 cells used by the first 6 blocks
    rng = random.Random(0)
    sizes = [cell, cell // 2, cell // 3, cell // 5, cell // 6, cell // 7, cell // 8, cell // 10, cell // 3 + 1, 0]
    for _ in range(3000):
        ahead = [rng.choice(sizes) for _ in range(rng.randint(0, 12))]
        args = (ahead, rng.choice(sizes[:-1] + [None]), cell, rng.randint(1, 3), rng.randint(0, 2))
        assert prefetch_window(*args) == by_fractions(*args), args


@pytest.mark.parametrize("kw", [{"checkpoint": "off", "prefetch_depth": 0}, {"checkpoint": "off"},
                                {"checkpoint": "all", "activation_offload": True},
                                {"checkpoint": "every_n", "prefetch_depth": 2}])
def test_training_is_exact_with_poisoned_sub_slots(kw):
    """Bit-for-bit the same gradients as plain PyTorch. Without checkpointing, weights are saved as references to
    their block and offset within its slot and rebuilt on reload: small blocks land at other sub-slots when they
    come back in backward, so a wrong offset would read another block (poisoned with NaN between owners)."""
    reference = _train(_model())
    model = _model()
    with MemoryRuntime(model, Strategy.of(offload_fraction=1.0, **FP32, **kw), "cpu", poison_slots=True,
                       activation_min_bytes=0) as rt:
        grads = _train(model, rt)
        counters = rt.offload.counters
        assert rt.device_weight_bytes() == rt.predicted_weight_bytes()
        assert rt.offload.slot_bytes() == predict_slot_bytes(rt.sizes, rt.offloaded, rt.strategy.offload.prefetch_depth)
    for g, r in zip(grads, reference):
        for a, b in zip(g, r):
            assert torch.equal(a, b)
    assert counters.stale_views == 0 and counters.live_views == 0
    assert counters.peak_resident > rt.strategy.offload.prefetch_depth + 1  # small blocks shared a cell


def test_a_wrong_slot_offset_is_caught(monkeypatch):
    """Negative control: unpacking a saved weight at its slot-relative offset from the area's start (forgetting where
    the block sits now) reads another block and the gradients differ."""
    monkeypatch.setattr(LayerOffload, "unpack", lambda self, ref: (self.load(ref.block), self.area.view(
        ref.dtype).as_strided(ref.shape, ref.stride, ref.offset))[1])
    reference = _train(_model(), steps=1)
    model = _model()
    with MemoryRuntime(model, Strategy.of(offload_fraction=1.0, **FP32), "cpu", poison_slots=True) as rt:
        grads = _train(model, rt, steps=1)
    assert not all(torch.equal(a, b) for a, b in zip(grads[0], reference[0]))


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_the_cost_model_knows_what_stays_loaded(depth, monkeypatch):
    """plan_cost's transfer model skips, in backward, the blocks still loaded when the forward ends: the same set
    the runtime holds then (with sub-slots, more than depth + 1 blocks)."""
    model = _model()
    blocks, lo = _offload(model, depth)
    lo.attach()
    try:
        monkeypatch.setattr(layer_offload, "in_backward", lambda: False)
        for i in range(len(blocks)):
            lo.load(i)
        packed = [lo.layouts[i].nbytes for i in range(len(blocks))]
        assert loaded_at_turnaround(packed, list(range(len(blocks))), depth) == set(lo.resident)
    finally:
        lo.detach()

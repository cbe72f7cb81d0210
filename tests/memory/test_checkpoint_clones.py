"""Eager checkpointing copies only the inputs a block changes in place, learnt from its first call.

Copies are counted with a dispatch mode: every aten.clone / aten.copy_ whose source is one of the watched tensors
(the block's inputs, matched by storage: the recompute starts from the storages the checkpoint saved).
Gradients are compared with a plain (not checkpointed) call bit for bit: a copy changes no value.
"""
import pytest
import torch
import torch.nn.functional as F
from equivalence import assert_equivalent, run_managed
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from two_stream import make_batch, make_lora_model

from tightrope.memory.checkpointing import InPlaceInputs, checkpointed_call
from tightrope.memory.runtime import MemoryRuntime
from tightrope.memory.strategy import Strategy

aten = torch.ops.aten
D = 16


class Copies(TorchDispatchMode):
    """Counts the copies made of each watched tensor, by name. `watched`: (name, tensor) pairs, a list the caller may
    extend while the mode is on; `names`: those counted (default: the names watched at the start)."""

    def __init__(self, watched: list[tuple[str, torch.Tensor]], names: tuple[str, ...] = ()):
        super().__init__()
        self.watched = watched
        self.counts = dict.fromkeys(names or [n for n, _ in watched], 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        source = {aten.clone.default: 0, aten.copy_.default: 1}.get(func)
        if source is not None:
            ptr = args[source].untyped_storage().data_ptr()
            name = next((n for n, t in self.watched if t.untyped_storage().data_ptr() == ptr), None)
            if name is not None:
                self.counts[name] += 1
        return func(*args, **(kwargs or {}))


class Pure(nn.Module):
    """Changes none of its inputs (the reference Flux, Wan, SD3.5, Lumina, Qwen blocks: `x = x + ...`)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x, *, pe):
        return x + self.lin(F.layer_norm(x, x.shape[-1:])) * pe


class AddsInPlace(nn.Module):
    """Adds a residual in place to its first input, as ComfyUI's Flux blocks do; the norm normalises a copy, as the
    ComfyUI adapter makes it (training/models/comfy.py), so autograd allows the add."""

    def __init__(self):
        super().__init__()
        self.lin, self.out = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x, y):
        h = F.layer_norm(x.clone(), x.shape[-1:])
        x += self.lin(y)
        return x + self.out(h)


class SometimesInPlace(nn.Module):
    """Changes the input named by `change` once that is set: a block that changes its inputs only on some calls."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.change = None

    def forward(self, x, y, *, scale):
        if self.change == "y":
            y += 1
        elif self.change == "scale":
            scale.mul_(2)
        return self.lin(x + y) * scale


def _inputs(n=2):
    torch.manual_seed(1)
    return [torch.randn(2, 7, D, requires_grad=True) for _ in range(n)]


def _grads(block, tensors):
    return [t.grad for t in tensors] + [p.grad for p in block.parameters()]


def _reset(block, tensors):
    for t in (*tensors, *block.parameters()):
        t.grad = None


def test_a_block_that_changes_no_input_gets_no_copies_after_its_first_call():
    torch.manual_seed(0)
    block, pe = Pure(), torch.rand(7, D)
    (x,) = _inputs(1)
    block(x, pe=pe).square().sum().backward()
    reference = [g.clone() for g in _grads(block, [x])]
    _reset(block, [x])

    learnt = InPlaceInputs()
    checkpointed_call(block, (x,), {"pe": pe}, clone_inputs=learnt).square().sum().backward()  # the first call
    _reset(block, [x])
    with Copies([("x", x), ("pe", pe)]) as copies:
        checkpointed_call(block, (x,), {"pe": pe}, clone_inputs=learnt).square().sum().backward()
    assert copies.counts == {"x": 0, "pe": 0}
    assert all(torch.equal(g, r) for g, r in zip(_grads(block, [x]), reference, strict=True))


def test_only_the_input_changed_in_place_is_copied_even_in_the_first_calls_recompute():
    torch.manual_seed(0)
    block = AddsInPlace()
    leaves = _inputs(2)
    plain_x, plain_y = (t * 1 for t in leaves)  # not leaves: the block may add to them in place
    plain_out = block(plain_x, plain_y)
    plain_out.square().sum().backward()
    reference = [g.clone() for g in _grads(block, leaves)]

    learnt = InPlaceInputs()
    for calls in (2, 1):  # two calls before one backward (the first one's learning), then one call
        _reset(block, leaves)
        x, y = (t * 1 for t in leaves)
        given = x.detach().clone(), y.detach().clone()
        with Copies([("x", x), ("y", y)]) as copies:
            outs = [checkpointed_call(block, (x, y), {}, clone_inputs=learnt) for _ in range(calls)]
            assert torch.equal(x, given[0]) and torch.equal(y, given[1])  # the caller's tensors, after forward
            sum(o.square().sum() for o in outs).backward()
        assert torch.equal(x, given[0]) and torch.equal(y, given[1])  # and after backward
        assert all(torch.equal(o, plain_out) for o in outs)
        # the first call's forward copies both inputs; its recompute (in backward, where the block's peak is) and
        # every later run only x, which it was seen to change
        assert copies.counts == ({"x": 4, "y": 1} if calls == 2 else {"x": 2, "y": 0})
        assert all(torch.equal(g, r * calls) for g, r in zip(_grads(block, leaves), reference, strict=True))


@pytest.mark.parametrize("change, named", [("y", "its argument 1"), ("scale", "its keyword argument 'scale'")])
def test_a_block_that_changes_an_input_only_on_some_calls_is_an_error(change, named):
    torch.manual_seed(0)
    block, learnt = SometimesInPlace(), InPlaceInputs()
    leaves, scale = _inputs(2), torch.rand(D)
    checkpointed_call(block, tuple(t * 1 for t in leaves), {"scale": scale}, clone_inputs=learnt).sum().backward()
    block.change = change
    with pytest.raises(RuntimeError, match=f"changed {named} in place.*only on some calls"):
        checkpointed_call(block, tuple(t * 1 for t in leaves), {"scale": scale.clone()}, clone_inputs=learnt)
    x, y = (t * 1 for t in leaves)
    given = y.detach().clone(), scale.clone()
    checkpointed_call(block, (x, y), {"scale": scale}, clone_inputs=learnt).sum().backward()  # copied from now on
    assert torch.equal(y, given[0]) and torch.equal(scale, given[1])


@pytest.mark.parametrize("kw", [{}, {"activation_offload": True}, {"offload_fraction": 0.5},
                                {"offload_fraction": 0.5, "activation_offload": True}])
def test_the_runtime_still_trains_equivalently(kw):
    assert_equivalent(run_managed(Strategy.of(checkpoint="all", compute_dtype="fp32", **kw)))


def test_the_runtime_copies_only_what_the_blocks_change_from_the_first_backward_on():
    """The two-stream model's double blocks add in place to img, its single blocks to x; txt, vec and pe they
    leave. The first step's forward copies every input of the 3 + 3 blocks (img, txt 3 times, x 3, vec and pe 6);
    its recomputes, where each block's backward peak is, only img and x (3 each); from the second step on, forward
    and recompute copy only those (6 copies of img, 6 of x). The blocks' inputs are watched from a forward pre-hook,
    and kept, so no storage of theirs is used again by another tensor."""
    model = make_lora_model()
    inputs, target = make_batch()
    kept = []

    def watch(module, args, kwargs):
        kept.extend([*zip(["x"] * len(args), args), *kwargs.items()])

    hooks = [b.register_forward_pre_hook(watch, with_kwargs=True) for b in (*model.double_blocks,
                                                                            *model.single_blocks)]
    counts = []
    with MemoryRuntime(model, Strategy.of(checkpoint="all", compute_dtype="fp32"), "cpu"):
        for _ in range(2):
            kept.clear()
            with Copies(kept, ("img", "txt", "x", "vec", "pe")) as copies:
                F.mse_loss(model(**inputs), target).backward()
            counts.append(copies.counts)
    for h in hooks:
        h.remove()
    assert counts == [{"img": 6, "txt": 3, "x": 6, "vec": 6, "pe": 6}, {"img": 6, "txt": 0, "x": 6, "vec": 0, "pe": 0}]

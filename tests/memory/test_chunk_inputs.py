"""A checkpointed token-chunked block keeps no copy of its inputs (memory/runtime.py): the chunked forward never
changes them, so the copy the checkpoint made for blocks that add residuals in place was one whole-sequence tensor
more at the block's backward peak (made again by the recompute, alive through the block's backward). The block's own
forward, which a chunked forward falls back to, still works on copies."""
import pytest
import torch
from equivalence import assert_equivalent, run_managed
from torch.utils._python_dispatch import TorchDispatchMode
from two_stream import SingleBlock, make_batch, make_lora_model

from tightrope.memory import token_chunks
from tightrope.memory.runtime import MemoryRuntime
from tightrope.memory.strategy import Strategy

CHUNKED = Strategy.of(compute_dtype="fp32", checkpoint="all", token_chunks=2)


# the blocks' inputs in make_batch's step: img, txt, x = [txt, img], vec, pe (token chunks are smaller)
INPUT_SHAPES = {(2, 12, 32), (2, 5, 32), (2, 17, 32), (2, 32), (17, 16)}


class _Clones(TorchDispatchMode):
    """Counts copies (aten.clone) of tensors shaped as a block's inputs."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.clone.default and tuple(args[0].shape) in INPUT_SHAPES:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _clones_in_one_step(strategy: Strategy) -> int:
    model = make_lora_model()
    inputs, target = make_batch()
    with MemoryRuntime(model, strategy, "cpu") as rt, _Clones() as clones:
        rt.start_step()
        torch.nn.functional.mse_loss(model(**inputs), target).backward()
        rt.end_step()
    return clones.count


def test_a_checkpointed_chunked_block_copies_none_of_its_inputs():
    # before: each block copied all its tensor inputs in forward and again in its recompute: img, txt, vec and pe
    # in the 3 double blocks, x, vec and pe in the 3 single blocks; unchunked blocks still copy them all in their
    # first forward, and in its recompute the ones they change in place, img and x (checkpointing.InPlaceInputs)
    assert _clones_in_one_step(CHUNKED) == 0
    assert _clones_in_one_step(Strategy.of(compute_dtype="fp32", checkpoint="all")) >= (3 * 4 + 3 * 3) + (3 + 3)
    assert_equivalent(run_managed(CHUNKED.replace(activation_offload=True, offload_fraction=1.0)))


class _FallingBack(SingleBlock):
    """A single block whose chunked forward always falls back to its own, which adds to its input in place."""


def _fall_back(block, ctx, x, *, vec, pe):
    return ctx.plain(x, vec=vec, pe=pe)


@pytest.fixture
def falling_back(monkeypatch):
    monkeypatch.setitem(token_chunks._CHUNKED, _FallingBack, _fall_back)


def test_the_fallback_to_the_blocks_own_forward_still_works_on_copies(falling_back, monkeypatch):
    """Without a copy, the block's `x += ...` changes the input its checkpoint saved: autograd refuses the backward
    ("modified by an inplace operation")."""
    monkeypatch.setattr("equivalence.make_lora_model", lambda: _with_falling_back(make_lora_model()))
    assert_equivalent(run_managed(CHUNKED.replace(offload_fraction=1.0)))  # (activation offload saves host copies)
    assert_equivalent(run_managed(CHUNKED.replace(activation_offload=True, offload_fraction=1.0)))
    assert _clones_in_one_step(CHUNKED) == 0  # the plain two-stream blocks: still no copy


def _with_falling_back(model):
    for block in model.single_blocks:
        block.__class__ = _FallingBack
    return model

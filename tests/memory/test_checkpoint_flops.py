"""Each checkpoint policy recomputes exactly the forward of the blocks it checkpoints, counted with FlopCounterMode.

The tiny two-stream model (tests/helpers/two_stream.py) has 6 blocks: 3 double (index 0-2) then 3 single (3-5); a
different LoRA rank in each block makes every block's cost different, so a policy that recomputed the wrong blocks
would show. Counts are integers, so the checks are
exact. Attention is in none of these counts (recomputed alike; FlopCounterMode counts the CPU attention kernel only
from torch 2.15 on, so it is left out: flops_without_attention); the matmuls are.
"""
import functools

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, inject_adapter_in_model
from torch import nn
from torch.utils.checkpoint import set_checkpoint_early_stop
from torch.utils.flop_counter import FlopCounterMode
from two_stream import TwoStream, make_batch

from tightrope.memory.blocks import discover_blocks
from tightrope.memory.runtime import MemoryRuntime
from tightrope.memory.shape_profile import flops_without_attention
from tightrope.memory.strategy import Keep, Strategy

POLICIES = {
    "off": Strategy.of(checkpoint="off", compute_dtype="fp32"),
    "all": Strategy.of(checkpoint="all", compute_dtype="fp32"),
    "every_2": Strategy.of(checkpoint="every_n", checkpoint_every=2, compute_dtype="fp32"),
    "every_3": Strategy.of(checkpoint="every_n", checkpoint_every=3, compute_dtype="fp32"),
}
RECOMPUTED = {  # policy -> the block indices it recomputes
    "off": [], "all": [0, 1, 2, 3, 4, 5], "every_2": [0, 2, 4], "every_3": [0, 3]}


def _model() -> nn.Module:
    """The two-stream model with LoRA on every block linear, rank 2, 4, ..., 12 in blocks 0 to 5."""
    torch.manual_seed(0)
    model = TwoStream().requires_grad_(False)
    ranks = {rf"{kind}_blocks\.{i}\..*": 2 + 2 * (3 * j + i) for j, kind in enumerate(("double", "single"))
             for i in range(3)}
    config = LoraConfig(r=4, lora_alpha=4, rank_pattern=ranks,
                        target_modules=r".*_blocks\.\d+\..*(qkv|proj|mod|shift|txt_to_img|mlp\.[02])")
    return inject_adapter_in_model(config, model)


def _forward_counts() -> tuple[dict[str, int], dict[str, tuple[bool, bool]]]:
    """Forward FLOPs per module (FlopCounterMode's names: 'TwoStream.double_blocks.0.qkv.lora_A.default', ...),
    and for each linear layer (its input needs a gradient, its weight is trained)."""
    model = _model()
    inputs, _ = make_batch()
    grads, hooks = {}, []
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            def record(mod, args, name=f"TwoStream.{name}"):
                grads[name] = (args[0].requires_grad, mod.weight.requires_grad)
            hooks.append(m.register_forward_pre_hook(record))
    try:
        with FlopCounterMode(display=False) as counter:
            model(**inputs)
    finally:
        for h in hooks:
            h.remove()
    return {name: flops_without_attention(counter, name) for name in counter.get_flop_counts()}, grads


FORWARD, LINEAR_GRADS = _forward_counts()
BLOCKS = [f"TwoStream.{b.name}" for b in discover_blocks(_model())]


def _step_flops(strategy: Strategy) -> int:
    """FLOPs of one forward + backward through the runtime."""
    model = _model()
    inputs, target = make_batch()
    with MemoryRuntime(model, strategy, "cpu"), FlopCounterMode(display=False) as counter:
        F.mse_loss(model(**inputs), target).backward()
    return flops_without_attention(counter)


@functools.cache
def _no_checkpoint_flops() -> int:
    return _step_flops(POLICIES["off"])


def _backward_flops() -> int:
    """B, predicted from the forward counts: the backward of a linear layer is one matmul of the forward's size for
    its input's gradient (if the input needs one) plus one for its weight's gradient (if the weight is trained: the
    LoRA A/B layers, not the frozen base). So a LoRA layer inside the stream costs 2 x its forward, a base layer
    1 x, and a layer fed only by the conditioning (vec, the first block's txt) or by the raw inputs less or 0."""
    return sum(FORWARD[name] * (needs_input_grad + trained)
               for name, (needs_input_grad, trained) in LINEAR_GRADS.items())


def test_every_block_costs_differently():
    assert len(BLOCKS) == 6 and BLOCKS[0] == "TwoStream.double_blocks.0" and BLOCKS[3] == "TwoStream.single_blocks.0"
    assert len({FORWARD[b] for b in BLOCKS}) == 6 and all(FORWARD[b] > 0 for b in BLOCKS)
    assert [i for i in range(6) if POLICIES["every_3"].keeps(i) is Keep.INPUTS] == RECOMPUTED["every_3"]


def test_checkpoint_off_costs_forward_plus_backward():
    assert _no_checkpoint_flops() == FORWARD["Global"] + _backward_flops()


@pytest.mark.parametrize("policy", ["all", "every_2", "every_3"])
def test_checkpointing_adds_the_forward_of_each_checkpointed_block(policy):
    """With early stop off, torch's checkpoint reruns the whole forward of each checkpointed block."""
    with set_checkpoint_early_stop(False):
        extra = _step_flops(POLICIES[policy]) - _no_checkpoint_flops()
    assert extra == sum(FORWARD[BLOCKS[i]] for i in RECOMPUTED[policy]) > 0


@pytest.mark.parametrize("policy", ["all", "every_2", "every_3"])
def test_early_stop_skips_only_each_blocks_last_matmul(policy):
    """As the runtime trains (torch's default early stop), the recompute of a block ends when its last saved tensor
    is packed again, which happens before the block's last op (the LoRA B matmul of mlp.2, whose output backward
    does not need) runs: every checkpointed block is recomputed except that one matmul."""
    extra = _step_flops(POLICIES[policy]) - _no_checkpoint_flops()
    assert extra == sum(FORWARD[BLOCKS[i]] - FORWARD[f"{BLOCKS[i]}.mlp.2.lora_B.default"] for i in RECOMPUTED[policy])

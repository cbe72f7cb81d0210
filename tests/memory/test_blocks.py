import pytest
from torch import nn
from two_stream import TwoStream, make_lora_model

from tightrope.memory.blocks import discover_blocks
from tightrope.memory.offload_selection import select_offloaded
from tightrope.memory.strategy import LayerOffloadConfig, StrategyError


def test_flux_layout_in_execution_order():
    names = [b.name for b in discover_blocks(TwoStream(n_double=2, n_single=3))]
    assert names == ["double_blocks.0", "double_blocks.1", "single_blocks.0", "single_blocks.1", "single_blocks.2"]


def test_found_under_a_wrapper():
    wrapper = nn.Module()
    wrapper.diffusion_model = make_lora_model()  # ComfyUI's layout, with peft layers inside
    assert discover_blocks(wrapper)[0].name == "diffusion_model.double_blocks.0"


@pytest.mark.parametrize("attr", ["joint_blocks", "layers", "blocks", "transformer_blocks"])
def test_other_families(attr):
    m = nn.Module()
    setattr(m, attr, nn.ModuleList(nn.Linear(4, 4) for _ in range(3)))
    assert [b.name for b in discover_blocks(m)] == [f"{attr}.{i}" for i in range(3)]


def test_fallback_largest_uniform_list_and_override():
    m = nn.Module()
    m.small = nn.ModuleList(nn.Linear(2, 2) for _ in range(4))
    m.stack = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
    assert [b.name for b in discover_blocks(m)] == ["stack.0", "stack.1", "stack.2"]
    assert [b.name for b in discover_blocks(m, ("small",))][0] == "small.0"


def test_no_block_list_is_a_clear_error():
    with pytest.raises(StrategyError, match="Strategy.block_lists"):
        discover_blocks(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(StrategyError, match="'nope'.*does not have"):
        discover_blocks(TwoStream(), ("nope",))


def test_selection_policies():
    sizes = [10, 10, 10, 4, 4, 4, 4, 4, 4]
    assert select_offloaded(sizes, LayerOffloadConfig(fraction=0.0)) == []
    assert select_offloaded(sizes, LayerOffloadConfig(fraction=1.0)) == list(range(9))
    spread = select_offloaded(sizes, LayerOffloadConfig(fraction=0.2))  # 11.2 bytes -> three of the small blocks
    assert spread == [4, 6, 8]  # spaced out among the six small blocks
    assert select_offloaded(sizes, LayerOffloadConfig(fraction=0.2, policy="first")) == [0, 1]
    assert select_offloaded(sizes, LayerOffloadConfig(fraction=0.2, policy="last")) == [6, 7, 8]
    with pytest.raises(StrategyError, match="offload_blocks has indices \\[12\\].*0..8"):
        select_offloaded(sizes, LayerOffloadConfig(blocks=(1, 12)))

import pytest

from tightrope.memory.strategy import Strategy, StrategyError


def test_json_round_trip():
    s = Strategy(offload_fraction=0.25, offload_blocks=(3, 1), checkpoint="every_n", checkpoint_every=3,
                 compile="per_block", activation_memory_budget=0.5, compute_dtype="fp16", block_lists=("blocks",))
    again = Strategy.from_json(s.to_json())
    assert again == s and again.offload_blocks == (1, 3)


@pytest.mark.parametrize("kw,field,fix", [
    ({"offload_fraction": 1.5}, "offload_fraction", "from 0.0 to 1.0"),
    ({"offload_fraction": float("nan")}, "offload_fraction", "from 0.0 to 1.0"),
    ({"checkpoint_every": 0}, "checkpoint_every", "whole number from 1"),
    ({"activation_memory_budget": -1}, "activation_memory_budget", "from 0.0 to 1.0"),
    ({"compute_dtype": "fp64"}, "compute_dtype", "bf16, fp16, fp32"),
    ({"weight_dtype": "int4"}, "weight_dtype", "auto, bf16"),
    ({"checkpoint": "some"}, "checkpoint", "off, all, every_n"),
    ({"prefetch_depth": -1}, "prefetch_depth", "whole number from 0"),
    ({"compile_mode": "reduce-overhead"}, "compile_mode", "default"),
    ({"offload_blocks": (-1,)}, "offload_blocks", "indices >= 0"),
    ({"pin_memory": "yes"}, "pin_memory", "true or false"),
    ({"block_lists": ()}, "block_lists", "dotted names"),
])
def test_bad_values_name_field_and_fix(kw, field, fix):
    with pytest.raises(StrategyError) as e:
        Strategy(**kw)
    assert f"Strategy.{field}=" in str(e.value) and fix in str(e.value)


def test_unknown_json_field_is_named():
    with pytest.raises(StrategyError, match="offload_fraktion"):
        Strategy.from_dict({"offload_fraktion": 0.5})


def test_checkpoint_selection():
    assert [Strategy(checkpoint="every_n", checkpoint_every=2).checkpoints_block(i) for i in range(4)] == \
        [True, False, True, False]
    assert Strategy(checkpoint="all").checkpoints_block(5)
    # a compiled block under a memory budget is not also wrapped in eager checkpointing
    assert not Strategy(checkpoint="all", compile="per_block", activation_memory_budget=0.5).checkpoints_block(0)

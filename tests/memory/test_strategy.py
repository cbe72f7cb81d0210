import json

import pytest
import torch.nn.functional as F
from two_stream import make_batch, make_lora_model

from tightrope.memory import runtime as runtime_module
from tightrope.memory.runtime import MemoryRuntime
from tightrope.memory.strategy import (CheckpointConfig, CompileConfig, Keep, LayerOffloadConfig, ShardingConfig,
                                       Strategy, StrategyError)


def test_json_round_trip_is_tagged_by_part():
    s = Strategy.of(offload_fraction=0.25, offload_blocks=(3, 1), checkpoint="every_n", checkpoint_every=3,
                    compute_dtype="fp16", block_lists=("blocks",))
    data = json.loads(s.to_json())
    assert set(data) == {"offload", "checkpointing", "activations", "compiler", "precision", "sharding",
                         "optimizer", "block_lists"}
    assert data["offload"]["blocks"] == [1, 3]
    assert data["checkpointing"] == {"mode": "every_n", "every": 3, "token_chunks": 1}
    again = Strategy.from_json(s.to_json())
    assert again == s and again.offload.blocks == (1, 3) and again.block_lists == ("blocks",)
    compiled = Strategy.of(compile="per_block", activation_memory_budget=0.5, compile_mode="max-autotune-no-cudagraphs")
    assert Strategy.from_json(compiled.to_json()) == compiled
    sharded = Strategy.of(shard="fsdp", checkpoint="all")
    assert json.loads(sharded.to_json())["sharding"] == {"mode": "fsdp"} and Strategy.from_json(sharded.to_json()) \
        == sharded and sharded.sharding == ShardingConfig(mode="fsdp") and sharded.sharding.active
    chunked = Strategy.of(checkpoint="all", token_chunks=8)
    assert json.loads(chunked.to_json())["checkpointing"]["token_chunks"] == 8
    assert Strategy.from_json(chunked.to_json()) == chunked and chunked.to_flat()["token_chunks"] == 8
    # JSON written before token chunks existed (tagged, and flat) loads with them off
    older = json.loads(s.to_json())
    del older["checkpointing"]["token_chunks"]
    assert Strategy.from_dict(older) == s and Strategy.from_dict(older).checkpointing.token_chunks == 1


def test_a_strategy_saved_without_the_sharding_part_loads_unsharded():
    """State files, profiles and LoRA metadata written before sharding was a part (tagged form, no 'sharding')."""
    saved = Strategy.of(offload_fraction=0.5).to_dict()
    del saved["sharding"]
    s = Strategy.from_dict(saved)
    assert s == Strategy.of(offload_fraction=0.5) and s.sharding == ShardingConfig() and not s.sharding.active


# a strategy exactly as Tightrope 0.1 wrote it into state files, profiles and LoRA metadata (dataclasses.asdict)
FLAT_0_1 = {"offload_fraction": 0.5, "offload_policy": "first", "offload_blocks": [4, 2], "prefetch_depth": 2,
            "activation_offload": True, "checkpoint": "every_n", "checkpoint_every": 3, "compile": "per_block",
            "activation_memory_budget": 1.0, "compile_mode": "default", "compile_backend": "aot_eager",
            "compute_dtype": "bf16", "weight_dtype": "bf16", "pin_memory": False,
            "block_lists": ["double_blocks", "single_blocks"]}


def test_the_flat_form_of_version_0_1_still_loads():
    s = Strategy.from_dict(FLAT_0_1)
    assert s.offload == LayerOffloadConfig(fraction=0.5, policy="first", blocks=(2, 4), prefetch_depth=2,
                                           pin_memory=False)
    assert s.checkpointing == CheckpointConfig(mode="every_n", every=3) and s.activations.enabled
    assert s.compiler == CompileConfig(scope="per_block", backend="aot_eager")
    assert (s.precision.compute_dtype, s.precision.weight_dtype) == ("bf16", "bf16")
    assert s.block_lists == ("double_blocks", "single_blocks")
    assert s.to_flat() == {**FLAT_0_1, "offload_blocks": [2, 4], "shard": "off", "token_chunks": 1,
                            "optimizer_offload": False}  # maps back
    assert Strategy.from_dict({"checkpoint": "all"}) == Strategy.of(checkpoint="all")  # partial flat dicts too


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
    ({"offload_blocks": 3}, "offload_blocks", "give a list of block indices"),  # not a TypeError traceback
    ({"block_lists": 5}, "block_lists", "dotted names"),
    ({"block_lists": {"blocks": 1}}, "block_lists", "dotted names"),
    ({"pin_memory": "yes"}, "pin_memory", "true or false"),
    ({"activation_offload": 1}, "activation_offload", "true or false"),
    ({"block_lists": ()}, "block_lists", "dotted names"),
    ({"shard": "ddp"}, "shard", "off, fsdp"),
    ({"token_chunks": 0}, "token_chunks", "whole number from 1 to 64"),
    ({"token_chunks": 65}, "token_chunks", "whole number from 1 to 64"),
    ({"token_chunks": 2.0}, "token_chunks", "whole number from 1 to 64"),
])
def test_bad_values_name_field_and_fix(kw, field, fix):
    with pytest.raises(StrategyError) as e:
        Strategy.of(**kw)
    assert f"Strategy.{field}=" in str(e.value) and fix in str(e.value)
    with pytest.raises(StrategyError) as again:  # the same message from a saved flat dict
        Strategy.from_dict(kw)
    assert str(again.value) == str(e.value)


def test_empty_offload_blocks_leave_it_to_offload_fraction():
    """As the offload_blocks message says: an empty list means offload_fraction decides (it used to offload nothing)."""
    assert Strategy.of(offload_fraction=0.5, offload_blocks=[]) == Strategy.of(offload_fraction=0.5)
    assert Strategy.from_dict({"offload": {"fraction": 0.5, "blocks": []}}).offload.blocks is None


@pytest.mark.parametrize("kw,match", [
    ({"weight_dtype": "bf16", "compute_dtype": "fp32"},
     r"Strategy.weight_dtype='bf16' does not work with compute_dtype='fp32' .*set compute_dtype='bf16'"),
    ({"checkpoint": "all", "compile": "per_block", "activation_memory_budget": 0.5},
     r"Strategy.checkpoint='all' does not combine with compile='per_block' at activation_memory_budget=0.5: .*"
     r"set checkpoint='off', or activation_memory_budget=1.0"),
    ({"offload_fraction": 0.5, "shard": "fsdp"},
     r"Strategy.shard='fsdp' \(--fsdp\) does not work with layer offload \(offload_fraction=0.5, offload_blocks=None\)"
     r".*set offload_fraction=0 and no offload_blocks .*or shard='off'"),
    ({"offload_blocks": (1,), "shard": "fsdp"},
     r"Strategy.shard='fsdp' \(--fsdp\) does not work with layer offload \(offload_fraction=0.0, offload_blocks=\[1\]\)"),
    ({"checkpoint": "all", "shard": "fsdp", "token_chunks": 8},
     r"Strategy.token_chunks=8 does not work with shard='fsdp' \(--fsdp\) yet: set token_chunks=1 .* or run without "
     r"--fsdp"),
    ({"checkpoint": "all", "compile": "per_block", "token_chunks": 4},
     r"Strategy.token_chunks=4 does not combine with compile='per_block': set token_chunks=1 .* or compile='off'"),
])
def test_cross_field_refusals_name_both_fields(kw, match):
    with pytest.raises(StrategyError, match=match):
        Strategy.of(**kw)
    with pytest.raises(StrategyError, match=match):  # replace checks the whole again
        Strategy.of(**{k: v for k, v in kw.items() if k not in ("checkpoint", "compute_dtype", "shard")}).replace(
            **{k: v for k, v in kw.items() if k in ("checkpoint", "compute_dtype", "shard")})


def test_unknown_fields_and_parts_are_named():
    with pytest.raises(StrategyError, match="offload_fraktion"):
        Strategy.from_dict({"offload_fraktion": 0.5})
    with pytest.raises(StrategyError, match=r"unknown field\(s\) \['fraktion'\] in strategy part 'offload'"):
        Strategy.from_dict({"offload": {"fraktion": 0.5}})
    with pytest.raises(StrategyError, match=r"unknown strategy part\(s\) \['checkpoint'\]"):
        Strategy.from_dict({"offload": {}, "checkpoint": "all"})  # the two forms mixed
    with pytest.raises(StrategyError, match=r"unknown field\(s\) \['shards'\] in strategy part 'sharding': known are "
                       r"\['mode'\]"):
        Strategy.from_dict({"sharding": {"shards": 2}})
    with pytest.raises(StrategyError, match=r"strategy part 'sharding' must be an object of fields, got 'fsdp'"):
        Strategy.from_dict({"sharding": "fsdp"})


def test_replace_changes_flat_fields_or_parts():
    s = Strategy.of(offload_fraction=0.5, checkpoint="all")
    assert s.replace(prefetch_depth=2).offload == LayerOffloadConfig(fraction=0.5, prefetch_depth=2)
    assert s.replace(compiler=CompileConfig(scope="per_block")).compiler.per_block
    assert s.replace(prefetch_depth=2).checkpointing == s.checkpointing and s.offload.prefetch_depth == 1


def test_keeps():
    assert [Strategy.of(checkpoint="every_n", checkpoint_every=2).keeps(i) for i in range(4)] == \
        [Keep.INPUTS, Keep.ALL, Keep.INPUTS, Keep.ALL]
    assert Strategy.of(checkpoint="all").keeps(5) is Keep.INPUTS
    assert Strategy.of().keeps(0) is Keep.ALL
    assert Strategy.of(checkpoint="all", compile="per_block").keeps(3) is Keep.INPUTS  # budget 1: eager ckpt
    assert Strategy.of(compile="per_block", activation_memory_budget=0.5).keeps(3) is Keep.BUDGET
    assert Strategy.of(activation_memory_budget=0.5).keeps(3) is Keep.ALL  # the budget is for compiled blocks


@pytest.mark.parametrize("kw", [{}, {"checkpoint": "all"}, {"checkpoint": "every_n", "checkpoint_every": 2},
                                {"checkpoint": "every_n", "checkpoint_every": 4, "activation_offload": True},
                                {"checkpoint": "all", "compile": "per_block", "activation_offload": True},
                                {"compile": "per_block", "activation_memory_budget": 0.5, "activation_offload": True}])
def test_the_runtime_does_what_keeps_says(kw, monkeypatch):
    """Spy on the runtime: which blocks it wraps in eager checkpointing, compiles (and at which budget), and gives
    activation offload hooks, for one training step; each must be what Strategy.keeps says."""
    strategy = Strategy.of(compute_dtype="fp32", **kw)
    entered, ckpt_marks, compiled, act_hooked = [], [], [], []
    enter, call, hooks = MemoryRuntime._enter_block, runtime_module.checkpointed_call, MemoryRuntime._saved_tensor_hooks

    def spy_enter(self, index):
        entered.append(index)
        return enter(self, index)

    def spy_checkpoint(fn, args, kwargs, **options):
        ckpt_marks.append(len(entered))  # the block entered next is the one being checkpointed
        return call(fn, args, kwargs, **options)

    def spy_hooks(self, index, weights, acts):
        if acts:
            act_hooked.append(index)
        return hooks(self, index, weights, acts)

    monkeypatch.setattr(MemoryRuntime, "_enter_block", spy_enter)
    monkeypatch.setattr(runtime_module, "checkpointed_call", spy_checkpoint)
    monkeypatch.setattr(MemoryRuntime, "_saved_tensor_hooks", spy_hooks)
    monkeypatch.setattr(runtime_module, "compile_block",
                        lambda forward, config: compiled.append(config.activation_memory_budget) or forward)
    model = make_lora_model()
    inputs, target = make_batch()
    with MemoryRuntime(model, strategy, "cpu") as rt:
        F.mse_loss(model(**inputs), target).backward()
        n = len(rt.blocks)
    keeps = [strategy.keeps(i) for i in range(n)]
    assert n == 6
    assert [entered[m] for m in ckpt_marks] == [i for i, k in enumerate(keeps) if k is Keep.INPUTS]
    assert compiled == ([strategy.compiler.activation_memory_budget] * n if strategy.compiler.per_block else [])
    assert (Keep.BUDGET in keeps) == (strategy.compiler.activation_memory_budget < 1.0)
    expected_acts = [i for i, k in enumerate(keeps) if k is not Keep.ALL] if strategy.activations.enabled else []
    assert act_hooked == expected_acts

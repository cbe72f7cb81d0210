"""One config base (memory/config_base.py) for the Strategy's parts, TrainConfig, LoraSpec and Profile: the same
JSON round trip, unknown keys named next to the known ones, and field-named errors of each config's own type."""
import json

import pytest

from tightrope.memory.profile import Profile
from tightrope.memory.strategy import CompileConfig, LayerOffloadConfig, StrategyError
from tightrope.training.lora.layers import LoraSpec
from tightrope.training.lora.targets import LoraError
from tightrope.training.train_config import ConfigError, TrainConfig


def _profile() -> Profile:
    return Profile(device="cpu", batch=2, block_names=["b0"], block_types=["Block"], block_frozen=[4], block_packed=[4],
                   block_trainable=[1], other_weight_bytes=2, trainable_bytes=1, trainable_numel=1, act_full=[8],
                   act_ckpt=[2], act_shared=1, act_other=1, fwd_s=[0.1], bwd_s=[0.2], other_s=0.0,
                   h2d_bytes_per_s=1e9, strategy_base={"offload": {"blocks": [1, 2]}})


@pytest.mark.parametrize("config", [LayerOffloadConfig(fraction=0.5, blocks=(2, 1)), CompileConfig(scope="per_block"),
                                    TrainConfig(learning_rate=3e-4, seed=7), LoraSpec(rank=4, targets="all_linear"),
                                    _profile()])
def test_json_round_trip(config):
    data = json.loads(json.dumps(config.to_dict()))
    assert data == config.to_dict() and type(config).from_dict(data) == config


@pytest.mark.parametrize("cls,error,match", [
    (TrainConfig, ConfigError, r"unknown training setting\(s\) \['lr'\]: known are \[.*'learning_rate'"),
    (LoraSpec, LoraError, r"unknown LoRA setting\(s\) \['lr'\]: known are \[.*'rank'"),
    (Profile, ValueError, r"unknown profile field\(s\) \['lr'\]: known are \[.*'block_names'.*\]; is this a profile "
                          r"from another version\?"),
    (CompileConfig, StrategyError, r"unknown field\(s\) \['lr'\]: known are \['activation_memory_budget', 'backend', "
                                   r"'mode', 'scope'\]"),
])
def test_unknown_keys_are_named_with_the_known_ones_in_the_configs_own_error(cls, error, match):
    with pytest.raises(error, match=match):
        cls.from_dict({"lr": 1})
    with pytest.raises(error, match=rf"{cls.__name__} must be an object of fields, got \[1\]"):
        cls.from_dict([1])


@pytest.mark.parametrize("build,error,message", [
    (lambda: TrainConfig(optimizer="sgd"), ConfigError, "optimizer='sgd' is not supported: choose one of adamw"),
    (lambda: TrainConfig(weight_decay=float("nan")), ConfigError,
     "weight_decay=nan is out of range: use a number from 0.0 to 1.0"),
    (lambda: LoraSpec(init="zeros"), LoraError, "LoRA init='zeros' is not supported: choose one of default, gaussian"),
    (lambda: LoraSpec(rslora=1), LoraError, "LoRA rslora=1 must be true or false"),
    (lambda: LayerOffloadConfig(pin_memory=1), StrategyError, "Strategy.pin_memory=1 must be true or false"),
    (lambda: CompileConfig(backend="tvm"), StrategyError, "Strategy.compile_backend='tvm' is not supported: choose one"),
])
def test_one_validation_style(build, error, message):
    """'<prefix><field>=<value> <problem>: <fix>', raised as the config's own error type."""
    with pytest.raises(error) as e:
        build()
    assert str(e.value).startswith(message)

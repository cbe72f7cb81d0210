"""Every strategy combination trains exactly like plain PyTorch (fp32), with evicted weights poisoned with NaN."""
import itertools

import pytest
from equivalence import assert_equivalent, run_managed

from tightrope.memory.layer_offload import LayerOffload
from tightrope.memory.strategy import Strategy

CHECKPOINTS = {"off": {}, "all": {"checkpoint": "all"}, "every2": {"checkpoint": "every_n", "checkpoint_every": 2}}


@pytest.mark.parametrize("offload,ckpt,act", list(itertools.product([0.0, 0.5, 1.0], CHECKPOINTS, [False, True])))
def test_eager_matrix(offload, ckpt, act):
    s = Strategy.of(offload_fraction=offload, activation_offload=act, compute_dtype="fp32", **CHECKPOINTS[ckpt])
    result = run_managed(s)
    assert_equivalent(result)
    if offload:
        assert result[2]["h2d_bytes"] > 0, "offloaded blocks were never streamed in"
    if act and ckpt != "off":
        assert result[2]["d2h_bytes"] > 0, "checkpoint-boundary activations never went to the host"


COMPILED = {"budget1+ckpt_all": {"checkpoint": "all"}, "budget0.5": {"activation_memory_budget": 0.5}}


@pytest.mark.parametrize("offload,variant,act", list(itertools.product([0.0, 0.5, 1.0], COMPILED, [False, True])))
def test_compiled_matrix(offload, variant, act):
    s = Strategy.of(offload_fraction=offload, activation_offload=act, compute_dtype="fp32", compile="per_block",
                    compile_backend="aot_eager_decomp_partition", **COMPILED[variant])
    assert_equivalent(run_managed(s), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("offload,ckpt,act,chunks", [(1.0, "all", True, 3), (0.5, "off", False, 3),
                                                    (1.0, "every2", True, 20)])
def test_token_chunks(offload, ckpt, act, chunks):
    """The test model's blocks have chunked forwards (tests/helpers/two_stream.py): chunk regions recomputed in
    backward under layer offload (also of blocks that are not checkpointed, whose weights only a region's own
    load brings back), with activation offload; 20 chunks is more than the tokens (5 text, 12 image)."""
    s = Strategy.of(offload_fraction=offload, activation_offload=act, compute_dtype="fp32", token_chunks=chunks,
                    **CHECKPOINTS[ckpt])
    assert_equivalent(run_managed(s))


@pytest.mark.parametrize("device", ["cpu", "cpu:0"])
def test_optimizer_offload(device):
    """The optimizer on the host (training/host_optimizer.py) under offload, checkpointing, activation offload and
    token chunks, the device spelled without and with an index: its gradients (read on the host) and losses are
    the plain run's."""
    s = Strategy.of(offload_fraction=1.0, checkpoint="all", activation_offload=True, compute_dtype="fp32",
                    token_chunks=3, optimizer_offload=True)
    assert_equivalent(run_managed(s, device=device))


@pytest.mark.parametrize("variant", list(COMPILED))
def test_optimizer_offload_under_per_block_compile(variant):
    """The gradients the optimizer's hooks copy out come from compiled backwards too (a compiled graph's LoRA
    gradients still reach the leaves' AccumulateGrad, where the hooks run)."""
    s = Strategy.of(offload_fraction=0.5, activation_offload=True, compute_dtype="fp32", compile="per_block",
                    compile_backend="aot_eager_decomp_partition", optimizer_offload=True, **COMPILED[variant])
    assert_equivalent(run_managed(s), rtol=1e-5, atol=1e-6)


def test_prefetch_depths_and_policies():
    for kw in ({"prefetch_depth": 0}, {"prefetch_depth": 3}, {"offload_policy": "first"},
               {"offload_policy": "last"}, {"offload_blocks": (1, 4)}):
        assert_equivalent(run_managed(Strategy.of(offload_fraction=0.5, checkpoint="every_n", compute_dtype="fp32",
                                                  **kw)))


@pytest.mark.parametrize("ckpt", ["off", "all"])
def test_broken_schedule_is_caught(monkeypatch, ckpt):
    """Negative control: a conductor that forgets to reload blocks during backward must fail the comparison."""
    real_load = LayerOffload.load

    def forgetful_load(self, index):
        from tightrope.memory.layer_offload import in_backward
        if in_backward() and index in self.layouts and index not in self.resident:
            return  # the bug: run the block on whatever is (not) loaded
        real_load(self, index)

    monkeypatch.setattr(LayerOffload, "load", forgetful_load)
    monkeypatch.setattr(LayerOffload, "unpack", lambda self, ref: self.area.view(ref.dtype).as_strided(
        ref.shape, ref.stride, ref.offset))
    with pytest.raises(AssertionError):
        assert_equivalent(run_managed(Strategy.of(offload_fraction=1.0, prefetch_depth=0, compute_dtype="fp32",
                                                  **CHECKPOINTS[ckpt])))

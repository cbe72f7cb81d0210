"""The probe's compile pass (measure_compile), on CPU: per block type, two budgets, ratios against the eager pass."""
import torch
import torch.nn.functional as F
from two_stream import make_batch, make_lora_model

from tightrope.memory import probe as probe_module
from tightrope.memory.probe import probe_model
from tightrope.memory.strategy import Strategy


def test_compile_pass_measures_each_block_type_at_both_budgets(monkeypatch):
    """compile_block stubbed to the eager forward (torch.compile itself is not what is tested here): each block type
    gets factors at budgets 1.0 and 0.5, computed against that type's first block in the eager pass; the same
    forward saves the same bytes, so act_factor is exactly 1."""
    compiled = []
    monkeypatch.setattr(probe_module, "compile_block",
                        lambda forward, strategy: compiled.append(strategy.activation_memory_budget) or forward)

    def inputs():
        batch, target = make_batch()
        return batch, lambda out: F.mse_loss(out, target)
    torch.manual_seed(0)
    prof = probe_model(make_lora_model(), inputs, "cpu", Strategy.of(compute_dtype="fp32"), repeats=1,
                       measure_compile=True)
    kinds = set(prof.block_types)
    assert set(prof.compile) == kinds and compiled == [1.0, 0.5] * len(kinds)
    for factors in prof.compile.values():
        assert set(factors) == {"1.0", "0.5"}
        for f in factors.values():
            assert f.act_factor == 1.0 and f.fwd_factor > 0 and f.bwd_factor > 0 and f.compile_s >= 0

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


def test_the_compile_pass_compiles_where_earlier_runs_kept_graphs(monkeypatch):
    """Runs keep their compiled graphs on Tightrope's copy of each block forward's code (block_compile.py), up to
    KEEP_LIMIT - 1 of them: the probe's compile_block lands on the same code, and under dynamo's default recompile
    limit (8) it ran the blocks eagerly without a word once 8 were kept, measuring eager as compiled."""
    from tightrope.memory import block_compile
    from tightrope.memory.runtime import MemoryRuntime
    from two_stream import train_steps
    monkeypatch.setattr(block_compile, "_BACKENDS", {})
    for budget in (0.1, 0.2, 0.3, 0.4, 0.6, 0.7, 0.8, 0.9):  # earlier prompts, each a setup of its own
        model = make_lora_model(n_double=1, n_single=1)
        strategy = Strategy.of(compile="per_block", compile_backend="aot_eager", compute_dtype="fp32",
                               activation_memory_budget=budget)
        with MemoryRuntime(model, strategy, "cpu") as rt:
            train_steps(model, steps=1, runtime=rt)

    def inputs():
        batch, target = make_batch()
        return batch, lambda out: F.mse_loss(out, target)
    before = block_compile.compiled_graph_count()
    probe_model(make_lora_model(n_double=1, n_single=1), inputs, "cpu",
                Strategy.of(compute_dtype="fp32", compile_backend="aot_eager"), repeats=1, measure_compile=True)
    assert block_compile.compiled_graph_count() - before >= 4, "the probe's blocks ran eagerly (2 types x 2 budgets)"

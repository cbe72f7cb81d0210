"""Per-block compile: stable graphs across steps, no eager fallback, and mode options in the backward too."""
import pytest
import torch
from two_stream import make_batch, make_lora_model, train_steps

from tightrope.memory import block_compile, mutating_blocks
from tightrope.memory.blocks import MUTATES_INPUTS
from tightrope.memory.runtime import MemoryRuntime
from tightrope.memory.strategy import Strategy


def _counting_backends(monkeypatch):
    """Make the runtime's compiled graphs count their forward runs (a fallback to eager would not count)."""
    calls = [0]
    real_lookup = torch._dynamo.lookup_backend

    def lookup(name):
        compiler = real_lookup(name)

        def backend(gm, example_inputs):
            compiled = compiler(gm, example_inputs)

            def run(*args):
                calls[0] += 1
                return compiled(*args)
            return run
        return backend

    monkeypatch.setattr(block_compile, "_BACKENDS", {})
    monkeypatch.setattr(torch._dynamo, "lookup_backend", lookup)
    return calls


def test_graphs_stay_put_and_every_block_runs_compiled(monkeypatch):
    """More blocks of one type than dynamo's recompile limit (8): a per-instance guard would recompile each block
    and, past the limit, run the rest eagerly; neither may happen, in step 1 or later steps."""
    calls = _counting_backends(monkeypatch)
    n_double, n_single = 9, 1
    assert n_double > torch._dynamo.config.recompile_limit
    model = make_lora_model(n_double=n_double, n_single=n_single)
    strategy = Strategy.of(compile="per_block", compile_backend="aot_eager_decomp_partition", compute_dtype="fp32",
                           activation_memory_budget=0.5, offload_fraction=0.5, activation_offload=True)
    graphs, runs = [], []
    with MemoryRuntime(model, strategy, "cpu", activation_min_bytes=0) as rt:
        for _ in range(2):
            before = calls[0]
            train_steps(model, steps=1, runtime=rt)
            graphs.append(rt.counters()["graphs"])
            runs.append(calls[0] - before)
    assert graphs[0] == graphs[1], f"graphs compiled after steps 1 and 2: {graphs}"
    assert runs == [n_double + n_single] * 2, f"compiled block runs per step: {runs}"


def test_runs_one_after_another_never_reach_the_recompile_limit():
    """A long-lived process (a ComfyUI server) trains one LoRA setup after another, each validating without
    gradients: dynamo keeps its graphs on the code object it compiled, so with one code object for every run the
    entries piled up (adapter types x grad modes) and past the recompile limit (8) the blocks ran eagerly without a
    word (found by a helper fuzzing strategies): slower, and holding the activations the memory budget was to drop.
    Each runtime compiles its own code object, dropped with it at undo. (fail_on_recompile_limit_hit: the limit
    raises here instead of falling back to eager.)"""
    from peft import LoHaConfig, LoKrConfig, LoraConfig
    strategy = Strategy.of(compile="per_block", compile_backend="aot_eager_decomp_partition", compute_dtype="fp32",
                           activation_memory_budget=0.5)
    setups = [LoraConfig(r=4), LoHaConfig(r=4), LoKrConfig(r=4), LoraConfig(r=4, use_dora=True),
              LoraConfig(r=4, lora_dropout=0.1)]  # other adapter modules each time: guards that cannot pass
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for config in setups:
            model = make_lora_model(config=config, n_double=1, n_single=1)
            with MemoryRuntime(model, strategy, "cpu") as rt:
                train_steps(model, steps=1, runtime=rt)
                with torch.no_grad():  # a validation pass
                    model(**make_batch(seed=7)[0])


def test_undo_completes_when_dropping_the_graphs_fails(monkeypatch):
    """CompileCaches reads dynamo internals: if they change under it, the undo must still give the model back (found
    by a review: the rest of undo was skipped, the runtime left applied)."""
    model = make_lora_model(n_double=1, n_single=1)
    strategy = Strategy.of(compile="per_block", compile_backend="aot_eager_decomp_partition", compute_dtype="fp32",
                           offload_fraction=1.0)
    rt = MemoryRuntime(model, strategy, "cpu")
    rt.apply()
    monkeypatch.setattr(block_compile, "_entry_counts", lambda: 1 / 0)
    with pytest.warns(UserWarning, match=r"could not count this run's compiled graphs \(ZeroDivisionError"):
        rt.undo()
    assert not rt.applied and rt.offload is None and not any("forward" in m.__dict__ for m in model.modules())
    assert torch._dynamo.config.recompile_limit == 8


def test_compile_mode_options_reach_the_backward(monkeypatch):
    """AOTAutograd compiles the backward lazily, at the first backward: the mode's inductor options must be in
    force then too, not only while the forward compiles."""
    import torch._inductor.compile_fx as compile_fx
    import torch._inductor.config as inductor_config
    seen = []
    real_inner = compile_fx._compile_fx_inner

    def spy(gm, example_inputs, **kwargs):
        seen.append((kwargs.get("is_backward"), inductor_config.size_asserts))
        return real_inner(gm, example_inputs, **kwargs)

    monkeypatch.setattr(block_compile, "_BACKENDS", {})
    monkeypatch.setattr(compile_fx, "_compile_fx_inner", spy)
    # a stand-in mode whose one option is cheap to compile and easy to read back (the default is True)
    monkeypatch.setattr(torch._inductor, "list_mode_options", lambda mode: {"size_asserts": False})
    torch._dynamo.reset()
    model = make_lora_model(n_double=0, n_single=1)
    strategy = Strategy.of(compile="per_block", compile_mode="max-autotune-no-cudagraphs", compute_dtype="fp32",
                           block_lists=("single_blocks",))
    # torch's own config.patch, not monkeypatch.setattr: pytest >= 9.2 undoes that with delattr, which hides the key
    # (compile_threads: no worker pool to start; no fx graph / autograd cache hit to skip the compile we watch)
    with inductor_config.patch(compile_threads=1, fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False), MemoryRuntime(model, strategy, "cpu"):
        train_steps(model, steps=1)
    assert inductor_config.size_asserts, "the option leaked out of the compile"
    assert sorted(seen) == [(False, False), (True, False)], f"(is_backward, size_asserts) per compile: {seen}"


class _InPlaceResidual(torch.nn.Module):
    """A block shaped as ComfyUI's Flux blocks: modulation from `vec`, a norm of a copy of the input (as the ComfyUI
    adapter's norm guard makes them, models/comfy.py, so eager trains), the residual added in place (`x += ...`)."""

    def __init__(self):
        super().__init__()
        self.linear, self.mod = torch.nn.Linear(8, 8), torch.nn.Linear(8, 16)
        setattr(self, MUTATES_INPUTS, True)  # as the ComfyUI adapter marks its blocks

    def forward(self, x, vec):
        shift, gate = self.mod(vec).chunk(2, -1)
        x += gate * self.linear(torch.nn.functional.layer_norm(x.clone(), (8,)) + shift)
        return x


class _InPlaceModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([_InPlaceResidual() for _ in range(3)])

    def forward(self, x, vec):
        x = x * 1.0  # the first block must not write into the caller's tensor
        for block in self.blocks:
            x = block(x, vec)
        return x


def test_compiled_blocks_that_add_residuals_in_place_train_without_checkpointing():
    """The partitioner saves a graph input rather than its copy (free memory), and a block mutating its input in place
    then changes it after it was saved: without checkpointing, backward failed ("modified by an inplace operation";
    ComfyUI's Flux with compile=per_block). Each compiled block now works on copies of its inputs, as in eager."""
    g = torch.Generator().manual_seed(1)
    x, vec = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    grads = []
    for compiled in (False, True):
        model = _InPlaceModel()
        strategy = Strategy.of(compile="per_block" if compiled else "off", compute_dtype="fp32",
                               compile_backend="aot_eager_decomp_partition")
        with MemoryRuntime(model, strategy, "cpu") as rt:
            model(x.clone(), vec).square().sum().backward()
            assert (rt.counters()["graphs"] > 0) == compiled
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert _InPlaceResidual not in mutating_blocks._BREAKING  # one graph, the copies inside it
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)  # fp32, another operation order


def _graphs() -> int:
    return block_compile.compiled_graph_count()


@pytest.mark.parametrize("model_kind", ["two_stream", "in_place"])
def test_a_chain_of_runtimes_compiles_the_blocks_once(monkeypatch, model_kind):
    """Chained Train nodes in ComfyUI apply the strategy, train, undo it, and the next node applies it again: the
    graphs compiled by the first runtime serve every later one of the same setup, on the same model (a chain link) and
    on another model of the same architecture (the next prompt), with the same results as a fresh compile. (The undo
    dropped them: every chain link compiled every block type again, seconds to minutes each with inductor on a GPU.)
    `in_place`: blocks marked MUTATES_INPUTS, compiled through the runtime's input-copying wrapper."""
    monkeypatch.setattr(block_compile, "_BACKENDS", {})  # graphs of earlier tests are not this test's
    strategy = Strategy.of(compile="per_block", compile_backend="aot_eager_decomp_partition", compute_dtype="fp32",
                           activation_memory_budget=0.5, offload_fraction=0.5)
    g = torch.Generator().manual_seed(1)
    x, vec = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)

    def make():
        return make_lora_model(n_double=2, n_single=2) if model_kind == "two_stream" else _InPlaceModel()

    def run(model):
        with MemoryRuntime(model, strategy, "cpu") as rt:
            if model_kind == "two_stream":
                losses, grads = train_steps(model, steps=1, runtime=rt)
                return losses, grads[0]
            model(x.clone(), vec).square().sum().backward()
            return [], {n: p.grad.clone() for n, p in model.named_parameters()}

    compiled, results = [], []
    model = make()
    for m in (model, model, make()):  # first link, next link, a new prompt's model
        before = _graphs()
        results.append(run(m))
        compiled.append(_graphs() - before)
    assert compiled[0] > 0 and compiled[1:] == [0, 0], f"graphs compiled per runtime: {compiled}"
    fresh = make()
    monkeypatch.setattr(block_compile, "_BACKENDS", {})  # the same run compiled anew
    expected = run(fresh)
    assert results[2][0] == expected[0]
    assert all(torch.equal(results[2][1][n], v) for n, v in expected[1].items())


def test_graphs_kept_between_runtimes_hold_no_model(monkeypatch):
    """The graphs stay cached after undo, not the model they were compiled on: a model the user drops (ComfyUI
    unloads it, loads another) is freed, its compiled graphs kept for the next model of that architecture."""
    import gc
    import weakref
    monkeypatch.setattr(block_compile, "_BACKENDS", {})
    strategy = Strategy.of(compile="per_block", compile_backend="aot_eager_decomp_partition", compute_dtype="fp32",
                           offload_fraction=0.5, activation_offload=True, checkpoint="all")
    model = make_lora_model(n_double=1, n_single=1)
    with MemoryRuntime(model, strategy, "cpu", activation_min_bytes=0) as rt:
        train_steps(model, steps=1, runtime=rt)
    refs = [weakref.ref(model)] + [weakref.ref(p) for p in model.parameters()]
    del model, rt
    gc.collect()
    assert all(r() is None for r in refs), "a dropped model is kept alive by its compiled graphs"
    before = _graphs()
    model = make_lora_model(n_double=1, n_single=1, seed=3)
    with MemoryRuntime(model, strategy, "cpu", activation_min_bytes=0) as rt:
        train_steps(model, steps=1, runtime=rt)
    assert _graphs() == before, "the next model of the architecture compiled again"


def test_a_users_own_compile_of_the_block_class_is_left_alone(monkeypatch):
    """A ComfyUI user compiles the same block class for inference (a per-block compile node): a training run must
    neither drop those graphs (the undo reset the class's code object: the user's next image compiled again) nor
    leave its own graphs on it (they count against that code object's recompile limit, 8)."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    from two_stream import SingleBlock
    monkeypatch.setattr(block_compile, "_BACKENDS", {})
    user_block = make_lora_model(n_double=0, n_single=1, seed=5).single_blocks[0]
    user_compiled = torch.compile(user_block, backend="eager")
    x, vec, pe = torch.randn(2, 6, 32), torch.randn(2, 32), torch.ones(6, 16)
    with torch.no_grad():
        user_compiled(x.clone(), vec=vec, pe=pe)
    code = SingleBlock.forward.__code__
    user_entries = len(_debug_get_cache_entry_list(code))
    strategy = Strategy.of(compile="per_block", compile_backend="aot_eager_decomp_partition", compute_dtype="fp32")
    model = make_lora_model(n_double=1, n_single=1)
    with MemoryRuntime(model, strategy, "cpu") as rt:
        train_steps(model, steps=1, runtime=rt)
    assert len(_debug_get_cache_entry_list(code)) == user_entries > 0, "the user's graphs were dropped or joined"
    before = _graphs()
    with torch.no_grad():
        user_compiled(x.clone(), vec=vec, pe=pe)
    assert _graphs() == before, "the user's compiled block compiled again after a training run"


def test_kept_graphs_are_bounded(monkeypatch):
    """A code object the runtimes compiled on keeps fewer than KEEP_LIMIT entries into the next runtime (its graphs
    are dropped at apply past that, then compiled again), so a run always has room under the recompile limit."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    monkeypatch.setattr(block_compile, "_BACKENDS", {})
    monkeypatch.setattr(block_compile, "KEEP_LIMIT", 1)
    strategy = Strategy.of(compile="per_block", compile_backend="aot_eager_decomp_partition", compute_dtype="fp32",
                           block_lists=("single_blocks",))
    compiled = []
    for _ in range(2):
        model = make_lora_model(n_double=0, n_single=1)
        before = _graphs()
        with MemoryRuntime(model, strategy, "cpu") as rt:
            train_steps(model, steps=1, runtime=rt)
            compiled.append(_graphs() - before)
    assert compiled == [1, 1], f"graphs compiled per runtime with KEEP_LIMIT=1: {compiled}"
    assert max(len(_debug_get_cache_entry_list(ref())) for ref in block_compile._COMPILED_ON.values()
               if ref() is not None) <= 1


@pytest.mark.parametrize("hooked_first", [False, True])
def test_a_kept_graph_is_not_reused_where_hooks_inside_the_blocks_differ(monkeypatch, hooked_first):
    """Dynamo skips guards on nn.Module hooks by default (skip_nnmodule_hook_guards): a graph kept from a runtime whose
    blocks' layers had no forward hook ran for the next prompt's model that has one (a ComfyUI node's hook), and the
    other way round, computing what a fresh process would not."""
    monkeypatch.setattr(block_compile, "_BACKENDS", {})
    strategy = Strategy.of(compile="per_block", compile_backend="aot_eager", compute_dtype="fp32",
                           block_lists=("blocks",))
    x = torch.randn(3, 8)

    def make(hooked):
        model = _InPlaceModel()
        if hooked:
            for block in model.blocks:
                block.linear.register_forward_hook(lambda m, i, o: o * 10)
        return model

    for hooked in (hooked_first, not hooked_first):
        model = make(hooked)
        with torch.no_grad():
            expected = model(x.clone(), x)
            with MemoryRuntime(model, strategy, "cpu"):
                got = model(x.clone(), x)
        torch.testing.assert_close(got, expected)


class _BreakingInPlaceResidual(_InPlaceResidual):
    """_InPlaceResidual with a graph break between its norm and its in-place residual, as ComfyUI's Flux blocks break
    where its attention asks psutil for free memory (sub-quadratic attention: the CPU's, or --use-quad-cross-attention
    / --use-split-cross-attention on a GPU)."""

    def forward(self, x, vec):
        shift, gate = self.mod(vec).chunk(2, -1)
        h = self.linear(torch.nn.functional.layer_norm(x.clone(), (8,)) + shift)
        torch._dynamo.graph_break()
        x += gate * h
        return x


@pytest.mark.parametrize("offload_fraction", [0.0, 1.0])
def test_compiled_blocks_that_break_their_graph_before_an_in_place_residual_train_as_eager(offload_fraction):
    """A graph break inside the block splits it into graphs: the copies of its inputs are made before the break
    (dynamo runs the cloning wrapper eagerly), the partitioner of the graph before the break saves a copy (its input,
    free) and the graph after the break adds the residual to that same tensor (its input, copied back in place).
    Autograd refused ("modified by an inplace operation": ComfyUI's Flux on the CPU), or, where saved-tensor hooks
    skip its version check (layer offload's, on ComfyUI's Flux), the graph before the break ran its backward on the
    changed tensor: wrong gradients without a word. Such a block is now compiled in pieces, on copies made eagerly
    and saved as copies (memory/mutating_blocks.py)."""
    g = torch.Generator().manual_seed(1)
    x, vec = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    grads = []
    for compiled in (False, True):
        model = _InPlaceModel()
        for block in model.blocks:
            block.__class__ = _BreakingInPlaceResidual
        strategy = Strategy.of(compile="per_block" if compiled else "off", compute_dtype="fp32",
                               compile_backend="aot_eager_decomp_partition", offload_fraction=offload_fraction)
        with MemoryRuntime(model, strategy, "cpu") as rt:
            model(x.clone(), vec).square().sum().backward()
            assert (rt.counters()["graphs"] > 0) == compiled
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert _BreakingInPlaceResidual in mutating_blocks._BREAKING  # found breaking at its whole-graph trace
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)  # fp32, another operation order


def test_a_block_compiled_whole_runs_eagerly_past_the_recompile_limit():
    """A block marked MUTATES_INPUTS is compiled with fullgraph=True, under which dynamo raises at its recompile limit
    where it would otherwise run the frame eagerly: the block then runs eagerly on copies of its inputs, as before."""
    block = _InPlaceResidual()
    m = mutating_blocks.MutatingBlock(block.forward, Strategy.of(
        compile="per_block", compile_backend="aot_eager_decomp_partition").compiler, _InPlaceResidual)
    with torch._dynamo.config.patch(recompile_limit=1, automatic_dynamic_shapes=False):
        for n in (2, 3):  # the second shape is past the limit
            x, vec = torch.randn(n, 8, requires_grad=True), torch.randn(n, 8)
            expected = x.detach() + 0.0
            expected = block(expected, vec)
            got = m(x, vec)
            got.sum().backward()
            assert x.grad is not None
            torch.testing.assert_close(got, expected)


@torch.compiler.disable(recursive=False)  # this frame eager, the frames it calls compiled: as dynamo runs a frame it
def _eager_attention(h, w):               # cannot trace (its autograd ops save tensors from eager code)
    torch._dynamo.graph_break()
    return torch.tanh(h @ w)


class _PartlyEagerInPlaceResidual(_InPlaceResidual):
    def forward(self, x, vec):
        shift, gate = self.mod(vec).chunk(2, -1)
        x += gate * _eager_attention(torch.nn.functional.layer_norm(x.clone(), (8,)) + shift, self.linear.weight)
        return x


def test_the_hooks_of_a_block_compiled_in_pieces_are_not_compiled_at_each_call():
    """Autograd calls the pieces' pack hook from the block's eager parts too, where dynamo compiles the frames called:
    it compiled the hook, whose closure (the copies' storages) is new at each block call, so again at every call
    (0.3 s a step on this toy model) until the recompile limit. The hooks are never traced now."""
    from torch._dynamo.convert_frame import input_codes
    torch._dynamo.reset()
    model = _InPlaceModel()
    for block in model.blocks:
        block.__class__ = _PartlyEagerInPlaceResidual
    strategy = Strategy.of(compile="per_block", compute_dtype="fp32", compile_backend="aot_eager_decomp_partition",
                           offload_fraction=1.0, activation_offload=True, activation_memory_budget=0.5)
    g = torch.Generator().manual_seed(1)
    with MemoryRuntime(model, strategy, "cpu"):
        for _ in range(3):
            model(torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)).square().sum().backward()
    assert _PartlyEagerInPlaceResidual in mutating_blocks._BREAKING
    traced = [c.co_name for c in (ref() for ref in list(input_codes.seen))
              if c is not None and c.co_filename == mutating_blocks.__file__ and c.co_name != "cloned"]
    assert not traced, f"dynamo traced {traced}"

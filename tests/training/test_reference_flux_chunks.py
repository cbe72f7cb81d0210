"""Token-chunked forwards of the reference Flux blocks (training/models/reference_flux_chunks.py): the same values
and gradients as the plain blocks, a smaller working set, and correct under the runtime with every block streamed
through poisoned slots."""
import collections
import contextlib
import weakref

import pytest
import torch
from peft import LoraConfig, inject_adapter_in_model
from tiny_flux import flux_inputs, tiny_flux
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from tightrope.memory import runtime as runtime_module
from tightrope.memory.runtime import MemoryRuntime
from tightrope.memory.shape_profile import measure_block
from tightrope.memory.strategy import Strategy
from tightrope.memory.token_chunks import ChunkContext, chunked_forward_for
from tightrope.training.lora import linear_columns
from tightrope.training.lora.layers import LoraSpec, inject_lora, lora_parameters
from tightrope.training.models import reference_flux_chunks
from tightrope.training.models.reference_flux import DoubleStreamBlock, EmbedND, SingleStreamBlock

N_TXT, N_IMG, HIDDEN = 5, 13, 128  # the tiny Flux: head dim 128, axes (16, 56, 56)


def lora_flux(dropout=0.0):
    model = tiny_flux()
    torch.manual_seed(2)  # peft draws the A factors from the global generator
    inject_lora(model, LoraSpec(rank=4, dropout=dropout), "flux")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # B starts at zero: make every LoRA factor matter, so each one gets a gradient
        for p in lora_parameters(model).values():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


def block_inputs(kind, g):
    pe = EmbedND(128, 10000, (16, 56, 56))(torch.randint(0, 20, (1, N_TXT + N_IMG, 3), generator=g).float())
    vec = torch.randn(1, HIDDEN, generator=g)
    if kind == "double":
        return {"img": torch.randn(1, N_IMG, HIDDEN, generator=g), "txt": torch.randn(1, N_TXT, HIDDEN, generator=g),
                "vec": vec, "pe": pe}
    return {"x": torch.randn(1, N_TXT + N_IMG, HIDDEN, generator=g), "vec": vec, "pe": pe}


def outputs_and_grads(block, inputs, chunks):
    """Outputs, and gradients of every tensor input (pe is a constant) and LoRA parameter, of a fixed weighted sum."""
    kw = {k: v.detach().clone().requires_grad_(k != "pe") for k, v in inputs.items()}
    out = chunked_forward_for(block)(block, ChunkContext(chunks, plain=block.forward), **kw) if chunks else block(**kw)
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(9)
    loss = sum((o * torch.randn(o.shape, generator=g)).sum() for o in outs)
    wrt = [v for k, v in kw.items() if k != "pe"] + [p for p in block.parameters() if p.requires_grad]
    return outs, torch.autograd.grad(loss, wrt)


@pytest.mark.parametrize("kind", ["double", "single"])
def test_chunked_blocks_equal_the_plain_blocks_values_and_gradients(kind):
    model = lora_flux()
    block = model.double_blocks[0] if kind == "double" else model.single_blocks[0]
    assert chunked_forward_for(block) is not None  # registered by importing reference_flux
    inputs = block_inputs(kind, torch.Generator().manual_seed(4))
    ref_out, ref_grads = outputs_and_grads(block, inputs, 0)
    n_lora = sum(1 for n, p in block.named_parameters() if "lora_" in n and p.requires_grad)
    assert n_lora >= 4 and len(ref_grads) == len(inputs) - 1 + n_lora  # every tensor input and LoRA factor
    # 3 and 4 do not divide 13 image / 18 tokens (the 5 text tokens: 1 chunk, 2 chunks of 3 and 2: stream_slices);
    # 40 is more chunks than tokens (one token each)
    for chunks in (1, 3, 4, 40):
        out, grads = outputs_and_grads(block, inputs, chunks)
        # fp32, the same per-token ops on the same values: only the BLAS may block a product over fewer rows
        # differently. Measured: <= 3.4e-6 absolute on outputs of order 5, <= 1.1e-6 of the largest gradient
        # entry; 1e-5 of the largest entry is ~50 ulp of it, while a wrong slice of pe or of a stream is O(1).
        for a, b in zip(out + grads, ref_out + ref_grads):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item(),
                                       msg=lambda m: f"{kind}, {chunks} chunks: {m}")


@pytest.mark.parametrize("kind", ["double", "single"])
def test_chunks_cut_the_blocks_forward_backward_peak(kind):
    """fp32, 1024 tokens of width 128 (H = one tokens x hidden tensor). The plain block holds whole-sequence
    token-wise tensors the chunked one holds one chunk at a time: the single block its linear1 output (7H) and
    linear2's input (5H), the double block its qkv outputs (3H), MLP hidden and activation (8H) and modulated
    inputs (H): at least 12H over forward and backward. At 8 chunks one chunk's share of them and their gradients
    is at most 2 x 12H / 8 = 3H, and both keep q, k, v and attention's output whole: the peak must fall by 12H - 3H
    = 9H at least (measured: 11-15 H)."""
    torch.manual_seed(0)
    n, h = 1024, 128
    block = (DoubleStreamBlock(h, 1, 4.0, qkv_bias=True) if kind == "double" else SingleStreamBlock(h, 1)).eval()
    pe = EmbedND(128, 10000, (16, 56, 56))(torch.randint(0, 50, (1, n, 3)).float())
    if kind == "double":
        args, kwargs = (), {"img": torch.randn(1, n - 128, h, requires_grad=True),
                            "txt": torch.randn(1, 128, h, requires_grad=True), "vec": torch.randn(1, h), "pe": pe}
    else:
        args, kwargs = (torch.randn(1, n, h, requires_grad=True),), {"vec": torch.randn(1, h), "pe": pe}
    ctx = ChunkContext(8, plain=block.forward)

    def chunked(*a, **k):
        return chunked_forward_for(block)(block, ctx, *a, **k)

    params = list(block.parameters())
    plain = measure_block(block, args, kwargs, params, contextlib.nullcontext(), compute_dtype=None)
    small = measure_block(chunked, args, kwargs, params, contextlib.nullcontext(), compute_dtype=None)
    H = n * h * 4
    assert small.peak <= plain.peak - 9 * H, (plain.peak / H, small.peak / H)


def forward_flops_without_attention(forward, *args, **kwargs) -> int:
    with FlopCounterMode(display=False) as counter:
        forward(*args, **kwargs)
    return sum(n for op, n in counter.get_flop_counts()["Global"].items() if "scaled_dot_product" not in str(op))


@pytest.mark.parametrize("lora", [False, True], ids=["no LoRA", "LoRA on linear1"])
def test_the_chunked_single_block_computes_linear1_once(lora):
    """Per token, forward matmul FLOPs of a single block of hidden h: linear1 2h x 7h, linear2 2 x 5h x h (plus the
    modulation, once per block either way). Each chunked pass computes only its own linear1 columns (qkv, then
    MLP): the same FLOPs as the plain block, where computing linear1 whole in both passes would add 2h x 7h per
    token (38h^2 vs 24h^2: +58 %). With a rank-r LoRA on linear1, B's rows split the same way, and only its A factor
    (2rh per token) runs once per pass: exactly that much more. Attention is whole-sequence in both."""
    n, h, r = 64, 128, 4
    block = SingleStreamBlock(h, 1)
    if lora:
        inject_adapter_in_model(LoraConfig(r=r, target_modules=["linear1"]), block)
    pe = EmbedND(128, 10000, (16, 56, 56))(torch.randint(0, 50, (1, n, 3)).float())
    x, vec = torch.randn(1, n, h, requires_grad=True), torch.randn(1, h)
    plain = forward_flops_without_attention(block, x, vec, pe)
    chunked = forward_flops_without_attention(chunked_forward_for(block), block, ChunkContext(4), x, vec, pe)
    assert plain > 2 * n * h * 12 * h  # linear1 and linear2 are counted
    assert chunked == plain + (2 * n * r * h if lora else 0), chunked / plain


class WholeSequenceOps(TorchDispatchMode):
    """Counts, per aten op, the results that have a dimension of one of `lengths` (a whole stream or sequence), and
    the inputs of such concatenations that are views into larger buffers."""

    def __init__(self, lengths):
        super().__init__()
        self.lengths, self.ops, self.wide_inputs = set(lengths), collections.Counter(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.update(str(func) for t in tree_leaves(out)
                        if isinstance(t, torch.Tensor) and self.lengths.intersection(t.shape))
        if func is torch.ops.aten.cat.default and self.lengths.intersection(out.shape):
            self.wide_inputs += sum(t.untyped_storage().nbytes() > t.numel() * t.element_size() for t in args[0])
        return out


def whole_sequence_backward(kind, chunks, n_txt=26, n_img=42):
    """One backward of the LoRA block chunked (regions recomputed), counted. 26 text and 42 image tokens, 68 in all:
    no other dimension of the tiny Flux (1, 2, 4, 64, 128, 384, 512, 896) nor any chunk of 2 or 8 chunks equals one
    of these, and the text is cut at both counts (2 and 5 chunks: stream_slices)."""
    block = lora_flux().double_blocks[0] if kind == "double" else lora_flux().single_blocks[0]
    g = torch.Generator().manual_seed(0)
    pe = EmbedND(128, 10000, (16, 56, 56))(torch.randint(0, 20, (1, n_txt + n_img, 3), generator=g).float())
    shapes = {"img": (1, n_img, HIDDEN), "txt": (1, n_txt, HIDDEN)} if kind == "double" else \
        {"x": (1, n_txt + n_img, HIDDEN)}
    kw = {k: torch.randn(shape, generator=g, requires_grad=True) for k, shape in shapes.items()}
    out = chunked_forward_for(block)(block, ChunkContext(chunks), **kw, vec=torch.randn(1, HIDDEN, generator=g), pe=pe)
    loss = sum(o.sum() for o in (out if isinstance(out, tuple) else (out,)))
    with WholeSequenceOps((n_txt, n_img, n_txt + n_img)) as counted:
        loss.backward()
    return counted


@pytest.mark.parametrize("kind", ["double", "single"])
def test_a_chunked_blocks_backward_does_no_more_whole_sequence_work_with_more_chunks(kind):
    """A whole-sequence tensor read in chunks (the block's input by both passes, attention's output by pass 2) is cut
    by one split, not a slice per chunk: each slice's backward zero-fills a whole-sequence gradient and adds it into
    the tensor's, 3 per chunk in a single block and 6 in a double one (on a GPU ~5 % of a step at 8 chunks, and
    growing with the count), where a split's gathers its pieces' gradients at their size and concatenates them
    once. So the ops of a backward whose results span a whole stream or the sequence (attention's backward, the
    loss's, one concatenation per split tensor) are as many at 8 chunks as at 2 (the slices made 101 vs 29 in the
    double block, 52 vs 16 in the single one). And what a split's backward concatenates are buffers of their own:
    autograd holds them until the last piece's arrives, so a view would keep its larger buffer alive meanwhile (the
    single block's pieces of attention's output, views of the gradient of their concatenation with the MLP
    activation, 5 x as wide, raised its peak by 3 x tokens x hidden at 8 chunks before `own_grad`)."""
    two, eight = whole_sequence_backward(kind, 2), whole_sequence_backward(kind, 8)
    assert sum(eight.ops.values()) == sum(two.ops.values()), (dict(two.ops), dict(eight.ops))
    assert eight.ops["aten.slice_backward.default"] == 0, dict(eight.ops)
    assert two.wide_inputs == eight.wide_inputs == 0


# -- under the runtime -------------------------------------------------------------------------------------------------
def train(strategy=None, steps=2, runtime_patch=None, device="cpu", dropout=0.0):
    """Losses and LoRA gradients (on the CPU) of `steps` AdamW steps of the tiny LoRA Flux, plain or under `strategy`
    on `device`."""
    model = lora_flux(dropout)
    params = lora_parameters(model)
    opt = torch.optim.AdamW(params.values(), lr=1e-2)
    losses, grads = [], []
    with (MemoryRuntime(model, strategy, device, poison_slots=True, activation_min_bytes=0) if strategy
          else contextlib.nullcontext()) as rt:
        for step in range(steps):
            if rt:
                rt.start_step()
            loss = model.forward_latent(*(t.to(device) for t in flux_inputs(seed=10 + step))).square().mean()
            loss.backward()
            if rt:
                rt.end_step()
            losses.append(loss.item())
            grads.append({n: p.grad.detach().cpu().clone() for n, p in params.items()})
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert not any("forward" in m.__dict__ for m in model.modules())  # undone: the blocks' own forwards again
    return losses, grads


CHUNKED = {
    "offload 1.0 + checkpoint all + activation offload + 4 chunks": Strategy.of(
        compute_dtype="fp32", offload_fraction=1.0, checkpoint="all", activation_offload=True, token_chunks=4),
    "offload 1.0, depth 0, chunks alone (no checkpointing)": Strategy.of(
        compute_dtype="fp32", offload_fraction=1.0, prefetch_depth=0, token_chunks=4),
}


@pytest.mark.parametrize("name", list(CHUNKED))
def test_a_chunked_run_under_the_runtime_equals_plain_pytorch(name, monkeypatch):
    regions, whole_linear1 = [], []
    real = runtime_module.recompute_region
    monkeypatch.setattr(runtime_module, "recompute_region", lambda f, *a: regions.append(f) or real(f, *a))
    ref_losses, ref_grads = train()
    full = linear_columns.full_columns
    monkeypatch.setattr(linear_columns, "full_columns", lambda *a: whole_linear1.append(1) or full(*a))
    losses, grads = train(CHUNKED[name])
    # the single blocks' LoRA linear1 by weight rows, whose row slices of offloaded (poisoned) slots autograd saves
    assert whole_linear1 == []
    # 2 blocks of each type; a double block runs 2 passes x (text + image chunks), a single block 2 x its chunks
    # (6 image tokens in 4 chunks of at most 2, so 3 text tokens in 2; 9 tokens in 4): (2 x (2 + 4) x 2 + 2 x 4 x 2)
    # regions per forward, 2 steps
    assert len(regions) >= 2 * (2 * 2 * 6 + 2 * 2 * 4)
    # fp32: the same ops on the same values, recomputed in chunks; 1e-5 covers the BLAS blocking (see above)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for step, (g, rg) in enumerate(zip(grads, ref_grads)):
        for n in rg:
            torch.testing.assert_close(g[n], rg[n], rtol=1e-5, atol=1e-5 * rg[n].abs().max().item(),
                                       msg=lambda m: f"{name} step {step} grad {n}: {m}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA kernels and streams need a CUDA device")
@pytest.mark.parametrize("name", list(CHUNKED))
def test_a_chunked_run_on_cuda_equals_the_cpu_reference(name):
    """The real thing (run by `make gpu-check`): the reference Flux's chunked blocks (RoPE rows per chunk, linear1 by
    weight rows of poisoned offloaded slots, CUDA attention on the concatenated chunks) streamed through the copy
    stream, against plain PyTorch on the CPU. fp32 with TF32 off: only the summation order differs (cuBLAS/SDPA vs
    CPU kernels, ~1e-6 relative per op over ~20 ops per pass); 1e-4 relative leaves ~5x above that (as
    bench/cuda_checks.py argues for its matrix), while a stale or poisoned slot is off by O(1) or NaN."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        ref_losses, ref_grads = train()
        losses, grads = train(CHUNKED[name], device="cuda")
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5)
    for step, (g, rg) in enumerate(zip(grads, ref_grads)):
        for n in rg:
            torch.testing.assert_close(g[n], rg[n], rtol=1e-4, atol=1e-4 * rg[n].abs().max().item(),
                                       msg=lambda m: f"{name} step {step} grad {n}: {m}")


def test_a_chunk_recomputed_in_backward_loads_its_block_first(monkeypatch):
    """Negative control: chunks run as plain recompute regions that do not enter their block (the default
    ChunkContext.run) read, when recomputed in backward, whatever the poisoned slots hold by then: NaN gradients.
    The equality above therefore depends on the runtime's chunk regions loading the block."""
    monkeypatch.setattr(MemoryRuntime, "_chunk_context", lambda self, index, plain, **kw: ChunkContext(
        self.strategy.checkpointing.token_chunks, plain=plain))
    losses, grads = train(CHUNKED["offload 1.0, depth 0, chunks alone (no checkpointing)"], steps=1)
    assert all(torch.isfinite(torch.tensor(losses)))  # the forward ran with each block loaded
    assert any(torch.isnan(g).any() for g in grads[0].values())


@pytest.mark.parametrize("checkpointed", [True, False])
def test_a_checkpointed_block_runs_its_output_chunks_twice_not_three_times(checkpointed, monkeypatch):
    """Under the runtime a checkpointed block is its own checkpoint, whose recompute in backward only rebuilds what
    the block saved: the q, k, v regions (attention saves their results) run in forward, in that recompute and for
    their own backward; the output regions (output projection, MLP, gates, residual), whose results only make the
    block's output, in forward and for their own backward only (a third run was a third of a checkpointed chunked
    block's forward work). Without the block's checkpoint nothing is recomputed but the regions themselves."""
    runs = {"qkv": 0, "out": 0}

    def counted(factory, kind):
        def make(*a):
            f = factory(*a)

            def g(*args):
                runs[kind] += 1
                return f(*args)
            return g
        return make
    for name, kind in (("_double_qkv", "qkv"), ("_single_qkv", "qkv"), ("_double_out", "out"), ("_single_out", "out")):
        monkeypatch.setattr(reference_flux_chunks, name, counted(getattr(reference_flux_chunks, name), kind))
    strategy = Strategy.of(compute_dtype="fp32", offload_fraction=1.0, token_chunks=4,
                           checkpoint="all" if checkpointed else "off")
    train(strategy, steps=1)
    regions = 2 * (2 + 4) + 2 * 4  # per pass: 2 double blocks (2 text + 4 image chunks), 2 single blocks (4 chunks)
    assert runs == {"qkv": (3 if checkpointed else 2) * regions, "out": 2 * regions}


@pytest.mark.parametrize("kind", ["double", "single"])
def test_the_pass_one_chunks_are_freed_before_the_output_regions_run(kind):
    """Attention's whole q, k, v hold the values of pass 1's per-chunk q, k, v: the chunks must die before pass 2,
    or they stay alive (3 x tokens x hidden) through the output regions, in forward and in the block's checkpoint
    recompute in backward (the double block kept them: its backward peak at 8 chunks was 12.96 H, 11.02 H without;
    H = tokens x hidden x 4 bytes, fp32, 2176 tokens of width 256)."""
    block = lora_flux().double_blocks[0] if kind == "double" else lora_flux().single_blocks[0]
    chunks, alive = [], []

    def run(f, *args):  # the reference blocks' regions are pass 1 only: one chunk's (q, k, v)
        out = f(*args)
        chunks.extend(weakref.ref(t) for t in out)
        return out

    def run_output(f, *args):
        alive.append(sum(ref() is not None for ref in chunks))
        return f(*args)

    kw = {k: v.requires_grad_(k != "pe") for k, v in block_inputs(kind, torch.Generator().manual_seed(0)).items()}
    chunked_forward_for(block)(block, ChunkContext(3, run=run, plain=block.forward, output_region=run_output), **kw)
    n_regions = 1 + 3 if kind == "double" else 3  # the 5 text tokens are one chunk beside 13 image tokens in 3
    assert len(chunks) == 3 * n_regions and len(alive) == n_regions
    assert alive == [0] * len(alive)


def test_with_lora_dropout_every_recompute_redraws_the_forwards_masks(monkeypatch):
    """LoRA dropout 0.5 (linear1 included): chunked blocks draw their masks per region (not the plain forward's draws),
    so the reference here is the same chunked forward with nothing recomputed (regions and blocks run once, backward
    reads what the forward saved). Checkpoint all recomputes each block in backward (its output regions skipped) and
    each region again for its own backward: each must restore the RNG state it began with, or its masks, and so its
    gradients, differ from the forward's by O(1). fp32: 1e-5 as above."""
    chunks_only = Strategy.of(compute_dtype="fp32", offload_fraction=1.0, token_chunks=4)
    real = runtime_module.recompute_region
    monkeypatch.setattr(runtime_module, "recompute_region", lambda f, *a: f(*a))
    ref_losses, ref_grads = train(chunks_only, dropout=0.5)
    monkeypatch.setattr(runtime_module, "recompute_region", real)
    losses, grads = train(CHUNKED["offload 1.0 + checkpoint all + activation offload + 4 chunks"], dropout=0.5)
    plain_losses, _ = train(dropout=0.5)
    assert all(abs(a - b) > 1e-4 for a, b in zip(plain_losses, ref_losses))  # the masks do differ from the plain's
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for step, (g, rg) in enumerate(zip(grads, ref_grads)):
        for n in rg:
            torch.testing.assert_close(g[n], rg[n], rtol=1e-5, atol=1e-5 * rg[n].abs().max().item(),
                                       msg=lambda m: f"step {step} grad {n}: {m}")

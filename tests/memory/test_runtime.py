"""Placement, undo, the memory model and the compile budget."""
import pytest
import torch
import torch.nn.functional as F
from equivalence import run_managed
from two_stream import make_batch, make_lora_model

from tightrope.memory.ema import CpuEma
from tightrope.memory.runtime import MemoryRuntime
from tightrope.memory.strategy import Strategy, StrategyError


@pytest.mark.parametrize("kw", [{}, {"offload_fraction": 0.5}, {"offload_fraction": 1.0, "prefetch_depth": 2},
                                {"offload_blocks": (0, 5)}, {"offload_fraction": 1.0, "prefetch_depth": 8}])
def test_predicted_weight_bytes_match_the_device(kw):
    model = make_lora_model()
    with MemoryRuntime(model, Strategy.of(**kw), "cpu") as rt:
        assert rt.predicted_weight_bytes() == rt.device_weight_bytes()
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    if kw.get("offload_fraction") == 1.0 and kw.get("prefetch_depth") == 2:
        assert rt.predicted_weight_bytes() < 0.7 * full  # three slots for six blocks


def test_undo_gives_the_model_back():
    model = make_lora_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    forwards = {n: m.__dict__.get("forward") for n, m in model.named_modules()}
    inputs, target = make_batch()
    with MemoryRuntime(model, Strategy.of(offload_fraction=1.0, checkpoint="all", compute_dtype="fp32"), "cpu"):
        F.mse_loss(model(**inputs), target).backward()
        assert any("forward" in m.__dict__ for m in model.modules())
    after = dict(model.named_parameters())
    for n, p in before.items():
        torch.testing.assert_close(after[n].detach(), p, rtol=0, atol=0)
        assert after[n].is_contiguous() and 0 not in after[n].stride()
    assert {n: m.__dict__.get("forward") for n, m in model.named_modules()} == forwards


def test_undo_after_an_error_inside():
    model = make_lora_model()
    with pytest.raises(ZeroDivisionError):
        with MemoryRuntime(model, Strategy.of(offload_fraction=1.0), "cpu"):
            1 / 0
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_weight_dtype_is_restored_exactly():
    model = make_lora_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with MemoryRuntime(model, Strategy.of(offload_fraction=0.5, weight_dtype="bf16"), "cpu") as rt:
        frozen = [p for p in model.parameters() if not p.requires_grad and p.data.stride() and 0 not in p.stride()]
        assert frozen and all(p.dtype == torch.bfloat16 for p in frozen)
        assert rt.predicted_weight_bytes() == rt.device_weight_bytes()
    for n, p in model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p.detach(), before[n])


def test_cuda_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(StrategyError, match="CUDA is not available: use device 'cpu'"):
        MemoryRuntime(make_lora_model(), Strategy(), "cuda")


def _saved_bytes(strategy):
    model = make_lora_model()
    inputs, target = make_batch()
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with MemoryRuntime(model, strategy, "cpu"):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = F.mse_loss(model(**inputs), target)
        loss.backward()
    return total[0]


def test_fp32_compute_on_half_precision_weights_is_refused_naming_weight_dtype():
    """No autocast at fp32: a model stored in bf16 (weight_dtype 'auto' keeps it) failed in its first matmul with
    torch's "mat1 and mat2 must have the same dtype" (found by a helper fuzzing strategies); weight_dtype='fp32'
    trains; a layer class that casts its weight itself (ComfyUI's) is not refused."""
    model = make_lora_model().to(torch.bfloat16)
    with pytest.raises(StrategyError, match=r"compute_dtype='fp32' with weight_dtype='auto' keeps this model's "
                                            r"bfloat16 weights \(e\.g\. '.+'\), which its layers cannot multiply with "
                                            r"fp32 activations: set weight_dtype='fp32' .* or compute_dtype='bf16'"):
        MemoryRuntime(model, Strategy.of(compute_dtype="fp32"), "cpu")
    with MemoryRuntime(model, Strategy.of(compute_dtype="fp32", weight_dtype="fp32"), "cpu"):
        pass

    class CastingLinear(torch.nn.Linear):
        def forward(self, x):
            return F.linear(x, self.weight.to(x.dtype), self.bias.to(x.dtype))
    casting = make_lora_model().to(torch.bfloat16)
    for m in casting.modules():  # every plain Linear of the model (the LoRA layers' base layers too)
        if type(m) is torch.nn.Linear:
            m.__class__ = CastingLinear
    MemoryRuntime(casting, Strategy.of(compute_dtype="fp32"), "cpu")


def test_activation_memory_budget_reaches_the_compiler():
    """The budget changes what the partitioner saves, also after a graph was compiled under another budget."""
    compiled = dict(compile="per_block", compile_backend="aot_eager_decomp_partition", compute_dtype="fp32")
    full = _saved_bytes(Strategy.of(**compiled))
    half = _saved_bytes(Strategy.of(activation_memory_budget=0.5, **compiled))
    none = _saved_bytes(Strategy.of(activation_memory_budget=0.0, **compiled))
    assert none < half < full
    assert _saved_bytes(Strategy.of(**compiled)) == full
    eager_ckpt = _saved_bytes(Strategy.of(checkpoint="all", compute_dtype="fp32"))
    assert eager_ckpt < none  # eager checkpointing keeps only block inputs


def test_checkpoint_every_second_block_saves_about_half():
    off = _saved_bytes(Strategy.of(compute_dtype="fp32"))
    every2 = _saved_bytes(Strategy.of(checkpoint="every_n", checkpoint_every=2, compute_dtype="fp32"))
    assert 0.35 * off < every2 < 0.75 * off


def test_stats_count_transfers_per_step():
    _, _, counters = run_managed(Strategy.of(offload_fraction=1.0, checkpoint="all", activation_offload=True,
                                             compute_dtype="fp32"), steps=1)
    model = make_lora_model()
    block_bytes = sum(p.numel() * 4 for n, p in model.named_parameters() if "_blocks" in n and not p.requires_grad)
    # forward streams every block in once, backward (recompute) again, except the blocks still resident when
    # backward turns around (depth 1: the last two single blocks, each < 1/6 of the total)
    assert 2 * block_bytes * (1 - 2 / 6) <= counters["h2d_bytes"] < 2 * block_bytes
    assert counters["d2h_bytes"] > 0


def test_cpu_ema():
    p = torch.nn.Parameter(torch.zeros(3))
    ema = CpuEma({"w": p}, decay=0.5)
    with torch.no_grad():
        p.add_(2.0)
    ema.update()  # the first update's decay is warmed up: min(0.5, (1 + 0) / (10 + 0)) = 0.1
    torch.testing.assert_close(ema.state_dict()["w"], torch.full((3,), 1.8))
    ema.update()  # min(0.5, 2 / 11)
    torch.testing.assert_close(ema.state_dict()["w"], torch.full((3,), 2 / 11 * 1.8 + 9 / 11 * 2.0))
    with pytest.raises(ValueError, match="ema decay=1.5"):
        CpuEma({"w": p}, decay=1.5)


def test_a_stop_half_way_through_offloading_device_weights_gives_every_weight_back(monkeypatch):
    """Weights already on the device (a ComfyUI model in VRAM; `meta` stands in for CUDA here) have no host copy
    to keep: undo copies them back from their layout's source. A stop while block 1 is half laid out must still
    give every weight back (it raised KeyError and left a NaN placeholder in place of a weight)."""
    from torch import nn

    from tightrope.memory import layer_offload
    monkeypatch.setattr(layer_offload, "streams_in_place", lambda t, dtype: True)  # no copy from meta is tried
    blocks = [nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).to("meta").requires_grad_(False) for _ in range(2)]
    originals = {id(p): p.data.untyped_storage()._cdata for b in blocks for p in b.parameters()}
    offload = layer_offload.LayerOffload(blocks, [0, 1], torch.device("meta"), prefetch_depth=1, pin_memory=False,
                                         weight_dtype=None)
    made = []

    def placeholder(shape, dtype):
        if len(made) == 5:  # block 1's second param
            raise KeyboardInterrupt
        made.append(torch.empty(shape, dtype=dtype, device="meta"))
        return made[-1]
    monkeypatch.setattr(offload, "_placeholder", placeholder)
    with pytest.raises(KeyboardInterrupt):
        offload.attach()
    offload.detach()
    assert {id(p): p.data.untyped_storage()._cdata for b in blocks for p in b.parameters()} == originals
    assert offload.layouts == {} and offload._restore == []


def test_settings_that_do_nothing_for_this_model_are_said_once():
    """Valid on their own, but nothing to do: activation offload without a checkpointed block, token chunks on blocks
    with no chunked forward. Each used to be silently ignored."""
    import warnings

    from torch import nn

    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x
    with pytest.warns(UserWarning, match=r"activation_offload=True .* no block is checkpointed here: it does nothing; "
                                         "set checkpoint='all'"):
        with MemoryRuntime(make_lora_model(), Strategy.of(compute_dtype="fp32", activation_offload=True), "cpu"):
            pass
    with pytest.warns(UserWarning, match=r"token_chunks=4 does nothing for this model: its blocks \(Linear\) have "
                                         r"no token-chunked forward"):
        with MemoryRuntime(Plain(), Strategy.of(compute_dtype="fp32", token_chunks=4, checkpoint="all",
                                                block_lists=["blocks"]), "cpu"):
            pass
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with MemoryRuntime(make_lora_model(), Strategy.of(compute_dtype="fp32", checkpoint="all",
                                                          activation_offload=True, token_chunks=4), "cpu"):
            pass

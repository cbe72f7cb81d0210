"""Sharding is the memory runtime's first step and its last undo (memory/sharding.py, Strategy.sharding): inside the
runtime the blocks' frozen weights are FSDP2 DTensors of a structural copy that every later step works on; after
it the given model is exactly as it came. One rank in this process (gloo); several ranks: tests/distributed."""
import pytest
import torch
import torch.nn.functional as F
from one_rank_group import one_rank_group
from torch.distributed.tensor import DTensor
from two_stream import make_batch, make_lora_model

from tightrope.memory.runtime import MemoryRuntime
from tightrope.memory.strategy import Strategy, StrategyError


def _loss_and_lora_grads(model, run):
    inputs, target = make_batch()
    with run.autocast():
        loss = F.mse_loss(run.model(**inputs).float(), target)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def test_the_runtime_shards_first_and_undoes_it_last():
    model = make_lora_model()
    before = {n: (type(p), p.dtype, p.detach().clone()) for n, p in model.named_parameters()}
    lora = [p for p in model.parameters() if p.requires_grad]
    plain = Strategy.of(checkpoint="all", compute_dtype="bf16", weight_dtype="bf16")
    with MemoryRuntime(model, plain, "cpu") as run:
        want_loss, want_grads = _loss_and_lora_grads(model, run)
    with one_rank_group() as mesh, MemoryRuntime(model, plain.replace(shard="fsdp"), "cpu", mesh=mesh) as run:
        copy = run.model
        assert copy is not model and [b.module for b in run.blocks] == \
            [b for name in ("double_blocks", "single_blocks") for b in getattr(copy, name)]
        frozen = [p for b in run.blocks for p in b.module.parameters() if not p.requires_grad]
        assert frozen and all(isinstance(p, DTensor) and p.dtype == torch.bfloat16 for p in frozen)
        copy_params = list(copy.parameters())
        assert all(any(q is p for q in copy_params) for p in lora)  # the LoRA is shared, not sharded
        # the later steps ran on the copy: its blocks got the checkpointing forward; the given model's blocks kept
        # theirs and their fp32 weights (placement in weight_dtype bf16 would have changed them had it come first)
        assert all("forward" in b.module.__dict__ for b in run.blocks)
        assert not any("forward" in b.__dict__ for b in model.double_blocks)
        assert model.double_blocks[0].qkv.base_layer.weight.dtype == torch.float32
        assert model.img_in.weight.dtype == torch.bfloat16  # outside the blocks: shared with the copy, placed
        loss, grads = _loss_and_lora_grads(model, run)
    assert run.model is model and run.blocks[0].module is model.double_blocks[0]
    assert "FSDP" not in type(model).__name__ and not any("FSDP" in type(m).__name__ for m in model.modules())
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    for name, (kind, dtype, value) in before.items():
        p = after[name]
        assert type(p) is kind and not isinstance(p.data, DTensor) and p.dtype == dtype, name
        assert torch.equal(p.detach(), value), name
    # one rank all-gathers its own whole shard: the same numbers as the unsharded runtime, bit for bit
    assert loss == want_loss and grads.keys() == want_grads.keys()
    assert all(torch.equal(grads[n], want_grads[n]) for n in grads)


def test_sharding_without_a_mesh_is_refused_before_anything_changes():
    model = make_lora_model()
    with pytest.raises(StrategyError, match=r"Strategy.shard='fsdp' shards the blocks over the data-parallel ranks, "
                       r"but no device mesh was given: launch with `torchrun .* --fsdp` \(or set shard='off'\)"):
        MemoryRuntime(model, Strategy.of(shard="fsdp"), "cpu")


def test_sharded_weights_never_go_through_activation_offload(monkeypatch):
    """Under FSDP2 a block's whole weights are gathered into new storage at each forward, which the parameter
    storages the runtime lists when it applies cannot know. A compiled graph (activation budget < 1) saves views of
    them (a weight's transpose), which would be copied to the host and back every step like activations (found by
    review); the running block's own parameters are checked as well now. A guard over the whole path: on the CPU
    the partitioner saves no view of a weight, so this passed without the check too."""
    from tightrope.memory.activation_offload import ActivationOffload
    sent, real, runs = [], ActivationOffload.pack, []

    def pack(self, t, block):
        out = real(self, t, block)
        if out is not t:
            params = {p.untyped_storage().data_ptr() for p in runs[-1].blocks[block].module.parameters()}
            sent.append(t.untyped_storage().data_ptr() in params)
        return out

    monkeypatch.setattr(ActivationOffload, "pack", pack)
    strategy = Strategy.of(compile="per_block", compile_backend="aot_eager_decomp_partition",
                           activation_memory_budget=0.5, activation_offload=True, compute_dtype="fp32",
                           pin_memory=False, shard="fsdp")
    model = make_lora_model()
    torch._dynamo.reset()
    with one_rank_group() as mesh, MemoryRuntime(model, strategy, "cpu", mesh=mesh, activation_min_bytes=0) as run:
        runs.append(run)
        _loss_and_lora_grads(model, run)
    assert sent and not any(sent), f"{sum(sent)} of {len(sent)} tensors sent to the host were a block's weights"

"""Sharding of the transformer blocks' frozen weights over the data-parallel ranks (FSDP2): the runtime's first step.

`BlockSharding.apply(model)` returns a structural copy of `model` whose blocks' frozen weights are FSDP2-sharded
(`fully_shard`) over a device mesh: each rank keeps 1/N of every block and all-gathers a block just before it runs
(forward, and again in backward), the next block's all-gather overlapping this one's compute. The copy shares every
other parameter with `model` (the LoRA, which stays replicated and is reduced by the caller, and the weights
outside the blocks), so `model` itself is never touched by FSDP and `undo()` only drops the copy. The runtime's
later steps (placement, block forwards) work on the copy.

The mesh comes from the caller (under torchrun: `training/distributed.py`, which owns the process group); this
module imports nothing of `training/`. On the CPU FSDP2 keeps its shards through CPUOffloadPolicy(pin_memory=False)
(pinning needs an accelerator). Per GPU the weights take about `blocks / N + 2 blocks + non-block weights`.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from .blocks import discover_blocks
from .strategy import ShardingConfig, StrategyError
from .tensor_kinds import held_dtype


class BlockSharding:
    def __init__(self, config: ShardingConfig, mesh, device: torch.device, *, weight_dtype: torch.dtype | None,
                 block_lists: tuple[str, ...] | None):
        if mesh is None:
            raise StrategyError(f"Strategy.shard={config.mode!r} shards the blocks over the data-parallel ranks, but "
                                "no device mesh was given: launch with `torchrun --nproc_per_node=N -m tightrope run "
                                "... --fsdp` (or set shard='off')")
        self.config, self.mesh, self.device = config, mesh, device
        self.weight_dtype, self.block_lists = weight_dtype, block_lists
        self.copy: nn.Module | None = None

    def apply(self, model: nn.Module) -> nn.Module:
        """A structural copy of `model` with its blocks' frozen weights sharded; `model` is left as it is."""
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        params = list(model.parameters())
        clone = copy.deepcopy(model, memo={id(p): p for p in params})  # shares every parameter, copies the rest
        trainable = {id(p) for p in params if p.requires_grad}
        policy = CPUOffloadPolicy(pin_memory=False) if self.device.type == "cpu" else OffloadPolicy()
        fresh: dict[int, nn.Parameter] = {}
        blocks = [block.module for block in discover_blocks(clone, self.block_lists)]
        for block in blocks:
            for sub in block.modules():
                for name, p in list(sub._parameters.items()):
                    if p is None or p.requires_grad:
                        continue
                    if id(p) not in fresh:  # FSDP moves and re-registers parameters: give it the copy's own
                        dtype = held_dtype(p, self.weight_dtype) if p.is_floating_point() else p.dtype
                        fresh[id(p)] = nn.Parameter(p.detach().to(self.device, dtype), requires_grad=False)
                    sub._parameters[name] = fresh[id(p)]
            fully_shard(block, mesh=self.mesh, reshard_after_forward=True, offload_policy=policy,
                        ignored_params={p for p in block.parameters() if id(p) in trainable})
            block.register_forward_pre_hook(_own_inputs, with_kwargs=True)  # runs after FSDP's own pre-forward hook
            fresh.clear()  # the full copies of this block are freed once FSDP holds its shard
        _link_blocks(clone, blocks, self.mesh, policy)
        self.copy = clone
        return clone

    def undo(self) -> None:
        """Drop the sharded copy (and with it the shards): the model given to apply() never changed."""
        self.copy = None


def _own_inputs(_block: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The block's tensor inputs as fresh tensors. FSDP2's pre-forward hook passes them through one autograd function
    that returns several views, and autograd forbids in-place ops on those; ComfyUI's blocks add into their inputs in
    place (Flux's DoubleStreamBlock: `img += ...`). One copy of the block's activations per call, only when sharded."""
    def own(value):
        return value.clone() if isinstance(value, torch.Tensor) and value.is_floating_point() else value
    return tuple(own(a) for a in args), {k: own(v) for k, v in kwargs.items()}


def _link_blocks(root: nn.Module, blocks: list[nn.Module], mesh, policy) -> None:
    """One FSDP root over the blocks, holding no parameters itself, so the blocks share one state (streams,
    backward finalisation) and each block's all-gather can be issued while the previous block computes.

    The adapters call the model through methods FSDP's hooks do not see (`forward_latent`, ComfyUI's apply_model),
    so the root's forward never runs and FSDP would make every block a root of its own (no prefetching between
    them). The root's lazy initialisation is therefore run here, through FSDP2's private `_lazy_init` (torch
    2.5-2.13); if that ever goes away the blocks stay separate roots: correct, without the overlap."""
    from torch.distributed.fsdp import fully_shard
    owned = {id(p) for block in blocks for p in block.parameters()}
    fully_shard(root, mesh=mesh, offload_policy=policy,
                ignored_params={p for p in root.parameters() if id(p) not in owned})
    try:
        root._get_fsdp_state()._lazy_init()
    except (AttributeError, RuntimeError):
        return
    for before, after in zip(blocks, blocks[1:]):
        before.set_modules_to_forward_prefetch([after])
        after.set_modules_to_backward_prefetch([before])

"""The orchestrator: applies a Strategy to a model in one fixed order, and undoes it in reverse.

Apply order:
  0. sharding (Strategy.sharding, given a device mesh): the blocks' frozen weights are sharded over the
     data-parallel ranks on a structural copy of the model (sharding.py); every later step works on that copy,
     `self.model` while applied.
  1. blocks: discover the block lists; choose the offloaded blocks.
  2. placement: everything except offloaded blocks' frozen weights moves to the device (frozen weights in the
     weight dtype); trainable parameters (LoRA) are always resident, so their optimizer state is too.
  3. layer offload: host master copies and device slots for the offloaded blocks.
  4. block forwards, from the inside out: per-block compile (its graphs kept for the next runtime) or, with
     token_chunks > 1 for a block whose type has a registered chunked forward (token_chunks.py), that chunked
     forward (each chunk one recompute region that loads the block again before running: a chunk recomputed in
     backward must not read another block's slot), then
     "load this block (and prefetch)" plus input clones, then eager checkpointing, then saved-tensor hooks (weight
     references, activation offload). The result is set as the block's instance-level `forward`, so module names
     and state-dict keys never change.
undo() reverses 4, 3, 2, then 0 (the sharded copy is dropped: the given model never changed). Use
`with MemoryRuntime(...) as rt:`; the undo runs in `finally`.

The device is normalised once, here ("cuda" -> "cuda:<current>", "cpu:0" -> "cpu"), so every comparison with the
devices tensors report holds. Parameters (resident, LoRA, or slot views) never go through activation offload.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable

import torch
from torch import nn

from .activation_offload import ActivationOffload
from .block_compile import CompileCaches, check_compiler, compile_block, compiled_graph_count
from .blocks import MUTATES_INPUTS, Block, discover_blocks
from .checkpointing import InPlaceInputs, checkpointed_call
from .dtypes import TORCH_DTYPES
from .host_memory import release_freed_host_memory
from .devices import normalize_device
from .layer_offload import LayerOffload, WeightRef, in_backward
from .memory_model import WeightSizes, measure_weight_sizes, predict_resident_weight_bytes
from .mutating_blocks import MutatingBlock, cloning_inputs
from .input_copies import InputCopies
from .offload_selection import check_streamable, select_offloaded
from .sharding import BlockSharding
from .stats import StepStats, StepTimer
from .strategy import Keep, Strategy, StrategyError
from .tensor_kinds import PackedWrapper, held_dtype
from .token_chunks import ChunkContext, chunked_forward_for, recompute_region, stand_in


class MemoryRuntime:
    def __init__(self, model: nn.Module, strategy: Strategy, device: torch.device | str, *, mesh=None,
                 poison_slots: bool = False, activation_min_bytes: int = 1 << 16):
        """mesh: the data-parallel ranks' DeviceMesh, needed by Strategy.sharding (ignored when it is off)."""
        self.model = model  # the module to train: while applied with sharding, its sharded copy
        self._given = model
        self.strategy = strategy
        if torch.device(device).type == "cuda" and not torch.cuda.is_available():
            raise StrategyError(f"device '{device}' was asked for but CUDA is not available: use device 'cpu' "
                                "or install a CUDA build of PyTorch")
        self.device = normalize_device(device)
        check_compiler(strategy.compiler, self.device)
        self.poison_slots = poison_slots
        self.activation_min_bytes = activation_min_bytes
        self.blocks: list[Block] = discover_blocks(model, strategy.block_lists)
        self._given_blocks = self.blocks
        weight_dtype = strategy.precision.weight_dtype
        wdtype = None if weight_dtype == "auto" else TORCH_DTYPES[weight_dtype]
        self.weight_dtype = wdtype
        if strategy.precision.compute_dtype == "fp32" and wdtype is None:
            _check_fp32_fits(model)
        self.sizes: WeightSizes = measure_weight_sizes(model, [b.module for b in self.blocks],
                                                       wdtype.itemsize if wdtype else None)
        self.offloaded: list[int] = select_offloaded(self.sizes.block_frozen, strategy.offload)
        check_streamable([(b.name, b.module) for b in self.blocks], self.offloaded)
        self.sharding = BlockSharding(strategy.sharding, mesh, self.device, weight_dtype=wdtype,
                                      block_lists=strategy.block_lists) if strategy.sharding.active else None
        self.offload: LayerOffload | None = None
        self.acts: ActivationOffload | None = None
        self._placed: list[tuple[torch.Tensor, torch.Tensor | None, torch.device, torch.dtype]] = []
        self._patched: list[tuple[nn.Module, Any]] = []
        self._compile_caches: CompileCaches | None = None  # per-block compile: dynamo's caches (kept, bounded)
        self._last_backward_block: int | None = None
        self._forwarding: set[int] = set()  # blocks whose patched forward is running (not their checkpoint's recompute)
        self._param_storages: set[int] = set()
        self._timer = StepTimer(self.device)
        self.inputs = InputCopies(self.device)  # inputs(*host tensors): on the device; the host never waits for compute
        self.applied = False

    # -- apply / undo --------------------------------------------------------------------------------------------
    def __enter__(self) -> "MemoryRuntime":
        self.apply()
        return self

    def __exit__(self, *exc) -> None:
        self.undo()

    def apply(self) -> None:
        if self.applied:
            raise RuntimeError("this MemoryRuntime is already applied; undo() it first")
        try:
            if self.sharding is not None:
                self.model = self.sharding.apply(self._given)
                self.blocks = discover_blocks(self.model, self.strategy.block_lists)
            self._place()
            if self.offloaded:
                self.offload = LayerOffload([b.module for b in self.blocks], self.offloaded, self.device,
                                            prefetch_depth=self.strategy.offload.prefetch_depth,
                                            pin_memory=self.strategy.offload.pin_memory, weight_dtype=self.weight_dtype,
                                            poison_slots=self.poison_slots)
                self.offload.attach()
            if self.strategy.activations.enabled:
                self.acts = ActivationOffload(self.device, pin_memory=self.strategy.offload.pin_memory,
                                              min_bytes=self.activation_min_bytes)
            self._param_storages = _storage_ptrs(self._model_tensors())
            if self.offload is not None:
                self._param_storages |= self.offload.device_storage_ptrs()
            if self.strategy.compiler.per_block:
                self._compile_caches = CompileCaches()
            for i, block in enumerate(self.blocks):
                self._patch_forward(i, block.module)
            self._warn_of_settings_that_do_nothing()
            self.applied = True
        except BaseException:
            self.applied = True
            self.undo()
            raise

    def undo(self) -> None:
        if not self.applied:
            return
        for module, previous in reversed(self._patched):
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous
        self._patched.clear()
        if self._compile_caches is not None:  # its graphs stay cached for the next runtime (block_compile.py)
            try:
                self._compile_caches.close()
            except Exception as e:  # torch internals it reads changed: the undo goes on
                warnings.warn(f"could not count this run's compiled graphs ({type(e).__name__}: {e}): they stay in "
                              "dynamo's cache until the process ends", stacklevel=2)
            self._compile_caches = None
        if self.offload is not None:
            self.offload.detach()
            self.offload = None
        if self.acts is not None:
            self.acts.close()  # its page-locked host arena goes back (activation_host.py)
            self.acts = None
        self._param_storages = set()
        for t, kept, dev, dtype in reversed(self._placed):
            t.data = kept if kept is not None else t.data.to(dev, dtype)
        self._placed.clear()
        if self.sharding is not None and self.sharding.copy is not None:
            self.sharding.undo()
            self.model = self._given
            self.blocks = self._given_blocks
        self.applied = False
        release_freed_host_memory()  # a long-lived process goes back to its size before the run (host_memory.py)

    def _place(self) -> None:
        offloaded_params = {id(p) for i in self.offloaded for p in self.blocks[i].module.parameters()
                            if not p.requires_grad}
        for p in self.model.parameters():
            if id(p) in offloaded_params:
                continue
            dtype = held_dtype(p, self.weight_dtype) if not p.requires_grad and p.is_floating_point() else p.dtype
            self._move(p, dtype, keep=not p.requires_grad)
        for b in self.model.buffers():
            self._move(b, b.dtype, keep=True)

    def _move(self, t: torch.Tensor, dtype: torch.dtype, keep: bool) -> None:
        if t.device == self.device and t.dtype == dtype:
            return
        original = t.data
        t.data = original.to(self.device, dtype)
        # frozen tensors get their original object back on undo (exact); trainable ones keep what was learned
        self._placed.append((t, original if keep else None, original.device, original.dtype))

    def _warn_of_settings_that_do_nothing(self) -> None:
        """Settings valid on their own that this model and strategy give nothing to do: said once, not silently."""
        s, kinds = self.strategy, sorted({type(b.module).__name__ for b in self.blocks})
        if self.acts is not None and all(s.keeps(i) is Keep.ALL for i in range(len(self.blocks))):
            warnings.warn("activation_offload=True moves the inputs checkpointed blocks keep, and no block is "
                          "checkpointed here: it does nothing; set checkpoint='all' (or every_n) to use it",
                          stacklevel=3)
        chunks = s.checkpointing.token_chunks
        if chunks > 1 and self.blocks and not any(chunked_forward_for(b.module) for b in self.blocks):
            warnings.warn(f"token_chunks={chunks} does nothing for this model: its blocks ({', '.join(kinds)}) have "
                          "no token-chunked forward (Flux's have); set token_chunks=1", stacklevel=3)

    def _patch_forward(self, index: int, module: nn.Module) -> None:
        compiled = self.strategy.compiler.per_block
        keep = self.strategy.keeps(index)
        checkpointed = keep is Keep.INPUTS
        offloaded = index in self.offloaded
        offload_acts = self.acts is not None and keep is not Keep.ALL
        chunked = chunked_forward_for(module) if self.strategy.checkpointing.token_chunks > 1 else None
        if not (compiled or checkpointed or chunked or self.offload is not None or offload_acts):
            return  # nothing to do for this block: no wrapper, no overhead
        previous = module.__dict__.get("forward")
        inner: Callable = module.forward
        if compiled:  # a checkpointed block's inputs are cloned by checkpointed_call already
            if getattr(module, MUTATES_INPUTS, False) and not checkpointed:
                inner = MutatingBlock(inner, self.strategy.compiler, type(module))  # on copies of its inputs
            else:
                inner = compile_block(inner, self.strategy.compiler)
        elif chunked is not None:
            # the chunked forward never changes its inputs (token_chunks.py), so the checkpoint keeps no copy of them
            # (one whole-sequence tensor more at the block's backward peak); the block's own forward, which it
            # falls back to for arguments it does not support, may add residuals in place: that one works on copies
            plain = cloning_inputs(inner) if checkpointed else inner
            ctx = self._chunk_context(index, plain, own_checkpoint=checkpointed)
            inner = lambda *args, **kwargs: chunked(module, ctx, *args, **kwargs)  # noqa: E731
        # a compiled block copies every input, as its graphs were compiled for (inputs that stopped being copies after
        # the first call could compile them again); a chunked forward changes none; any other block copies those it
        # was seen to change in place (checkpointing.InPlaceInputs)
        clone_inputs = True if compiled else InPlaceInputs() if chunked is None else False

        def body(*args, **kwargs):
            self._enter_block(index)
            return inner(*args, **kwargs)

        hooks = self._saved_tensor_hooks(index, offloaded and not checkpointed, offload_acts)

        def forward(*args, **kwargs):
            self._forwarding.add(index)
            try:
                with hooks():
                    if checkpointed and torch.is_grad_enabled():
                        return checkpointed_call(body, args, kwargs, clone_inputs=clone_inputs)
                    return body(*args, **kwargs)
            finally:
                self._forwarding.discard(index)

        module.forward = forward
        self._patched.append((module, previous))

    def _chunk_context(self, index: int, plain: Callable, own_checkpoint: bool = False) -> ChunkContext:
        """How block `index` runs its token chunks: each one a recompute region that enters the block first, in
        forward and when recomputed in backward (by then other blocks may hold the slots: its weights must be
        loaded again). With the block checkpointed on its own, an output region is skipped while that checkpoint
        recomputes the block (see ChunkContext.output_region): its first argument stands for its result there. That
        recompute is told apart by the block's forward not running (autograd calls the checkpointed body directly),
        not by being in backward: a block called by someone else's recompute (a model that checkpoints a group of
        blocks itself) runs its forward, whose output is needed there."""
        def run(f: Callable, *args):
            def region(*a):
                self._enter_block(index)
                return f(*a)
            return recompute_region(region, *args)

        def run_output(f: Callable, *args):
            return run(f if index in self._forwarding else stand_in, *args)
        return ChunkContext(self.strategy.checkpointing.token_chunks, run=run, plain=plain,
                            output_region=run_output if own_checkpoint else None)

    def _enter_block(self, index: int) -> None:
        if self.offload is not None:
            self.offload.load(index)
        if self.acts is not None and in_backward() and index != self._last_backward_block:
            self._last_backward_block = index
            if index > 0:
                self.acts.prefetch(index - 1)  # the next block backward will recompute from these inputs

    def _saved_tensor_hooks(self, index: int, weights: bool, acts: bool) -> Callable[[], Any]:
        if not weights and not acts:
            return contextlib.nullcontext
        offload, act_store = self.offload, self.acts

        def pack(t: torch.Tensor):
            if PackedWrapper.packs(t):  # a weight built in forward from plain parameters (tensor_kinds.py)
                return PackedWrapper.of(t, pack)
            if weights and offload.owns(t):
                return offload.pack(t)
            return act_store.pack(t, index) if acts and not self._is_parameter(t, index) else t

        def unpack(x):
            if isinstance(x, PackedWrapper):
                return x.unpack(unpack)
            if isinstance(x, WeightRef):
                return offload.unpack(x)
            if acts:
                self._enter_block(index)
                return act_store.unpack(x)
            return x

        return lambda: torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def _is_parameter(self, t: torch.Tensor, index: int) -> bool:
        """A parameter, or a view of one's storage (compiled graphs save weights and their transposes). Sharded
        (FSDP2), block `index`'s whole weights are gathered into new storage at each forward, which the storages
        listed at apply() cannot know: its parameters now are checked too."""
        ptr = t.untyped_storage().data_ptr()
        if isinstance(t, nn.Parameter) or ptr in self._param_storages:
            return True
        return self.sharding is not None and ptr in _storage_ptrs(self.blocks[index].module.parameters())

    def host_weight(self, p: nn.Parameter) -> torch.Tensor:
        """The value of frozen parameter `p` now, whatever the runtime did to it: the host tensor it streams from
        while its block is offloaded (its `data` is then a placeholder or a slot view), else `p` itself."""
        source = self.offload.host_source(p) if self.offload is not None else None
        return source if source is not None else p.detach()

    def _model_tensors(self) -> list[torch.Tensor]:
        return list(self.model.parameters()) + list(self.model.buffers())

    # -- per step ------------------------------------------------------------------------------------------------
    def autocast(self):
        if self.strategy.precision.compute_dtype == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=TORCH_DTYPES[self.strategy.precision.compute_dtype])

    def counters(self) -> dict[str, int]:
        return {"h2d_bytes": self.offload.counters.h2d_bytes if self.offload else 0,
                "d2h_bytes": self.acts.d2h_bytes if self.acts else 0,
                "graphs": compiled_graph_count() if self.strategy.compiler.per_block else 0}

    def start_step(self) -> None:
        if self.acts is not None:
            self.acts.start_step()
        self._timer.start(self.counters())

    def end_step(self) -> StepStats:
        if self.acts is not None:
            self.acts.end_step()
        self._last_backward_block = None
        wait = (self.offload.collect_wait_seconds() if self.offload else 0.0) \
            + (self.acts.collect_wait_seconds() if self.acts else 0.0)
        return self._timer.stop(self.counters(), wait)

    def host_memory_pinned(self) -> bool:
        """Whether the host copies are page-locked, so copies overlap compute at pinned bandwidth. False on a CPU
        device, with pin_memory off, or where the system refused to lock memory (copies then block the host)."""
        stores = [s for s in (self.offload, self.acts) if s is not None]
        return self.device.type == "cuda" and self.strategy.offload.pin_memory and all(s.pinned for s in stores)

    # -- memory accounting ---------------------------------------------------------------------------------------
    def predicted_weight_bytes(self) -> int:
        return predict_resident_weight_bytes(self.sizes, self.offloaded, self.strategy.offload.prefetch_depth)

    def device_weight_bytes(self) -> int:
        """Bytes of parameters and buffers really held on the device now (slots counted whole, once)."""
        managed = self.offload.device_storage_ptrs() if self.offload else set()
        total = self.offload.slot_bytes() if self.offload else 0
        for t in self._model_tensors():
            if t.device != self.device or t.untyped_storage().data_ptr() in managed:
                continue
            total += t.numel() * t.element_size()
        return total


def _storage_ptrs(tensors) -> set[int]:
    """The data pointers of the tensors' storages: a sharded (FSDP2 DTensor) parameter's local shard; a storage
    that holds no data (FSDP2 frees unsharded parameters between uses) has none to protect."""
    ptrs = set()
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        try:
            ptrs.add(local.untyped_storage().data_ptr())
        except RuntimeError:
            continue
    return ptrs


def _check_fp32_fits(model: nn.Module) -> None:
    """fp32 compute runs without autocast: a plain nn.Linear whose weight the model stores in half precision
    (weight_dtype 'auto' keeps it) would meet fp32 activations and fail in the first matmul, with torch's "mat1 and
    mat2 must have the same dtype" (found by a helper fuzzing strategies). Layers that cast their weights to the
    input's dtype themselves (ComfyUI's) are of other classes and pass."""
    half = next(((name, m.weight.dtype) for name, m in model.named_modules() if type(m) is nn.Linear
                 and m.weight.dtype in (torch.bfloat16, torch.float16)), None)
    if half is not None:
        dtype = str(half[1]).removeprefix("torch.")
        short = {"bfloat16": "bf16", "float16": "fp16"}[dtype]
        raise StrategyError(f"compute_dtype='fp32' with weight_dtype='auto' keeps this model's {dtype} weights (e.g. "
                            f"{half[0]!r}), which its layers cannot multiply with fp32 activations: set weight_dtype="
                            f"'fp32' to train in fp32 (twice the weight memory), or compute_dtype={short!r}")

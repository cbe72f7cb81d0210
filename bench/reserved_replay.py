"""Reserved memory of the headline step, predicted: the step's allocations on fake tensors, replayed through the
model of the CUDA caching allocator (memory/allocator_model.py).

`tightrope bench headline-plan` predicts allocated bytes from shapes; the 4 GB target is on reserved bytes, and the
first H100 run measured reserved 1.8 GiB above allocated at 2048 px (benchmarks/results/h100-2026-11-23/notes.md).
This runs training steps of the Flux-dev-shaped model under a checkpoint-all + activation-offload strategy (its
offload fraction, prefetch depth and token chunks) on fake tensors (no data, no compute: shapes and lifetimes), with
every tensor storage's birth and death sent to the allocator model in the order they happen:

- before the step: the device weights (outside the blocks, the resident blocks, the LoRA) tensor by tensor, the slot
  area in one piece (as layer_offload allocates it), the inputs every block shares (vec, RoPE);
- forward: each block runs without keeping anything but its output; its input goes to the host (activation offload)
  and dies on the device; then the final layer, and its backward from the loss's gradient;
- backward, last block first: the block's inputs come back (and the previous block's, the prefetch), the block is
  recomputed and its backward runs, with flash attention's backward scratch (the fp32 dq accumulator
  FlashAttention-2 allocates besides its outputs, ~0.2 GiB at 2048 px); the gradient of its inputs is the next
  block's output gradient; LoRA gradients live until the step ends;
- the optimizer step: at the first, AdamW's two moments per LoRA tensor (they stay); at each, the one temporary
  list torch's foreach AdamW makes (the denominators, one tensor per LoRA tensor); then the gradients are freed.
  Under optimizer offload (training/host_optimizer.py) none of that is on the device: each block's LoRA gradients
  go to the host as backward completes them, and are taken here as freed once the next block's backward has run
  (their copy is done by then: a block's LoRA gradients take well under a millisecond over PCIe, its backward tens).
Two steps are run (the second finds the cache as the first left it; more steps change nothing); peaks are over both.

Left out, so the prediction is low by them: other kernels' workspaces (cuBLAS ~32 MiB), the embedders' few small
activations, frees that wait for the copy stream (record_stream), and the copy stream's own pool.
"""
from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from ..memory.allocator_model import CachingAllocatorModel
from ..memory.blocks import discover_blocks
from ..memory.memory_model import measure_weight_sizes, predict_slot_bytes
from ..memory.offload_selection import select_offloaded
from ..memory.shape_profile import LiveBytes, cuda_autocast_policy, fake_parameters
from ..memory.strategy import Strategy
from ..memory.token_chunks import ChunkContext, chunked_forward_for
from .models import MODEL_PARAMS, TEXT_TOKENS, _meta_model

BF16 = torch.bfloat16


@dataclass(frozen=True)
class ReplayResult:
    expandable_segments: bool
    token_chunks: int
    peak_allocated: int
    peak_reserved: int
    persistent: int          # allocated before the first step (weights, slots, shared inputs)


class _Replay(LiveBytes):
    """LiveBytes that also sends each storage's birth and death to an allocator model, and can record them."""

    def __init__(self, allocator: CachingAllocatorModel):
        super().__init__()
        self.allocator = allocator
        self.handles: dict[int, object] = {}
        self.events: list | None = None   # while recording: ("a", key, nbytes, storage id) / ("f", key)
        self._ids = 0

    def track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage in self._seen:
            return
        super().track(t)
        n = storage.nbytes()
        if n:
            self._ids += 1
            self.handles[self._ids] = self.allocator.malloc(n)
            if self.events is not None:
                self.events.append(("a", self._ids, n, storage._cdata))
            weakref.finalize(storage, self._free, self._ids)

    def _free(self, key: int) -> None:
        self.allocator.free(self.handles.pop(key))
        if self.events is not None:
            self.events.append(("f", key))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if "flash_attention" in func.__name__ and "backward" in func.__name__:
            self._scratch(flash_backward_scratch(args[1].shape))
        return out

    def _scratch(self, n: int) -> None:
        """A kernel's workspace: allocated after its outputs, freed as it returns."""
        self._ids += 1
        self.handles[self._ids] = self.allocator.malloc(n)
        if self.events is not None:
            self.events.append(("a", self._ids, n, None))
        self._free(self._ids)


def flash_backward_scratch(q_shape) -> int:
    """Bytes CUDA's flash attention backward (FlashAttention-2, what bf16 with head dim 128 takes) allocates besides
    its outputs: the fp32 dq accumulator (batch, tokens rounded up to 128, heads, head dim rounded up to 32) and the
    fp32 softmax row sums (batch, heads, tokens rounded up to 128). q is (batch, heads, tokens, head dim)."""
    b, h, n, d = q_shape
    rounded = -(-n // 128) * 128
    return b * rounded * h * (-(-d // 32) * 32) * 4 + b * h * rounded * 4


class _Blocks:
    """Runs a block's forward (checkpointed: nothing kept but the output) or its recompute + backward on fake
    tensors. A block of a kind already run replays the first one's script instead of running (the same ops on the
    same shapes allocate and free the same bytes in the same order): the allocations that outlive the call (the
    outputs; the gradients of the inputs and of the LoRA) are made as real fake tensors at their place in the
    script, the others go straight to the allocator model. `full=True` runs every block (what the script is tested
    against)."""

    def __init__(self, live: _Replay, runs, kinds, params, vec, pe, final_layer: nn.Module, full: bool = False):
        self.live, self.runs, self.kinds, self.params, self.vec, self.pe = live, runs, kinds, params, vec, pe
        self.final_layer = final_layer
        self.full = full
        self.scripts: dict[tuple[str, str], list] = {}

    def forward(self, i: int, xs: tuple) -> tuple:
        key = (self.kinds[i], "forward")
        if key in self.scripts:
            made = self._replay(self.scripts[key])
            return tuple(made[j] for j in range(len(made)))
        with self._recording(key) as rec:
            with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
                outs = _call(self.runs[i], self.kinds[i], xs, self.vec, self.pe)
            rec["roles"] = {j: t for j, t in enumerate(outs)}
        return tuple(outs)

    def backward(self, i: int, xs: tuple, grads: tuple) -> None:
        key = (self.kinds[i], "backward")
        if key in self.scripts:
            made = self._replay(self.scripts[key])
            for role, t in made.items():
                if role[0] == "x":
                    xs[role[1]].grad = t
                else:
                    self.params[i][role[1]].grad = t
            return
        with self._recording(key) as rec:
            for x in xs:
                x.requires_grad_(True)
            with torch.autocast("cpu", dtype=BF16):
                outs = _call(self.runs[i], self.kinds[i], xs, self.vec, self.pe)
            torch.autograd.backward(list(outs), list(grads))
            del outs
            roles = {("x", j): x.grad for j, x in enumerate(xs)}
            roles.update({("p", k): p.grad for k, p in enumerate(self.params[i]) if p.grad is not None})
            rec["roles"] = roles

    @contextlib.contextmanager
    def _recording(self, key):
        rec: dict = {}
        if self.full:
            yield rec
            return
        self.live.events = []
        try:
            yield rec
        finally:
            events, self.live.events = self.live.events, None
        self.scripts[key] = _script(events, rec["roles"])

    def _replay(self, script: list) -> dict:
        made: dict = {}
        local: dict[int, object] = {}
        for op in script:
            if op[0] == "f":
                self.live.allocator.free(local.pop(op[1]))
            elif op[3] is None:
                local[op[1]] = self.live.allocator.malloc(op[2])
            else:
                role, shape, stride, dtype = op[3]
                t = torch.empty_strided(shape, stride, dtype=dtype)  # tracked: the allocator gets it here
                assert t.untyped_storage().nbytes() == op[2], "reserved replay: a remade tensor differs in size"
                made[role] = t
        return made


def _script(events: list, roles: dict) -> list:
    """A recorded call's events as a script: allocations by their index in the call; those still alive at its end
    tagged with the role (output j, input j's gradient, LoRA tensor k's gradient) that remakes them."""
    by_storage = {}
    for role, t in roles.items():
        sid = t.untyped_storage()._cdata
        assert sid not in by_storage and t.is_contiguous() and t.storage_offset() == 0, \
            "reserved replay: a tensor that outlives a block call shares or offsets its storage"
        by_storage[sid] = (role, tuple(t.shape), tuple(t.stride()), t.dtype)
    mine = {e[1] for e in events if e[0] == "a"}
    freed = {e[1] for e in events if e[0] == "f"}
    assert freed <= mine, "reserved replay: a block call freed a tensor it did not make"
    script = []
    for e in events:
        if e[0] == "f":
            script.append(e)
        elif e[1] in freed:
            script.append(("a", e[1], e[2], None))
        else:
            assert e[3] in by_storage, "reserved replay: a block call leaves a tensor alive that no role remakes"
            script.append(("a", e[1], e[2], by_storage[e[3]]))
    return script


def replayable(strategy: Strategy) -> bool:
    """What the replay models: checkpoint all + activation offload, eager."""
    return strategy.checkpointing.mode == "all" and strategy.activations.enabled and not strategy.compiler.per_block


def replay_step(strategy: Strategy, model_name: str = "flux-dev", resolution: int = 2048, *,
                expandable_segments: bool = True, steps: int = 2, lora_rank: int = 16, full: bool = False,
                history: list | None = None) -> ReplayResult:
    """`steps` training steps of `model_name` at `resolution` under `strategy` (checkpoint all + activation offload;
    its offload fraction, prefetch depth and token chunks) replayed through the allocator model (see the module's
    docstring). `full` runs every block instead of replaying scripts; `history` gets ("malloc"/"free", size,
    allocated, reserved) after every allocation and free."""
    if not replayable(strategy):
        raise ValueError("reserved replay: only checkpoint all + activation offload, eager, is modelled; got "
                         f"{strategy.to_json()}")
    params = MODEL_PARAMS[model_name]()
    model = _meta_model(model_name, BF16, lora_rank)
    blocks = discover_blocks(model)
    sizes = measure_weight_sizes(model, [b.module for b in blocks], None)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # LoRA weights are fp32 in training
    mode = FakeTensorMode()
    fake_parameters(model, mode)
    trainable = [p for p in model.parameters() if p.requires_grad]
    alloc = CachingAllocatorModel(expandable_segments=expandable_segments, history=history)
    offloaded = select_offloaded(sizes.block_frozen, strategy.offload)
    on_host = {id(p) for i in offloaded for p in blocks[i].module.parameters() if not p.requires_grad}
    # device weights tensor by tensor (outside the blocks, resident blocks, the LoRA), then the slot area
    for p in model.parameters():
        if id(p) not in on_host:
            alloc.malloc(p.untyped_storage().nbytes())
    alloc.malloc(predict_slot_bytes(sizes, offloaded, strategy.offload.prefetch_depth))
    n_img, n_txt, h = (resolution // 16) ** 2, TEXT_TOKENS[model_name], params.hidden_size
    live = _Replay(alloc)
    live.ignore(list(model.parameters()))
    chunks = strategy.checkpointing.token_chunks
    with mode, live, cuda_autocast_policy():
        vec = torch.empty(1, h, dtype=BF16)
        pe = torch.empty(1, 1, n_img + n_txt, params.head_dim // 2, 2, 2)
        persistent_bytes = alloc.allocated
        runner = _Blocks(live, [_runner(b.module, chunks) for b in blocks], [type(b.module).__name__ for b in blocks],
                         [[p for p in b.module.parameters() if p.requires_grad] for b in blocks], vec, pe,
                         model.flux.final_layer, full)
        moments: list[torch.Tensor] = []
        for _ in range(steps):
            _step(runner, n_img, n_txt, h, trainable, moments, strategy.optimizer.enabled)
    return ReplayResult(expandable_segments, chunks, alloc.peak_allocated, alloc.peak_reserved, persistent_bytes)


def _runner(module: nn.Module, token_chunks: int):
    fn = chunked_forward_for(module) if token_chunks > 1 else None
    if fn is None:
        return module
    return functools.partial(fn, module, ChunkContext(token_chunks, plain=module.forward))


def _inputs(kind: str, n_img: int, n_txt: int, h: int) -> tuple[torch.Tensor, ...]:
    if kind == "DoubleStreamBlock":
        return torch.empty(1, n_img, h, dtype=BF16), torch.empty(1, n_txt, h, dtype=BF16)
    return (torch.empty(1, n_txt + n_img, h, dtype=BF16),)


def _call(run, kind: str, xs: tuple, vec, pe):
    if kind == "DoubleStreamBlock":
        return run(img=xs[0], txt=xs[1], vec=vec, pe=pe)
    return (run(xs[0], vec=vec, pe=pe),)


def _final_layer(final_layer: nn.Module, xs: tuple, vec: torch.Tensor, n_txt: int) -> tuple:
    """The final layer on the image tokens of the blocks' output, and its backward from the loss's gradient (fp32, as
    mse_loss(out.float(), target) gives): returns the gradient of the blocks' output."""
    x = xs[0].requires_grad_(True)
    with torch.autocast("cpu", dtype=BF16):
        out = final_layer(x[:, n_txt:], vec)
    torch.autograd.backward([out], [torch.empty(out.shape)])
    return (x.grad,)


def _step(blocks: _Blocks, n_img: int, n_txt: int, h: int, trainable: list, moments: list,
          optimizer_offload: bool = False) -> None:
    kinds, n = blocks.kinds, len(blocks.kinds)
    # forward: the embedders' output enters the first block; each block's input goes to the host once it has run
    xs = _inputs(kinds[0], n_img, n_txt, h)
    for i in range(n):
        if i and kinds[i] != kinds[i - 1]:  # double -> single: x = cat(txt, img)
            xs = (torch.cat((xs[1], xs[0]), dim=1),)
        xs = blocks.forward(i, xs)
    grads = _final_layer(blocks.final_layer, xs, blocks.vec, n_txt)
    del xs
    # backward: each block's inputs come back (with the previous block's, the prefetch), recompute + backward
    ahead = None
    for i in range(n - 1, -1, -1):
        if i + 1 < n and kinds[i] != kinds[i + 1]:  # single -> double: split the gradient of cat(txt, img)
            grads = (grads[0][:, n_txt:], grads[0][:, :n_txt])
        xs = ahead if ahead is not None else _inputs(kinds[i], n_img, n_txt, h)
        ahead = _inputs(kinds[i - 1], n_img, n_txt, h) if i else None
        blocks.backward(i, xs, grads)
        grads = tuple(x.grad for x in xs)
        del xs
        if optimizer_offload and i + 1 < n:
            for p in blocks.params[i + 1]:
                p.grad = None  # copied to the host while block i ran backward
    del grads
    if optimizer_offload:
        for p in trainable:
            p.grad = None
        return
    if not moments:  # AdamW's state, made at the first optimizer step, exp_avg and exp_avg_sq per tensor
        moments.extend(torch.empty_like(p) for p in trainable for _ in range(2))
    denominators = [torch.empty_like(p) for p in trainable]  # foreach AdamW: torch._foreach_sqrt(exp_avg_sqs)
    del denominators
    for p in trainable:
        p.grad = None

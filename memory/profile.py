"""A measured profile of one model at one batch size: what the planner predicts from.

Everything here is measured by `probe.probe_model` (or written down for a synthetic model in tests and
benchmarks): bytes per block, bytes of activations kept per block with and without checkpointing, compute time per
block, and the host-to-device bandwidth. It is plain data with a JSON round trip, so a profile taken once (minutes
on a big model) can be saved next to the model and re-planned for any budget in milliseconds.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from .config_base import ConfigBase
from .memory_model import WeightSizes


@dataclass
class CompileFactors:
    """How per-block compile changed one block type, relative to eager at the same inputs (measured)."""
    fwd_factor: float          # compiled forward time / eager forward time
    bwd_factor: float          # compiled backward time / eager backward time
    act_factor: float          # bytes the compiled block saves for backward / eager bytes
    compile_s: float           # seconds to compile this block type once


@dataclass
class ChunkedBlock:
    """One block measured with its token-chunked forward (`Profile.token_chunks` chunks), without checkpointing:
    the figures that replace the block's own when a strategy chunks (plan_cost.predict)."""
    saved: int                 # bytes saved for backward (q, k, v, attention's output, the chunks' inputs)
    peak: int                  # peak over forward + backward above its inputs (0: not measured, as on CPU)
    fwd_s: float               # forward seconds
    bwd_s: float               # backward seconds, the chunks' recompute included
    recompute_s: float | None = None  # seconds of the forward its own checkpoint reruns in backward, output regions
    #                                   skipped (token_chunks.ChunkContext.output_region); None: fwd_s (older profiles)


@dataclass
class Profile(ConfigBase):
    FIELD_PREFIX = "Profile."
    FIELD_NOUN = "profile field"
    UNKNOWN_HINT = "; is this a profile from another version? re-run the probe to make a new one"

    device: str                          # device type the times were measured on: "cuda" or "cpu"
    batch: int                           # batch size the probe ran at (activations and times scale with it)
    block_names: list[str]
    block_types: list[str]               # class name per block: compile factors are per type
    block_frozen: list[int]              # frozen weight bytes per block, in the weight dtype
    block_packed: list[int]              # the same as laid out in an offload slot
    block_trainable: list[int]           # trainable (LoRA) bytes per block
    other_weight_bytes: int              # weights outside the blocks (embedders, final layer) and buffers
    trainable_bytes: int                 # all trainable parameters (their gradients take as much again)
    trainable_numel: int                 # AdamW keeps two fp32 moments per trainable element
    act_full: list[int]                  # bytes saved for backward per block without checkpointing
    act_ckpt: list[int]                  # bytes kept per block when it is checkpointed (its inputs)
    act_shared: int                      # inputs every block receives (modulation vector, RoPE): kept once
    act_other: int                       # saved outside the blocks (embedders, final layer, loss)
    fwd_s: list[float]                   # forward compute seconds per block
    bwd_s: list[float]                   # backward compute seconds per block (without recompute)
    other_s: float                       # forward + backward seconds outside the blocks
    h2d_bytes_per_s: float               # host-to-device copy bandwidth (from the host memory the runtime uses)
    optimizer_s: float = 0.0             # one AdamW step over the trainable parameters (does not scale with batch)
    act_full_alloc: list[int] | None = None   # CUDA: allocator growth over each block's forward, minus its output
    block_peak_alloc: list[int] | None = None  # CUDA: allocator peak over each block's forward + backward alone
    h2d_pinned: bool = True              # CUDA copies from pinned memory overlap compute; pageable ones block the host
    compile: dict[str, dict[str, CompileFactors]] | None = None  # block type -> str(budget) -> factors
    token_chunks: int = 1                # the chunk count `chunked` was measured at (1: not measured)
    chunked: list[ChunkedBlock | None] | None = None  # per block, measured chunked; None: no chunked forward
    measured: dict[str, float] = field(default_factory=dict)     # the probe's own whole-step figures
    strategy_base: dict[str, Any] = field(default_factory=dict)  # the Strategy fields the probe ran with
    act_ckpt_allocs: list[list[int]] | None = None  # per block, each storage in act_ckpt (bytes): one host buffer
    #                                                 apiece under activation offload; None: not measured (old profiles)
    host_optimizer_s: float | None = None  # one optimizer step on the CPU over fp32 host copies of the trainable
    #                                        parameters (optimizer offload); None: not measured (older profiles)

    def __post_init__(self) -> None:
        n = len(self.block_names)
        for name in ("block_types", "block_frozen", "block_packed", "block_trainable", "act_full", "act_ckpt",
                     "fwd_s", "bwd_s", "act_full_alloc", "block_peak_alloc", "chunked", "act_ckpt_allocs"):
            if getattr(self, name) is not None and len(getattr(self, name)) != n:
                raise self.ERROR(f"Profile.{name} has {len(getattr(self, name))} entries but there are {n} "
                                 "blocks: give one entry per block")
        if self.batch < 1:
            self.fail("batch", self.batch, "must be at least 1")

    @property
    def n_blocks(self) -> int:
        return len(self.block_names)

    def sizes(self) -> WeightSizes:
        return WeightSizes(list(self.block_frozen), list(self.block_packed), list(self.block_trainable),
                           self.other_weight_bytes)

    def kept_full(self, i: int) -> int:
        """Activation bytes block i keeps without checkpointing: the larger of the two measurements."""
        alloc = self.act_full_alloc[i] if self.act_full_alloc else 0
        return max(self.act_full[i], alloc)

    def chunked_block(self, i: int, token_chunks: int) -> ChunkedBlock | None:
        """Block i's chunked figures when a strategy runs it in `token_chunks` chunks (None: it runs unchunked).
        They were measured at `self.token_chunks`; another count > 1 gets them as its estimate."""
        if token_chunks <= 1 or not self.chunked:
            return None
        return self.chunked[i]

    def at_batch(self, batch: int) -> "Profile":
        """This profile linearly rescaled to another batch size: activations and compute time scale with the batch,
        weights do not. (Linear time is pessimistic for batches too small to fill the device.)"""
        if batch < 1:
            raise ValueError(f"batch={batch} must be at least 1")
        r = batch / self.batch

        def ints(xs):
            return [int(round(x * r)) for x in xs]

        return dataclasses.replace(
            self, batch=batch, act_full=ints(self.act_full), act_ckpt=ints(self.act_ckpt),
            act_shared=int(round(self.act_shared * r)), act_other=int(round(self.act_other * r)),
            act_ckpt_allocs=[ints(a) for a in self.act_ckpt_allocs] if self.act_ckpt_allocs else None,
            act_full_alloc=ints(self.act_full_alloc) if self.act_full_alloc else None,
            block_peak_alloc=ints(self.block_peak_alloc) if self.block_peak_alloc else None,
            fwd_s=[t * r for t in self.fwd_s], bwd_s=[t * r for t in self.bwd_s], other_s=self.other_s * r,
            chunked=[c and ChunkedBlock(int(round(c.saved * r)), int(round(c.peak * r)), c.fwd_s * r, c.bwd_s * r,
                                        None if c.recompute_s is None else c.recompute_s * r)
                     for c in self.chunked] if self.chunked else None,
            # the whole-step figures are read only for the allocator's gap (plan_cost.fragmentation_bytes), which
            # scales with the batch as predict's batch_scale scales it
            measured={k: v * r for k, v in self.measured.items() if k.endswith("_checkpoint_all")})

    # -- JSON (config_base.py) -----------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any], *, where: str | None = None) -> "Profile":
        data = cls.checked_fields(data, where=where)
        if data.get("compile"):
            data["compile"] = {t: {b: CompileFactors(**f) for b, f in per.items()}
                               for t, per in data["compile"].items()}
        if data.get("chunked"):
            data["chunked"] = [c and ChunkedBlock(**c) for c in data["chunked"]]
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Profile":
        return cls.from_dict(json.loads(text))

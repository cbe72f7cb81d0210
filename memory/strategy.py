"""The memory strategy: one frozen, validated, JSON-serialisable description of how a model is laid out in memory.

A `Strategy` composes one small config per memory policy (as torchtitan composes its activation-checkpoint
policies): `LayerOffloadConfig`, `CheckpointConfig`, `ActivationOffloadConfig`, `CompileConfig`, `PrecisionConfig`,
`ShardingConfig`, `OptimizerOffloadConfig`, plus the model's block lists (each config's JSON and checks: `config_base.py`). Each config validates its own fields; the checks between policies live in one place,
`Strategy.__post_init__`; and one method, `Strategy.keeps(i)`, answers what block i keeps for backward, for the
runtime, the cost model, the planner and the FLOP counter alike.

Errors name the flat field (`Strategy.offload_fraction=...`), the bad value and the allowed range, because the same
values arrive from a ComfyUI widget of that name, a saved workflow and the CLI. `Strategy.of(**flat)` builds a
strategy from those flat names, `replace(**flat)` changes some of them, and `from_dict` reads both the JSON form
tagged by part and the flat form Tightrope 0.1 wrote (state files, profiles, saved settings).
"""
from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass
from typing import Any, ClassVar

from .config_base import ConfigBase

DTYPES = ("bf16", "fp16", "fp32")
WEIGHT_DTYPES = ("auto",) + DTYPES
OFFLOAD_POLICIES = ("spread", "first", "last")
MAX_PREFETCH_DEPTH = 8  # the runtime takes any depth up to this; each one more costs a slot of device memory
CHECKPOINT_MODES = ("off", "all", "every_n")
COMPILE_MODES = ("off", "per_block")
# reduce-overhead means CUDA graphs, which bake weight addresses in: incompatible with swapping weights per block.
COMPILE_OPTIONS = ("default", "max-autotune-no-cudagraphs")
COMPILE_BACKENDS = ("inductor", "aot_eager_decomp_partition", "aot_eager", "eager")
SHARDING_MODES = ("off", "fsdp")


class StrategyError(ValueError):
    """A strategy value is invalid or does not fit the model; the message names the field and the fix."""


class Keep(enum.Enum):
    """What one block keeps for backward."""
    ALL = "all"          # every tensor its forward saves
    INPUTS = "inputs"    # only its inputs: eager checkpointing recomputes the forward in backward
    BUDGET = "budget"    # what the compiler's partitioner keeps under the activation memory budget (it recomputes
                         # the cheap ops, not the matmuls)


class _Part(ConfigBase):
    """A policy's config: `FLAT` maps each field to its flat name (the node widget, the 0.1 JSON key); errors are
    StrategyErrors naming the flat field (`Strategy.offload_fraction=...`)."""
    ERROR = StrategyError
    FIELD_PREFIX = "Strategy."
    FLAT: ClassVar[dict[str, str]]


@dataclass(frozen=True, kw_only=True)
class LayerOffloadConfig(_Part):
    """Layer offload (`layer_offload.LayerOffload`): frozen block weights live in host memory and stream in."""
    FLAT = {"fraction": "offload_fraction", "policy": "offload_policy", "blocks": "offload_blocks",
            "prefetch_depth": "prefetch_depth", "pin_memory": "pin_memory"}

    fraction: float = 0.0
    """Fraction (0-1) of the transformer blocks' frozen weight bytes kept in host memory and streamed in per block."""
    policy: str = "spread"
    """Which blocks to offload: 'spread' (smallest blocks first, spaced out between resident ones so their transfers
    hide behind resident compute), 'first' or 'last' (in model order)."""
    blocks: tuple[int, ...] | None = None
    """Explicit block indices to offload (model order over all block lists); overrides fraction and policy."""
    prefetch_depth: int = 1
    """How many offloaded blocks ahead are copied in while the current block computes (0 = load on demand)."""
    pin_memory: bool = True
    """Page-lock the host copies (weights, and offloaded activations) so host-to-device copies run asynchronously
    (CUDA only; ignored elsewhere)."""

    def __post_init__(self) -> None:
        self.check_range("offload_fraction", self.fraction, 0.0, 1.0,
                     "0.0 keeps every block on the GPU, 1.0 offloads every block")
        self.check_choice("offload_policy", self.policy, OFFLOAD_POLICIES)
        if self.blocks is not None:
            if not isinstance(self.blocks, (list, tuple)) or not all(
                    isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.blocks):
                raise StrategyError(f"Strategy.offload_blocks={self.blocks!r} is invalid: give a list of "
                                    "block indices >= 0 (model order), or leave it empty to use offload_fraction")
            # empty, as the message says, means offload_fraction decides
            object.__setattr__(self, "blocks", tuple(sorted(set(self.blocks))) or None)
        self.check_int("prefetch_depth", self.prefetch_depth, 0, MAX_PREFETCH_DEPTH,
                       "0 loads each block on demand, 1-2 is typical")
        self.check_bool("pin_memory", self.pin_memory)

    @property
    def active(self) -> bool:
        return self.fraction > 0 or bool(self.blocks)


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig(_Part):
    """Eager activation checkpointing (`checkpointing.checkpointed_call`): a checkpointed block keeps only its
    inputs and runs its forward again in backward. A compiled block with an activation memory budget below 1
    (`CompileConfig.activation_memory_budget`) is already recomputed by the compiler, so the two are not combined:
    the Strategy refuses eager checkpointing with such a budget.

    Token chunks are a field here, not a policy of their own: a chunk is a recomputed region (`token_chunks.py`),
    the same mechanism as a checkpointed block at a finer grain, nested inside it when the block is checkpointed
    and used alone when it is not."""
    FLAT = {"mode": "checkpoint", "every": "checkpoint_every", "token_chunks": "token_chunks"}

    mode: str = "off"
    """'off', 'all' blocks, or 'every_n' (every `every`-th block)."""
    every: int = 2
    """N for mode='every_n': blocks 0, N, 2N, ... are recomputed in backward."""
    token_chunks: int = 1
    """Blocks whose type has a token-chunked forward (`token_chunks.register_chunked_forward`) compute every
    token-wise part (norms, modulation, projections, MLP) in this many chunks over the token axis, each chunk
    recomputed in backward: only attention's q, k, v and output span the whole sequence, so one block's forward +
    backward working set shrinks (at 2048 px, most of it). 1 = off. Costs one more forward of the token-wise
    parts; other blocks run as before."""

    def __post_init__(self) -> None:
        self.check_choice("checkpoint", self.mode, CHECKPOINT_MODES)
        self.check_int("checkpoint_every", self.every, 1, 1000, "N=1 checkpoints every block, N=2 every second block")
        self.check_int("token_chunks", self.token_chunks, 1, 64, "1 is off; 4-16 cut a block's working set at 1-4k "
                   "tokens")

    def covers(self, index: int) -> bool:
        """Whether block `index` is checkpointed."""
        return self.mode == "all" or (self.mode == "every_n" and index % self.every == 0)


@dataclass(frozen=True, kw_only=True)
class ActivationOffloadConfig(_Part):
    """Activation offload (`activation_offload.ActivationOffload`) of the blocks that keep less than everything."""
    FLAT = {"enabled": "activation_offload"}

    enabled: bool = False
    """Move the activations kept by checkpointed or budget-compiled blocks to host memory and prefetch them back
    for backward."""

    def __post_init__(self) -> None:
        self.check_bool("activation_offload", self.enabled)


@dataclass(frozen=True, kw_only=True)
class CompileConfig(_Part):
    """Per-block torch.compile (`block_compile.compile_block`). The same training in the same arithmetic, but not
    bit for bit: inductor's fused kernels round otherwise, and with LoRA dropout a compiled block draws other masks
    from the same seed (its gradients are those of its own masks: the same training in distribution)."""
    FLAT = {"scope": "compile", "mode": "compile_mode", "backend": "compile_backend",
            "activation_memory_budget": "activation_memory_budget"}

    scope: str = "off"
    """'per_block' compiles each transformer block separately (one graph per block type, reused across blocks)."""
    mode: str = "default"
    """torch.compile mode."""
    backend: str = "inductor"
    """torch.compile backend; 'aot_eager_decomp_partition' runs the same partitioner without code generation."""
    activation_memory_budget: float = 1.0
    """Fraction (0-1) of activations a compiled block keeps; below 1 PyTorch's partitioner recomputes the cheap ops
    in backward, in place of eager checkpointing of that block. Ignored when scope is 'off'."""

    def __post_init__(self) -> None:
        self.check_choice("compile", self.scope, COMPILE_MODES)
        self.check_choice("compile_mode", self.mode, COMPILE_OPTIONS)
        self.check_choice("compile_backend", self.backend, COMPILE_BACKENDS)
        self.check_range("activation_memory_budget", self.activation_memory_budget, 0.0, 1.0,
                     "1.0 keeps all activations, 0.5 lets the compiler recompute cheap ops")

    @property
    def per_block(self) -> bool:
        return self.scope == "per_block"

    @property
    def partitions(self) -> bool:
        """Whether compiled blocks keep only part of their activations (the budget's recompute is in force)."""
        return self.per_block and self.activation_memory_budget < 1.0


@dataclass(frozen=True, kw_only=True)
class PrecisionConfig(_Part):
    """Dtypes: autocast for compute (`MemoryRuntime.autocast`), storage for the frozen weights (placement)."""
    FLAT = {"compute_dtype": "compute_dtype", "weight_dtype": "weight_dtype"}

    compute_dtype: str = "bf16"
    """Autocast dtype for the forward and backward: 'bf16', 'fp16' or 'fp32' (no autocast)."""
    weight_dtype: str = "auto"
    """Dtype the frozen base weights are stored and moved in: 'auto' keeps the model's own. 'bf16'/'fp16' need
    compute_dtype 'bf16' or 'fp16' (autocast casts the weights per matmul; fp32 compute has no autocast)."""

    def __post_init__(self) -> None:
        self.check_choice("compute_dtype", self.compute_dtype, DTYPES)
        self.check_choice("weight_dtype", self.weight_dtype, WEIGHT_DTYPES)


@dataclass(frozen=True, kw_only=True)
class ShardingConfig(_Part):
    """Sharding of the blocks' frozen weights over the data-parallel ranks (`sharding.BlockSharding`): the first step
    the runtime applies and the last it undoes. It needs the ranks' device mesh, passed to the runtime (`tightrope run
    --fsdp` under torchrun sets this part); the planner takes it as given (planner.plan)."""
    FLAT = {"mode": "shard"}

    mode: str = "off"
    """'off', or 'fsdp': FSDP2 (`fully_shard`) keeps 1/N of each transformer block's frozen weights on each of the N
    ranks and all-gathers a block just before it runs (forward, and again in backward); the LoRA and the weights
    outside the blocks stay whole on every rank."""

    def __post_init__(self) -> None:
        self.check_choice("shard", self.mode, SHARDING_MODES)

    @property
    def active(self) -> bool:
        return self.mode != "off"


@dataclass(frozen=True, kw_only=True)
class OptimizerOffloadConfig(_Part):
    """Optimizer offload (`training/host_optimizer.HostOptimizer`): the trainable weights' gradients and optimizer
    state live in host memory and the optimizer steps on the CPU (ZeRO-Offload's split, for a LoRA)."""
    FLAT = {"enabled": "optimizer_offload"}

    enabled: bool = False
    """Copy each LoRA gradient to host memory as soon as backward completes it (freeing it on the device), keep the
    optimizer's state there, step on the CPU and copy the updated LoRA back: the device holds no gradients at the
    peak and no optimizer state (AdamW: 12 bytes per LoRA weight less), for a CPU optimizer step per step."""

    def __post_init__(self) -> None:
        self.check_bool("optimizer_offload", self.enabled)


_PARTS: dict[str, type[_Part]] = {"offload": LayerOffloadConfig, "checkpointing": CheckpointConfig,
                                  "activations": ActivationOffloadConfig, "compiler": CompileConfig,
                                  "precision": PrecisionConfig, "sharding": ShardingConfig,
                                  "optimizer": OptimizerOffloadConfig}
# flat name (node widget, 0.1 JSON key) -> (part, field)
FLAT_FIELDS: dict[str, tuple[str, str]] = {flat: (part, name) for part, cls in _PARTS.items()
                                           for name, flat in cls.FLAT.items()}


@dataclass(frozen=True, kw_only=True)
class Strategy:
    offload: LayerOffloadConfig = LayerOffloadConfig()
    """Which blocks' frozen weights live in host memory, and how far ahead they stream in."""
    checkpointing: CheckpointConfig = CheckpointConfig()
    """Which blocks recompute their forward in backward."""
    activations: ActivationOffloadConfig = ActivationOffloadConfig()
    """Whether kept block activations wait in host memory for backward."""
    compiler: CompileConfig = CompileConfig()
    """Per-block compile and its activation memory budget."""
    precision: PrecisionConfig = PrecisionConfig()
    """Compute and weight dtypes."""
    sharding: ShardingConfig = ShardingConfig()
    """Whether the blocks' frozen weights are sharded over the data-parallel ranks (a strategy without it: off)."""
    optimizer: OptimizerOffloadConfig = OptimizerOffloadConfig()
    """Whether the LoRA's gradients and optimizer state live in host memory (the optimizer steps on the CPU)."""
    block_lists: tuple[str, ...] | None = None
    """Dotted names of the model's sequential block lists, in execution order, when discovery does not find them."""

    def __post_init__(self) -> None:
        for part, cls in _PARTS.items():
            if not isinstance(getattr(self, part), cls):
                raise StrategyError(f"Strategy.{part} must be a {cls.__name__}, got {getattr(self, part)!r}: build "
                                    "flat settings with Strategy.of(...)")
        if self.block_lists is not None:
            if not isinstance(self.block_lists, (list, tuple)) or not self.block_lists or not all(
                    isinstance(n, str) and n for n in self.block_lists):
                raise StrategyError(f"Strategy.block_lists={self.block_lists!r} is invalid: give the dotted names "
                                    "of the model's block lists, e.g. ['double_blocks', 'single_blocks']")
            object.__setattr__(self, "block_lists", tuple(self.block_lists))
        # -- the checks between policies, all here -------------------------------------------------------------
        p = self.precision
        if p.compute_dtype == "fp32" and p.weight_dtype in ("bf16", "fp16"):
            # fp32 compute runs without autocast, so every matmul would meet a half-precision weight
            raise StrategyError(f"Strategy.weight_dtype={p.weight_dtype!r} does not work with compute_dtype='fp32' "
                                f"(no autocast: {p.weight_dtype} weights meet fp32 activations): set compute_dtype="
                                f"{p.weight_dtype!r} (fp32 compute gains nothing on {p.weight_dtype} weights), or "
                                "weight_dtype='auto' or 'fp32' to train in fp32")
        if self.sharding.active and self.offload.active:
            o = self.offload
            raise StrategyError(
                f"Strategy.shard={self.sharding.mode!r} (--fsdp) does not work with layer offload (offload_fraction="
                f"{o.fraction}, offload_blocks={list(o.blocks) if o.blocks else None}): both decide where the blocks' "
                "frozen weights live (FSDP keeps 1/N of each block per GPU and all-gathers it block by block); set "
                "offload_fraction=0 and no offload_blocks in the Memory Strategy node, or shard='off' (run without "
                "--fsdp) to offload instead")
        if self.sharding.active and self.optimizer.enabled:
            raise StrategyError(
                f"Strategy.optimizer_offload=True does not work with shard={self.sharding.mode!r} (--fsdp) yet: the "
                "sharded blocks' LoRA weights are split over the ranks; set optimizer_offload=False in the Memory "
                "Strategy node, or run without --fsdp to offload the optimizer")
        if self.compiler.partitions and self.checkpointing.mode != "off":
            raise StrategyError(
                f"Strategy.checkpoint={self.checkpointing.mode!r} does not combine with compile='per_block' at "
                f"activation_memory_budget={self.compiler.activation_memory_budget:g}: the compiler already "
                "recomputes inside each block under a budget below 1; set checkpoint='off', or "
                "activation_memory_budget=1.0 to checkpoint the compiled blocks eagerly")
        if self.compiler.per_block and self.checkpointing.token_chunks > 1:
            # a chunk's region calls the runtime (it loads the block's weights when recomputed), which a compiled
            # graph cannot contain; and a compiled block's recompute is the partitioner's to choose
            raise StrategyError(
                f"Strategy.token_chunks={self.checkpointing.token_chunks} does not combine with compile='per_block': "
                "set token_chunks=1 to compile the blocks, or compile='off' to chunk them")

        if self.sharding.active and self.checkpointing.token_chunks > 1:
            # FSDP gives each block a class of its own (and gathers its weights around the forward): chunked
            # forwards are not yet known to run correctly there, so they are refused rather than silently skipped
            raise StrategyError(
                f"Strategy.token_chunks={self.checkpointing.token_chunks} does not work with shard="
                f"{self.sharding.mode!r} (--fsdp) yet: set token_chunks=1 in the Memory Strategy node, or run "
                "without --fsdp to chunk the blocks")

    # -- the one answer to "what does block i keep for backward" ------------------------------------------------
    def keeps(self, index: int) -> Keep:
        if self.compiler.partitions:
            return Keep.BUDGET
        return Keep.INPUTS if self.checkpointing.covers(index) else Keep.ALL

    # -- flat names ----------------------------------------------------------------------------------------------
    @classmethod
    def of(cls, **flat: Any) -> "Strategy":
        """A strategy from flat names (`offload_fraction=0.5, checkpoint='all'`: the node widgets, the 0.1 JSON)."""
        known = set(FLAT_FIELDS) | {"block_lists"}
        unknown = sorted(set(flat) - known)
        if unknown:
            raise StrategyError(f"unknown strategy field(s) {unknown}: known fields are {sorted(known)}")
        parts: dict[str, dict[str, Any]] = {part: {} for part in _PARTS}
        block_lists = flat.pop("block_lists", None)
        for name, value in flat.items():
            part, field = FLAT_FIELDS[name]
            parts[part][field] = value
        return cls(**{part: _PARTS[part](**kw) for part, kw in parts.items()}, block_lists=block_lists)

    def to_flat(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for part, cls in _PARTS.items():
            for field, value in getattr(self, part).to_dict().items():
                out[cls.FLAT[field]] = value
        out["block_lists"] = list(self.block_lists) if self.block_lists is not None else None
        return out

    def replace(self, **changes: Any) -> "Strategy":
        """A copy with some flat fields (`offload_fraction=...`) or whole parts (`compiler=CompileConfig(...)`)
        changed; checked again as a whole."""
        parts = {k: changes.pop(k) for k in list(changes) if k in _PARTS}
        current = dataclasses.replace(self, **parts) if parts else self
        return Strategy.of(**{**current.to_flat(), **changes}) if changes else current

    # -- JSON: tagged by part; the flat 0.1 form still loads ----------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {part: getattr(self, part).to_dict() for part in _PARTS}
        d["block_lists"] = list(self.block_lists) if self.block_lists is not None else None
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Strategy":
        if not isinstance(data, dict):
            raise StrategyError(f"a strategy must be a JSON object, got {data!r}")
        if not set(data) & set(_PARTS):
            return cls.of(**data)  # the flat form of Tightrope 0.1
        unknown = sorted(set(data) - set(_PARTS) - {"block_lists"})
        if unknown:
            raise StrategyError(f"unknown strategy part(s) {unknown}: known parts are "
                                f"{sorted(_PARTS) + ['block_lists']} (or the flat fields of version 0.1)")
        parts = {part: _PARTS[part].from_dict(data[part], where=f"strategy part '{part}'")
                 for part in _PARTS if part in data}
        block_lists = data.get("block_lists")
        return cls(**parts, block_lists=tuple(block_lists) if isinstance(block_lists, list) else block_lists)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Strategy":
        return cls.from_dict(json.loads(text))

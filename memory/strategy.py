"""The memory strategy: one frozen, validated, JSON-serialisable description of how a model is laid out in memory.

Every field names what it trades. Errors name the field, the bad value and the allowed range, because the same
values arrive from a ComfyUI widget, a saved workflow and the CLI.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

DTYPES = ("bf16", "fp16", "fp32")
WEIGHT_DTYPES = ("auto",) + DTYPES
OFFLOAD_POLICIES = ("spread", "first", "last")
CHECKPOINT_MODES = ("off", "all", "every_n")
COMPILE_MODES = ("off", "per_block")
# reduce-overhead means CUDA graphs, which bake weight addresses in: incompatible with swapping weights per block.
COMPILE_OPTIONS = ("default", "max-autotune-no-cudagraphs")
COMPILE_BACKENDS = ("inductor", "aot_eager_decomp_partition", "aot_eager", "eager")


class StrategyError(ValueError):
    """A strategy value is invalid or does not fit the model; the message names the field and the fix."""


@dataclass(frozen=True, kw_only=True)
class Strategy:
    offload_fraction: float = 0.0
    """Fraction (0-1) of the transformer blocks' frozen weight bytes kept in host memory and streamed in per block."""
    offload_policy: str = "spread"
    """Which blocks to offload: 'spread' (smallest blocks first, spaced out between resident ones so their transfers
    hide behind resident compute), 'first' or 'last' (in model order)."""
    offload_blocks: tuple[int, ...] | None = None
    """Explicit block indices to offload (model order over all block lists); overrides fraction and policy."""
    prefetch_depth: int = 1
    """How many offloaded blocks ahead are copied in while the current block computes (0 = load on demand)."""
    activation_offload: bool = False
    """Move the activations kept at checkpoint boundaries to host memory and prefetch them back for backward."""
    checkpoint: str = "off"
    """Activation checkpointing: 'off', 'all' blocks, or 'every_n' (every checkpoint_every-th block)."""
    checkpoint_every: int = 2
    """N for checkpoint='every_n': blocks 0, N, 2N, ... are recomputed in backward."""
    compile: str = "off"
    """'per_block' compiles each transformer block separately (one graph per block type, reused across blocks)."""
    activation_memory_budget: float = 1.0
    """For compiled blocks: fraction of activations kept (0-1); below 1 PyTorch's partitioner recomputes the cheap
    ops, replacing eager checkpointing of that block."""
    compile_mode: str = "default"
    """torch.compile mode for per-block compile."""
    compile_backend: str = "inductor"
    """torch.compile backend; 'aot_eager_decomp_partition' runs the same partitioner without code generation."""
    compute_dtype: str = "bf16"
    """Autocast dtype for the forward and backward: 'bf16', 'fp16' or 'fp32' (no autocast)."""
    weight_dtype: str = "auto"
    """Dtype the frozen base weights are stored and moved in: 'auto' keeps the model's own. 'bf16'/'fp16' need
    compute_dtype 'bf16' or 'fp16' (autocast casts the weights per matmul; fp32 compute has no autocast)."""
    pin_memory: bool = True
    """Page-lock the host copies so host-to-device copies run asynchronously (CUDA only; ignored elsewhere)."""
    block_lists: tuple[str, ...] | None = None
    """Dotted names of the model's sequential block lists, in execution order, when discovery does not find them."""

    def __post_init__(self) -> None:
        self._check_range("offload_fraction", self.offload_fraction, 0.0, 1.0,
                          "0.0 keeps every block on the GPU, 1.0 offloads every block")
        self._check_choice("offload_policy", self.offload_policy, OFFLOAD_POLICIES)
        if self.offload_blocks is not None:
            if isinstance(self.offload_blocks, (str, bytes)) or not all(
                    isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.offload_blocks):
                raise StrategyError(f"Strategy.offload_blocks={self.offload_blocks!r} is invalid: give a list of "
                                    "block indices >= 0 (model order), or leave it empty to use offload_fraction")
            object.__setattr__(self, "offload_blocks", tuple(sorted(set(self.offload_blocks))))
        self._check_int("prefetch_depth", self.prefetch_depth, 0, 8, "0 loads each block on demand, 1-2 is typical")
        self._check_choice("checkpoint", self.checkpoint, CHECKPOINT_MODES)
        self._check_int("checkpoint_every", self.checkpoint_every, 1, 1000,
                        "N=1 checkpoints every block, N=2 every second block")
        self._check_choice("compile", self.compile, COMPILE_MODES)
        self._check_range("activation_memory_budget", self.activation_memory_budget, 0.0, 1.0,
                          "1.0 keeps all activations, 0.5 lets the compiler recompute cheap ops")
        self._check_choice("compile_mode", self.compile_mode, COMPILE_OPTIONS)
        self._check_choice("compile_backend", self.compile_backend, COMPILE_BACKENDS)
        self._check_choice("compute_dtype", self.compute_dtype, DTYPES)
        self._check_choice("weight_dtype", self.weight_dtype, WEIGHT_DTYPES)
        if self.compute_dtype == "fp32" and self.weight_dtype in ("bf16", "fp16"):
            # fp32 compute runs without autocast, so every matmul would meet a half-precision weight
            raise StrategyError(f"Strategy.weight_dtype={self.weight_dtype!r} does not work with compute_dtype='fp32' "
                                f"(no autocast: {self.weight_dtype} weights meet fp32 activations): set compute_dtype="
                                f"{self.weight_dtype!r} (fp32 compute gains nothing on {self.weight_dtype} weights), or "
                                "weight_dtype='auto' or 'fp32' to train in fp32")
        for name in ("activation_offload", "pin_memory"):
            if not isinstance(getattr(self, name), bool):
                raise StrategyError(f"Strategy.{name}={getattr(self, name)!r} must be true or false")
        if self.block_lists is not None:
            if isinstance(self.block_lists, str) or not self.block_lists or not all(
                    isinstance(n, str) and n for n in self.block_lists):
                raise StrategyError(f"Strategy.block_lists={self.block_lists!r} is invalid: give the dotted names "
                                    "of the model's block lists, e.g. ['double_blocks', 'single_blocks']")
            object.__setattr__(self, "block_lists", tuple(self.block_lists))

    @staticmethod
    def _check_range(name: str, value: Any, lo: float, hi: float, hint: str) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or not lo <= value <= hi:
            raise StrategyError(f"Strategy.{name}={value!r} is out of range: use a number from {lo} to {hi} ({hint})")

    @staticmethod
    def _check_int(name: str, value: Any, lo: int, hi: int, hint: str) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise StrategyError(f"Strategy.{name}={value!r} is out of range: use a whole number from {lo} to {hi} "
                                f"({hint})")

    @staticmethod
    def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
        if value not in choices:
            raise StrategyError(f"Strategy.{name}={value!r} is not supported: choose one of {', '.join(choices)}")

    # -- derived views -------------------------------------------------------------------------------------------
    def checkpoints_block(self, index: int) -> bool:
        """Whether block `index` is wrapped in eager (non-reentrant) checkpointing."""
        if self.compile == "per_block" and self.activation_memory_budget < 1.0:
            return False  # the compiler's memory-budget partitioner already recomputes inside the block
        if self.checkpoint == "all":
            return True
        return self.checkpoint == "every_n" and index % self.checkpoint_every == 0

    def replace(self, **changes: Any) -> "Strategy":
        return dataclasses.replace(self, **changes)

    # -- JSON ----------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k in ("offload_blocks", "block_lists"):
            if d[k] is not None:
                d[k] = list(d[k])
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Strategy":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise StrategyError(f"unknown strategy field(s) {unknown}: known fields are {sorted(known)}")
        data = dict(data)
        for k in ("offload_blocks", "block_lists"):
            if data.get(k) is not None:
                data[k] = tuple(data[k])
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Strategy":
        return cls.from_dict(json.loads(text))

"""A training session: everything needed to go on training, as plain data.

Nodes never mutate their inputs, and ComfyUI caches node outputs, so a session is never changed in place: each run
returns a new one (the LoRA and optimizer state are small; the base model is shared, not copied).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ..memory.strategy import Strategy
from .lora.layers import LoraSpec
from .models import adapter_for
from .train_config import TrainConfig


@dataclass(frozen=True, kw_only=True)
class TrainingSession:
    model: Any                      # what arrived on the MODEL input (reference Flux or ComfyUI's ModelPatcher)
    dataset: Any                    # TrainingDataset
    lora: LoraSpec
    strategy: Strategy
    config: TrainConfig
    step: int = 0                   # optimizer steps done
    lora_state: dict[str, torch.Tensor] | None = None     # CPU tensors; None before the first step
    optimizer_state: dict | None = None
    losses: tuple[float, ...] = ()
    stats: tuple[dict, ...] = ()
    saved: tuple[str, ...] = ()     # LoRA files written by this session, oldest first
    interrupted: bool = False
    ema_state: dict[str, torch.Tensor] | None = None      # the LoRA weights' EMA (CPU fp32) when ema_decay > 0
    validation_dataset: Any = None  # a second dataset scored for the validation loss (else config.validation_fraction)
    validation_losses: tuple[tuple[int, float], ...] = ()  # (step, validation loss), oldest first

    def advanced(self, **changes: Any) -> "TrainingSession":
        return dataclasses.replace(self, **changes)

    def with_model_shift(self) -> "TrainingSession":
        """This session with timestep_shift 0 resolved to the shift its model samples with (TrainConfig.resolved):
        what a run trains with, the state file records and a resume compares."""
        config = self.config.resolved(lambda: adapter_for(self.model).sampling_shift())
        return self if config is self.config else self.advanced(config=config)

    @property
    def last_saved(self) -> str | None:
        return self.saved[-1] if self.saved else None


def clone_state(state: Any) -> Any:
    """A deep copy of tensors in nested dicts/lists (optimizer state), on the CPU."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: clone_state(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(clone_state(v) for v in state)
    return state

"""The optimizer over the LoRA weights, and the learning-rate schedule as a pure function of the step."""
from __future__ import annotations

import math

import torch
from torch import nn

from .train_config import ConfigError, TrainConfig


def optimizer_class(name: str, device: torch.device) -> type[torch.optim.Optimizer]:
    """The optimizer class for `name` on `device`; a ConfigError naming the fix when it cannot run here (the Train
    node's input check calls this too, so a missing package fails before any training)."""
    if name == "adamw8bit":
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise ConfigError("optimizer='adamw8bit' needs bitsandbytes: `pip install bitsandbytes` (CUDA only), "
                              "or choose optimizer='adamw'") from None
        if device.type != "cuda":
            raise ConfigError("optimizer='adamw8bit' runs on CUDA only: choose optimizer='adamw' on this device")
        return bnb.optim.AdamW8bit
    return torch.optim.AdamW


def make_optimizer(params: list[nn.Parameter], config: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    return optimizer_class(config.optimizer, device)(params, lr=config.learning_rate,
                                                     weight_decay=config.weight_decay)


def learning_rate_at(config: TrainConfig, step: int, run_start: int, run_steps: int) -> float:
    """LR for optimizer step `step` (0-based, session-global) of a run covering [run_start, run_start+run_steps)."""
    lr = config.learning_rate
    if config.warmup_steps and step < config.warmup_steps:
        lr *= (step + 1) / config.warmup_steps
    if config.schedule == "cosine" and run_steps > 1:
        progress = min(max(step - run_start, 0) / (run_steps - 1), 1.0)
        lr *= config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return lr

"""The optimizer over the LoRA weights, and the learning-rate schedule as a pure function of the step.

Weight decay pulls a weight toward 0, which for LoRA's A and B is toward the base model. A DoRA magnitude m_i is no
such weight: it starts at |W_i| and is the output row's norm, so decaying it would shrink every adapted layer's
output. Magnitudes are therefore a param group of their own, never decayed (flag NO_DECAY); optimizer states saved
before that split (one group) are regrouped on load.

Optional optimizers come from well-kept packages imported only when chosen; a missing one is a ConfigError with a
one-line install hint, raised by the Train node's input check before any node trains.
"""
from __future__ import annotations

import importlib
import math
import warnings
from typing import NamedTuple

import torch
from torch import nn

from .train_config import ConfigError, TrainConfig


class _Choice(NamedTuple):
    module: str       # where the class lives ("torch.optim" or an optional package)
    name: str
    package: str      # what `pip install` needs, "" for torch itself
    cuda_only: bool = False
    state_bytes: float = 8.0  # optimizer state per trainable element on the device (the planner budgets it)


# the names of TrainConfig.OPTIMIZERS -> their classes
CHOICES = {
    "adamw": _Choice("torch.optim", "AdamW", ""),  # exp_avg, exp_avg_sq: 2 x fp32
    "adamw8bit": _Choice("bitsandbytes.optim", "AdamW8bit", "bitsandbytes", cuda_only=True, state_bytes=2.0),
    "adafactor": _Choice("torch.optim", "Adafactor", "", state_bytes=4.0),  # factored: 4 bounds its 1-D case
    "prodigy": _Choice("prodigyopt", "Prodigy", "prodigyopt", state_bytes=16.0),  # p0, s, exp_avg, exp_avg_sq
    "adamw_schedulefree": _Choice("schedulefree", "AdamWScheduleFree", "schedulefree"),  # z, exp_avg_sq
}


def optimizer_class(name: str, device: torch.device) -> type[torch.optim.Optimizer]:
    """The optimizer class for `name` on `device`; a ConfigError naming the fix when it cannot run here (the Train
    node's input check calls this too, so a missing package fails before any training)."""
    if name not in CHOICES:
        raise ConfigError(f"optimizer={name!r} is not supported: choose one of {', '.join(CHOICES)}")
    choice = CHOICES[name]
    try:
        module = importlib.import_module(choice.module)
    except ImportError:
        where = " (CUDA only)" if choice.cuda_only else ""
        raise ConfigError(f"optimizer={name!r} needs the {choice.package} package: `pip install {choice.package}` "
                          f"into ComfyUI's Python{where}, or choose optimizer='adamw'") from None
    if choice.cuda_only and device.type != "cuda":
        raise ConfigError(f"optimizer={name!r} runs on CUDA only: choose optimizer='adamw' on this device")
    return getattr(module, choice.name)


NO_DECAY = "tightrope_no_decay"  # a param group's flag: its weights are never decayed
_IMPLEMENTATION = ("fused", "foreach", "capturable")  # how a torch optimizer steps, not what it computes


def _never_decayed(name: str) -> bool:
    return ".lora_magnitude_vector." in name  # peft's DoRA magnitude


def _groups(params: dict[str, nn.Parameter]) -> list[dict]:
    groups = [{"params": [p for n, p in params.items() if not _never_decayed(n)]}]
    kept = [p for n, p in params.items() if _never_decayed(n)]
    return groups + [{"params": kept, "weight_decay": 0.0, NO_DECAY: True}] if kept else groups


def make_optimizer(params: dict[str, nn.Parameter], config: TrainConfig, device: torch.device, *,
                   on_host: bool = False) -> torch.optim.Optimizer:
    """The optimizer over the LoRA weights by name (lora_parameters' order): decayed, then never decayed. on_host:
    it steps host copies under optimizer offload (host_optimizer.py). AdamW on the CPU (host copies, or a CPU
    device) is the fused one where this torch has it (one pass over memory: 3.7x faster than its loop for 37.6 M
    weights on 2 cores)."""
    cls = optimizer_class(config.optimizer, device)
    if config.optimizer == "prodigy" and config.learning_rate < 0.1:
        warnings.warn(f"optimizer='prodigy' finds the step size itself and learning_rate scales it: "
                      f"learning_rate={config.learning_rate:g} makes it crawl; use 1.0", stacklevel=2)
    extra = {"warmup_steps": 0} if config.optimizer == "adamw_schedulefree" else {}  # warmup is learning_rate_at's
    if config.optimizer == "prodigy":
        # Prodigy's estimate of the step size grows from the gradients it sees: during a warmup the small learning
        # rates make it overshoot once the rate is reached, unless its safeguard (Prodigy's README) is on
        extra = {"safeguard_warmup": config.warmup_steps > 0}
    if config.optimizer == "adafactor":
        # PyTorch's Adafactor scales each step by max(eps2, RMS(weight)): LoRA's B starts at 0, so with its default
        # eps2 = 1e-3 B moved 1000x slower than the learning rate says. eps2 = 1 makes the step the learning rate
        # (LoRA weights have RMS < 1), as Adafactor(scale_parameter=False) does in kohya's and HF's LoRA recipes.
        extra = {"eps": (None, 1.0)}
    # on the CPU (host copies, or a CPU device) the fused AdamW: the fastest, and one kernel for training on the
    # CPU with and without optimizer offload (the loop's rounding differs)
    if config.optimizer == "adamw" and (on_host or torch.device(device).type == "cpu"):
        return host_adamw(_groups(params), lr=config.learning_rate, weight_decay=config.weight_decay)
    return cls(_groups(params), lr=config.learning_rate, weight_decay=config.weight_decay, **extra)


def host_adamw(params, **options) -> torch.optim.AdamW:
    """AdamW over host tensors: the fused CPU kernel where this torch has it, else the default implementation."""
    try:
        return torch.optim.AdamW(params, fused=True, **options)
    except (RuntimeError, TypeError):  # a torch without the fused CPU kernel
        return torch.optim.AdamW(params, **options)


def load_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict, names: list[str],
                         weight_decay: float) -> None:
    """Load a saved state into `optimizer` (made by make_optimizer over the weights named `names`, in order), with
    the run's weight decay (never on NO_DECAY groups). A state from before magnitudes had a group of their own (one
    group over `names` in order) is regrouped: each weight's moments follow it to its new index."""
    if len(saved["param_groups"]) == 1 < len(optimizer.param_groups):
        order = [i for i, n in enumerate(names) if not _never_decayed(n)] + \
                [i for i, n in enumerate(names) if _never_decayed(n)]
        (group,) = saved["param_groups"]
        split = len(optimizer.param_groups[0]["params"])
        saved = {**saved, "state": {new: saved["state"][old] for new, old in enumerate(order) if old in saved["state"]},
                 "param_groups": [{**group, "params": list(range(split))},
                                  {**group, "params": list(range(split, len(order))), NO_DECAY: True}]}
    # loading restores the saved groups' options: the implementation stays this optimizer's (a state saved by the
    # fused host AdamW of optimizer offload goes on in a device AdamW, and back), the weight decay this run's
    implementation = [{k: g[k] for k in _IMPLEMENTATION if k in g} for g in optimizer.param_groups]
    optimizer.load_state_dict(saved)
    for group, kept in zip(optimizer.param_groups, implementation):
        group.update(kept)
        group["weight_decay"] = 0.0 if group.get(NO_DECAY) else weight_decay
        on_param = group.get("fused") or group.get("capturable")  # where torch's Adam(W) keeps its step count
        for p in group["params"]:
            step = optimizer.state.get(p, {}).get("step")
            if isinstance(step, torch.Tensor):
                optimizer.state[p]["step"] = step.to(p.device if on_param else "cpu", torch.float32)


def learning_rate_at(config: TrainConfig, step: int, run_start: int, run_steps: int) -> float:
    """LR for optimizer step `step` (0-based, session-global) of a run covering [run_start, run_start+run_steps)."""
    lr = config.learning_rate
    if config.warmup_steps and step < config.warmup_steps:
        lr *= (step + 1) / config.warmup_steps
    # cosine decays after the warmup, from the run's first step past it, to min_lr_ratio just after its last step:
    # the last step still updates (reaching the minimum at it made every run's, and chain link's, last step a no-op
    # at the default min_lr_ratio 0); as diffusers' and kohya's cosine schedules
    start, end = max(run_start, config.warmup_steps), run_start + run_steps
    if config.schedule == "cosine" and end > start:
        progress = min(max(step - start, 0) / (end - start), 1.0)
        lr *= config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return lr

"""The errors a run of the step loop (trainer.py) raises when it cannot go on, and their messages: what went wrong,
which step's files were kept, and what to change."""
from __future__ import annotations

import math

import torch

from .finite_check import all_finite
from .host_optimizer import offloadable
from .session import TrainingSession


class NonFiniteLossError(RuntimeError):
    """The loss (or a gradient) became NaN or infinite; the last good LoRA was kept."""


class NonFiniteWeightsError(RuntimeError):
    """An optimizer step made the LoRA weights NaN or infinite although its loss and gradients were finite; those
    weights are never saved (the message names the last LoRA saved)."""


class TrainingOutOfMemoryError(torch.OutOfMemoryError):
    """Out of device memory in a step: memory was freed, the last completed step saved, and the message suggests a
    strategy that needs less (still a torch.OutOfMemoryError, so ComfyUI's own OOM handling applies)."""


def nonfinite_loss_or_gradients(loss: float, params: dict, scaler) -> str | None:
    """What went non-finite in this step, if anything. A NaN/inf gradient with a finite loss (a bf16 overflow in
    backward) would poison the weights as surely as a NaN loss, and is caught before the update, so 'skip' can skip
    it. Under fp16 loss scaling an overflowed gradient is the scaler's business: it skips that step and lowers the
    scale."""
    if not math.isfinite(loss):
        return f"the loss became {loss}"
    if not scaler.is_enabled() and not all_finite(p.grad for p in params.values() if p.grad is not None):
        return f"the gradients became NaN or infinite (the loss was {loss:.4g})"
    return None


def nonfinite_weights_message(run, loss: float) -> str:
    """NonFiniteWeightsError's message; run: the trainer's _Run (its step and the LoRA files saved)."""
    kept = f"the last LoRA saved is {run.saved[-1][0]} (step {run.saved[-1][1]})" if run.saved \
        else "no LoRA was saved in this run (set save_every to keep intermediate steps)"
    return (f"the optimizer step of step {run.step + 1} made LoRA weights NaN or infinite although its loss "
            f"({loss:.4g}) and gradients were finite: training stopped (on_nonfinite='skip' cannot skip an update "
            f"already applied) and these weights are not saved; {kept}. Lower learning_rate")


def oom_message(session: TrainingSession, run, device, detail: str, save) -> str:
    """TrainingOutOfMemoryError's message: what was kept, and a strategy that needs less memory. run: the trainer's
    _Run (step, saved, saved_step, updating); save: its SaveTarget or None."""
    s, cfg = session.strategy, session.config
    lighter = (["offload_fraction=1.0"] if s.offload.fraction < 1.0 or s.offload.blocks is not None else []) \
        + (["checkpoint='all'"] if s.checkpointing.mode != "all" else []) \
        + (["activation_offload=True"] if not s.activations.enabled else []) \
        + (["optimizer_offload=True"] if not s.optimizer.enabled and offloadable(cfg.optimizer)
           and not s.sharding.active else [])
    fix = (f"in the Memory Strategy node set {', '.join(lighter)} (or mode='auto' with your GPU's vram_budget_gb "
           "so the planner picks a strategy that fits)" if lighter else "the strategy already needs the least memory")
    fix += f", or lower batch_size to {cfg.batch_size // 2}" if cfg.batch_size > 1 else ", or lower the resolution"
    kept = (f"the LoRA and training state of step {run.step} are saved ({run.saved[-1][0]}, "
            f"{save.state_file})"
            if save is not None and run.step > session.step and run.saved_step == run.step
            else f"step {run.step + 1}'s update was cut short, so nothing new was saved" if run.updating
            else "no step was completed in this run, so nothing new was saved")
    return (f"out of memory on {device} in step {run.step + 1} ({detail}); memory was freed and {kept}. Use less "
            f"memory: {fix}; then run again: it continues from the saved step (in ComfyUI queue the workflow again; "
            "headless add `--resume`)")

"""What a training run reports while it runs, besides its progress bar: the validation loss (scored when due), one
log line per validation, and TensorBoard scalars. The trainer calls it after each step and closes it at the end."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from . import distributed
from .schedule_free import eval_weights
from .tensorboard_log import TensorBoardLog
from .validation import Validation


class RunMonitor:
    def __init__(self, session: Any, validation_set: Any | None, *, run_start: int, run_end: int,
                 log_dir: str | Path | None = None, notify: Callable[[str], None] | None = None):
        """validation_set: the dataset to score (split_for_validation), or None; log_dir: TensorBoard's folder, or
        None; notify: where the log lines go. Fails now (before training) if TensorBoard is asked for but missing."""
        self.validation = None if validation_set is None else Validation(
            validation_set, session.config, run_start=run_start, run_end=run_end, recorded=session.validation_losses)
        main = distributed.current().is_main
        self.tensorboard = TensorBoardLog(log_dir) if log_dir and main else None
        self.notify = notify if main else None

    @property
    def validation_losses(self) -> tuple[tuple[int, float], ...]:
        """The (step, validation loss) pairs scored in this run."""
        return tuple(self.validation.scored) if self.validation is not None else ()

    def validate(self, step: int, adapter: Any, module: torch.nn.Module, runtime: Any,
                 optimizer: torch.optim.Optimizer) -> None:
        """Score the validation set at `step` (steps done) if it is due there, at the weights a save would write
        (a schedule-free optimizer's averaged weights; the train weights are back afterwards, exactly)."""
        if self.validation is None or not self.validation.due(step):
            return
        with eval_weights(optimizer):
            loss = self.validation.score_if_due(step, adapter, module, runtime)
        if loss is None:
            return
        if self.notify is not None:
            self.notify(f"validation loss at step {step}: {loss:.4f}")
        if self.tensorboard is not None:
            self.tensorboard.validation(step, loss)

    def step_done(self, step: int, loss: float, learning_rate: float, stats: dict) -> None:
        """Step `step` (steps done, counting it) finished."""
        if self.tensorboard is not None:
            self.tensorboard.step(step - 1, loss, learning_rate, stats)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()

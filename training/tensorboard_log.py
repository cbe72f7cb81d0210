"""TensorBoard scalars of a training run, written when the optional `tensorboard` package is installed.

The package is imported only when a log folder is asked for (a Train node's log_dir, or `tightrope run --log-dir`);
without it that request is refused before training, with the command that installs it. Scalars, at the step's
index (the steps done before it, as the loss plot counts; a validation loss at the steps done when it was scored):
  train/loss, train/learning_rate, validation/loss,
  memory/peak_allocated_gib (CUDA: measured only there), transfer/h2d_gb_per_s (the bytes of offloaded weights
  streamed in a step over the step's time: the rate the step sustained, written when the step streamed any).
Several runs may write to one folder: TensorBoard merges their event files by step.
"""
from __future__ import annotations

from pathlib import Path

from .train_config import ConfigError


def summary_writer_class(log_dir: str | Path, setting: str = "log_dir") -> type:
    """torch's SummaryWriter, once `log_dir` is known to be a folder it can create and write: a ConfigError with the
    install command when tensorboard is missing, an OutputPathError naming the setting when the folder cannot be
    written. setting: what asked for the logs, as the user wrote it (the Train node's log_dir, or --log-dir)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # torch raises it (with its own message) when the tensorboard package is absent
        off = "leave log_dir empty" if setting == "log_dir" else f"run without {setting}"
        raise ConfigError(f"{setting}='{log_dir}' asks for TensorBoard logs, which need the tensorboard package: "
                          f"`pip install tensorboard` (into the Python that runs Tightrope), or {off}") from None
    from .input_checks import check_writable_folder  # here: TensorBoard would fail only at the first scalar
    other = "set another log_dir" if setting == "log_dir" else f"pass another {setting}"
    check_writable_folder(log_dir, f"{setting}={str(log_dir)!r}", other=other, elsewhere=other)
    return SummaryWriter


class TensorBoardLog:
    """One run's event file in `log_dir`, opened at the first scalar written."""

    def __init__(self, log_dir: str | Path):
        self.log_dir = Path(log_dir)
        self._writer_class = summary_writer_class(log_dir)  # fails now, before training, if not installed
        self._writer = None

    def _write(self, tag: str, value: float, step: int) -> None:
        if self._writer is None:
            self._writer = self._writer_class(log_dir=str(self.log_dir))
        self._writer.add_scalar(tag, value, step)

    def step(self, index: int, loss: float, learning_rate: float, stats: dict) -> None:
        self._write("train/loss", loss, index)
        self._write("train/learning_rate", learning_rate, index)
        if stats.get("peak_allocated_bytes"):
            self._write("memory/peak_allocated_gib", stats["peak_allocated_bytes"] / 2**30, index)
        if stats.get("h2d_bytes") and stats.get("step_time_s"):
            self._write("transfer/h2d_gb_per_s", stats["h2d_bytes"] / stats["step_time_s"] / 1e9, index)

    def validation(self, step: int, loss: float) -> None:
        self._write("validation/loss", loss, step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()  # flushes
            self._writer = None

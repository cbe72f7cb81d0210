"""Write a session's LoRA to a file (the Save node's one call): straight from its state, no model needed. If the file
cannot be written (disk full, folder not writable), the LoRA goes to a fallback file and the error names both.

With an EMA (the Train node's ema_decay > 0) the averaged weights can go to a second file, `<prefix>_ema_NNNNN_`,
written by the same writer in the same ComfyUI key format, so LoraLoader applies either file."""
from __future__ import annotations

from pathlib import Path

import torch

from .lora.files import save_lora_state
from .lora.rescue import rescue_lora
from .session import TrainingSession
from .train_config import ConfigError
from .trainer import run_metadata

EMA_SUFFIX = "_ema"


def save_session_lora(session: TrainingSession, folder: Path, filename_prefix: str) -> Path:
    if session.lora_state is None:
        raise ConfigError("the session has not trained a step yet: run a Train node before saving")
    return _write(session, session.lora_state, folder, filename_prefix, run_metadata(session, session.step))


def save_session_ema(session: TrainingSession, folder: Path, filename_prefix: str) -> Path | None:
    """The EMA weights as `<filename_prefix>_ema_NNNNN_.safetensors`; None when the session kept no EMA."""
    if session.ema_state is None:
        return None
    metadata = run_metadata(session, session.step) | {"tightrope.ema_decay": repr(session.config.ema_decay)}
    return _write(session, session.ema_state, folder, filename_prefix + EMA_SUFFIX, metadata)


def _write(session: TrainingSession, state: dict[str, torch.Tensor], folder: Path, filename_prefix: str,
           metadata: dict[str, str]) -> Path:
    try:
        return save_lora_state(folder, filename_prefix, state, session.lora, metadata=metadata)
    except OSError as e:
        raise rescue_lora(e, state, session.lora, folder=folder, filename_prefix=filename_prefix,
                          metadata=metadata, step=session.step) from e

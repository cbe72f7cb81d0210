"""Write a session's LoRA to a file (the Save node's one call): straight from its state, no model needed. If the file
cannot be written (disk full, folder not writable), the LoRA goes to a fallback file and the error names both."""
from __future__ import annotations

from pathlib import Path

from .lora.files import save_lora_state
from .lora.rescue import rescue_lora
from .session import TrainingSession
from .train_config import ConfigError
from .trainer import run_metadata


def save_session_lora(session: TrainingSession, folder: Path, filename_prefix: str) -> Path:
    if session.lora_state is None:
        raise ConfigError("the session has not trained a step yet: run a Train node before saving")
    metadata = run_metadata(session, session.step)
    try:
        return save_lora_state(folder, filename_prefix, session.lora_state, session.lora, metadata=metadata)
    except OSError as e:
        raise rescue_lora(e, session.lora_state, session.lora, folder=folder, filename_prefix=filename_prefix,
                          metadata=metadata, step=session.step) from e

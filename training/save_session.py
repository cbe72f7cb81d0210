"""Write a session's LoRA to a file (the Save node's one call): straight from its state, no model needed."""
from __future__ import annotations

from pathlib import Path

from .lora_file import save_lora_state
from .session import TrainingSession
from .train_config import ConfigError
from .trainer import lora_metadata


def save_session_lora(session: TrainingSession, folder: Path, filename_prefix: str) -> Path:
    if session.lora_state is None:
        raise ConfigError("the session has not trained a step yet: run a Train node before saving")
    return save_lora_state(folder, filename_prefix, session.lora_state, session.lora,
                           metadata=lora_metadata(session, session.step))

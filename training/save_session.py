"""Write a session's LoRA to a file (the Save node's one call): straight from its state. If the file cannot be
written (disk full, folder not writable), the LoRA goes to a fallback file and the error names both.

With an EMA (the Train node's ema_decay > 0) the averaged weights can go to a second file, `<prefix>_ema_NNNNN_`,
written by the same writer in the same ComfyUI key format, so LoraLoader applies either file.

A DoRA file for ComfyUI (dora_for='comfyui') needs the base weights of its layers (lora/dora_scale.py): they are
read from the session's model as training sees it (the adapter's training module), one layer at a time."""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from ..memory.ema import ema_weights
from .lora.dora_scale import BaseWeight, base_weight_of, check_dora_for
from .lora.files import save_lora_state
from .lora.rescue import rescue_lora
from .state.atomic_write import next_counter
from .models import adapter_for
from .session import TrainingSession
from .train_config import ConfigError
from .trainer import run_metadata

EMA_SUFFIX = "_ema"


def save_session_lora(session: TrainingSession, folder: Path, filename_prefix: str,
                      dora_for: str = "comfyui", *, with_ema: bool = False) -> Path:
    """The LoRA as `<filename_prefix>_NNNNN_.safetensors`. with_ema: its EMA is saved next (save_session_ema with
    this file's counter), so NNNNN is free for both: the pair keeps one number even where an earlier save wrote one
    file of a pair and not the other (a stop between them)."""
    if session.lora_state is None:
        raise ConfigError("the session has not trained a step yet: run a Train node before saving")
    at_least = next_counter(folder, filename_prefix + EMA_SUFFIX) if with_ema and session.ema_state is not None \
        else 1
    with _base_weights(session, dora_for) as base_weight:
        return _write(session, session.lora_state, folder, filename_prefix, run_metadata(session, session.step),
                      dora_for, base_weight, at_least)


def save_session_ema(session: TrainingSession, folder: Path, filename_prefix: str,
                     dora_for: str = "comfyui", *, at_least: int = 1) -> Path | None:
    """The EMA weights as `<filename_prefix>_ema_NNNNN_.safetensors` (NNNNN at least `at_least`: the LoRA file's
    counter); None when the session kept no EMA."""
    if session.ema_state is None:
        return None
    metadata = run_metadata(session, session.step) | {"tightrope.ema_decay": repr(session.config.ema_decay)}
    with _base_weights(session, dora_for) as base_weight:
        return _write(session, ema_weights(session.ema_state), folder, filename_prefix + EMA_SUFFIX, metadata,
                      dora_for, base_weight, at_least)


@contextlib.contextmanager
def _base_weights(session: TrainingSession, dora_for: str):
    """Layer name -> base weight, for a DoRA saved for ComfyUI; None (nothing opened) otherwise."""
    if session.lora.algorithm != "dora" or check_dora_for(dora_for) != "comfyui":
        yield None
        return
    with adapter_for(session.model).training_module() as module:
        yield base_weight_of(module)


def _write(session: TrainingSession, state: dict[str, torch.Tensor], folder: Path, filename_prefix: str,
           metadata: dict[str, str], dora_for: str, base_weight: BaseWeight | None, at_least: int = 1) -> Path:
    try:
        return save_lora_state(folder, filename_prefix, state, session.lora, metadata=metadata, dora_for=dora_for,
                               base_weight=base_weight, at_least=at_least)
    except OSError as e:
        raise rescue_lora(e, state, session.lora, folder=folder, filename_prefix=filename_prefix,
                          metadata=metadata, step=session.step, dora_for=dora_for, base_weight=base_weight) from e

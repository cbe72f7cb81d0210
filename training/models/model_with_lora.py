"""The MODEL output of a training node: the input model with the session's LoRA applied, input left untouched."""
from __future__ import annotations

from ..session import TrainingSession
from . import adapter_for


def model_with_lora(session: TrainingSession, strength: float = 1.0):
    if session.lora_state is None:
        return session.model
    return adapter_for(session.model).with_lora_state(session.lora, session.lora_state, strength)

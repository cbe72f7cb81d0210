"""The MODEL output of a training node: the input model with the session's LoRA applied, input left untouched."""
from __future__ import annotations

import copy

from ..lora.layers import inject_lora, load_lora_state, merge_and_remove_lora
from .adapter import ReferenceFluxModel, adapter_for
from ..session import TrainingSession


def model_with_lora(session: TrainingSession, strength: float = 1.0):
    if session.lora_state is None:
        return session.model
    adapter = adapter_for(session.model)
    if isinstance(adapter, ReferenceFluxModel):
        flux = copy.deepcopy(adapter.flux)
        inject_lora(flux, session.lora, adapter.family)
        load_lora_state(flux, session.lora_state)
        merge_and_remove_lora(flux, strength)
        return ReferenceFluxModel(flux, adapter.base_name)
    return adapter.with_lora_state(session.lora, session.lora_state, strength)  # ComfyUI: patches on a clone

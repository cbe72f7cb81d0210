"""A LoRA that cannot be written where it was asked for (disk full, a folder that is not writable) is still kept: in
a fallback file at the root of the save folder (the output folder headless, ComfyUI's loras folder), else in the
system temp folder; the message names the file that could not be written and the file that was kept."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from torch import Tensor

from ..state.atomic_write import FileWriteError, safe_output_path
from .dora_scale import BaseWeight
from .layers import LoraSpec
from .files import save_lora_state

RESCUE_PREFIX = "tightrope_rescue_"


class LoraNotSavedError(OSError):
    """The LoRA could not be written where asked; the message names that file and the fallback file kept (if any).
    errno is the failed write's."""

    def __init__(self, message: str, code: int | None):
        super().__init__(message)
        self.errno = code

    def __str__(self) -> str:
        return self.args[0]


def rescue_lora(error: OSError, state: dict[str, Tensor], spec: LoraSpec, *, folder: str | os.PathLike,
                filename_prefix: str, metadata: dict[str, str], step: int, dora_for: str = "comfyui",
                base_weight: BaseWeight | None = None) -> LoraNotSavedError:
    """Write `state` to a fallback file after writing it to `folder`/`filename_prefix` failed with `error`; returns
    the error to raise or warn with (it names both files, or every place tried if no copy could be written).
    `dora_for`, `base_weight`: as for save_lora_state (a DoRA's dora_scale)."""
    failed = error if isinstance(error, FileWriteError) else \
        FileWriteError(Path(error.filename or safe_output_path(folder, filename_prefix)), error.errno,
                       error.strerror or str(error))
    name = f"{RESCUE_PREFIX}{safe_output_path(folder, filename_prefix).name}_step{step}"
    head = f"could not write the LoRA of step {step} to '{failed.path}' ({failed.strerror})"
    tried = []
    for place in dict.fromkeys([Path(folder), Path(tempfile.gettempdir())]):
        try:
            kept = save_lora_state(place, name, state, spec, metadata=metadata, dora_for=dora_for,
                                   base_weight=base_weight)
        except OSError as e:
            tried.append(f"'{place}' ({e.strerror or e})")
            continue
        return LoraNotSavedError(f"{head}; the trained LoRA was kept in '{kept}' instead (a complete LoRA file): "
                                 f"{failed.fix}, then move it where you want it", failed.errno)
    return LoraNotSavedError(f"{head}, and no copy could be kept in {' or '.join(tried)}: {failed.fix}",
                             failed.errno)

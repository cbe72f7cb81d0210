"""Tightrope: LoRA training for large diffusion transformers on small GPUs.

ComfyUI imports this folder from custom_nodes/ and reads the two mappings below.
"""
from .versions import require_supported

require_supported()  # an older Python, torch or peft: one line saying what is needed, before peft is imported

from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS  # noqa: E402

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]

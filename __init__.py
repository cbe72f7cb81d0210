"""Tightrope: LoRA training for large diffusion transformers on small GPUs.

ComfyUI imports this folder from custom_nodes/ and reads the two mappings below.
"""
from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]

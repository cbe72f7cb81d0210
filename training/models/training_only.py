"""Tightrope's stand-ins that travel on ComfyUI's MODEL / CLIP / VAE wires (the demo and reference Flux, the demo
encoders) so Tightrope's nodes take them like loaded ones. ComfyUI's own nodes (KSampler, CLIPTextEncode,
LoraLoader, ...) accept any object of those types and call ModelPatcher / CLIP methods on it: an attribute a stand-in
lacks then names the mismatch and the fix, rather than surfacing as a bare AttributeError from ComfyUI's code."""
from __future__ import annotations


class TrainingOnly:
    WHAT = "model"            # what it stands in for, in the message
    REAL_ONE = "a real one"   # the ComfyUI loader to use instead

    def __getattr__(self, name: str):
        """Only called for attributes the object lacks."""
        if name.startswith("__") or name.startswith("_"):
            raise AttributeError(name)  # copy/pickle probes, and private lookups before __init__ has run
        raise AttributeError(f"{type(self).__name__} has no '{name}': it is Tightrope's training-only {self.WHAT}, "
                             f"not a ComfyUI {self.WHAT}, so ComfyUI's own nodes cannot use it; wire it to Tightrope's "
                             f"nodes only, or load {self.REAL_ONE}")

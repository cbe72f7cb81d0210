"""LoRA setup node: what to train (peft LoRA), not yet on which model (presets resolve per model family)."""
from __future__ import annotations

import os

from ..training.input_checks import check_existing_lora
from ..training.lora.algorithms import ALGORITHMS
from ..training.lora.layers import INITS, LoraSpec, resolve_existing_lora
from ..training.lora.targets import PRESETS
from . import host
from .input_validation import validation_result


class TightropeLoraSetup:
    DESCRIPTION = "LoRA settings (peft). Target presets resolve to the right layer names for Flux, SD3.5, Lumina 2, "\
                  "Wan and Qwen-Image."
    CATEGORY = "Tightrope/train"
    RETURN_TYPES = ("TIGHTROPE_LORA",)
    RETURN_NAMES = ("lora",)
    FUNCTION = "setup"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "rank": ("INT", {"default": 16, "min": 1, "max": 1024, "tooltip": "LoRA rank r: capacity and file size."}),
            "alpha": ("FLOAT", {"default": 16.0, "min": 0.01, "max": 4096.0, "step": 0.5,
                                "tooltip": "Scale alpha: the update is multiplied by alpha/r (alpha/sqrt(r) with "
                                           "rsLoRA). alpha = rank keeps the scale at 1."}),
            "rslora": ("BOOLEAN", {"default": False, "tooltip": "Rank-stabilised scaling alpha/sqrt(r)."}),
            "dropout": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 0.9, "step": 0.01,
                                  "tooltip": "Dropout on the LoRA input during training."}),
            "targets": (list(PRESETS), {"default": "attention",
                                        "tooltip": "Which layers get a LoRA (per model family)."}),
            "init": (list(INITS), {"default": "default",
                                   "tooltip": "default: A random, B zero (the LoRA starts as a no-op)."}),
        }, "optional": {
            "target_regex": ("STRING", {"default": "", "tooltip": "Overrides the preset: a regex matched against "
                                                                   "full module names, e.g. .*img_attn\\.qkv"}),
            "existing_lora": ("STRING", {"default": "", "tooltip": "A .safetensors LoRA (a path, or a name in the "
                                                                    "loras folder) to continue training from."}),
            "algorithm": (list(ALGORITHMS), {"default": "lora", "tooltip": "lora: low-rank B @ A. dora: LoRA plus a "
                                             "trained magnitude per output (DoRA). loha: Hadamard product of two "
                                             "low-rank pairs. lokr: Kronecker product (small files). LoHa/LoKr take "
                                             "no dropout. Saved with the keys ComfyUI's LoRA loaders read."}),
        }}

    @classmethod
    def VALIDATE_INPUTS(cls, **inputs):
        """Before anything runs: every widget in range, the regex compiles, the LoRA to continue from is readable."""
        regex, existing = inputs.get("target_regex"), inputs.get("existing_lora")
        algorithm = inputs.get("algorithm") or "lora"  # a workflow saved before the widget existed: lora
        combination = {k: inputs[k] for k in ("dropout", "init", "algorithm") if inputs.get(k) is not None}
        return validation_result(cls, inputs, lambda: not regex or LoraSpec(target_regex=regex),
                                 lambda: LoraSpec(**combination),
                                 lambda: not existing or check_existing_lora(existing, host.loras_dir(), algorithm,
                                                                             inputs.get("rank")))

    @classmethod
    def IS_CHANGED(cls, existing_lora="", **inputs):
        """ComfyUI reuses cached results while the inputs are the same: a LoRA to continue from that was saved again
        under the same name (its size or modification time) counts as changed, so training starts from the new one."""
        if not existing_lora or not isinstance(existing_lora, str):
            return ""
        try:
            stat = os.stat(resolve_existing_lora(existing_lora, host.loras_dir()))
        except Exception:  # noqa: BLE001 - unresolvable: the input check reports it
            return "missing"
        return f"{stat.st_size}:{stat.st_mtime_ns}"

    def setup(self, rank, alpha, rslora, dropout, targets, init, target_regex="", existing_lora="", algorithm="lora"):
        existing = check_existing_lora(existing_lora, host.loras_dir(), algorithm) if existing_lora else None
        return (LoraSpec(rank=rank, alpha=alpha, rslora=rslora, dropout=dropout, targets=targets,
                         target_regex=target_regex or None, init=init, existing_lora=existing,
                         algorithm=algorithm),)

"""Memory strategy node: every field of the runtime's Strategy, or 'auto' from a VRAM budget (the planner)."""
from __future__ import annotations

from ..memory import strategy as s
from ..training.distributed import launch_sharding
from ..training.strategy_choice import AutoStrategy
from .input_validation import validation_result

_D = s.Strategy().to_flat()  # the widgets are the Strategy's flat fields (Strategy.of maps them onto its parts)


class TightropeMemoryStrategy:
    DESCRIPTION = "How the model is laid out in GPU memory while training. 'auto' measures the model and picks the "\
                  "fastest strategy that fits the VRAM budget."
    CATEGORY = "Tightrope/train"
    RETURN_TYPES = ("TIGHTROPE_STRATEGY",)
    RETURN_NAMES = ("strategy",)
    FUNCTION = "make"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "mode": (["manual", "auto"], {"default": "manual",
                                         "tooltip": "auto: plan from vram_budget_gb (the other settings are ignored)."}),
            "vram_budget_gb": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 1024.0, "step": 0.5,
                                         "tooltip": "auto mode: GPU memory to fit in, in GB; 0 = free memory now "
                                                    "minus a safety margin."}),
            "offload_fraction": ("FLOAT", {"default": _D["offload_fraction"], "min": 0.0, "max": 1.0, "step": 0.05,
                                           "tooltip": "Share of the transformer blocks' weights kept in host "
                                                      "memory and streamed to the GPU block by block."}),
            "offload_policy": (list(s.OFFLOAD_POLICIES), {"default": _D["offload_policy"],
                                                           "tooltip": "spread: small blocks first, spaced out so "
                                                                      "transfers hide behind resident blocks."}),
            "prefetch_depth": ("INT", {"default": _D["prefetch_depth"], "min": 0, "max": s.MAX_PREFETCH_DEPTH,
                                       "tooltip": "Offloaded blocks copied ahead of use (each costs one block "
                                                  "of GPU memory)."}),
            "activation_offload": ("BOOLEAN", {"default": _D["activation_offload"],
                                               "tooltip": "Keep checkpointed blocks' inputs in host memory until "
                                                          "backward needs them."}),
            "checkpoint": (list(s.CHECKPOINT_MODES), {"default": _D["checkpoint"],
                                                       "tooltip": "Recompute block activations in backward instead "
                                                                  "of storing them."}),
            "checkpoint_every": ("INT", {"default": _D["checkpoint_every"], "min": 1, "max": 1000,
                                         "tooltip": "every_n: checkpoint one block in N (2 = about half the "
                                                    "activation memory for ~10% time)."}),
            "compile": (list(s.COMPILE_MODES), {"default": _D["compile"],
                                                 "tooltip": "per_block: torch.compile each block (fast to compile, "
                                                            "reused by all blocks of a type)."}),
            "activation_memory_budget": ("FLOAT", {"default": _D["activation_memory_budget"], "min": 0.0, "max": 1.0,
                                                   "step": 0.05, "tooltip": "Compiled blocks: share of activations "
                                                                            "kept; below 1 the compiler recomputes "
                                                                            "cheap ops instead of checkpointing."}),
            "compile_mode": (list(s.COMPILE_OPTIONS), {"default": _D["compile_mode"],
                                                        "tooltip": "torch.compile mode."}),
            "compute_dtype": (list(s.DTYPES), {"default": _D["compute_dtype"],
                                                "tooltip": "Autocast dtype of the forward and backward."}),
            "weight_dtype": (list(s.WEIGHT_DTYPES), {"default": _D["weight_dtype"],
                                                      "tooltip": "Dtype the frozen base weights are kept and moved "
                                                                 "in; auto keeps the model's."}),
            "pin_memory": ("BOOLEAN", {"default": _D["pin_memory"],
                                       "tooltip": "Page-lock host copies for asynchronous copies (CUDA)."}),
        }, "optional": {
            "host_ram_budget_gb": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 65536.0, "step": 0.5,
                                             "tooltip": "auto mode: host RAM the run may use, the model included, "
                                                        "in GB; 0 = available RAM now minus a safety margin."}),
            "token_chunks": ("INT", {"default": _D["token_chunks"], "min": 1, "max": 64,
                                     "tooltip": "Run each block's token-wise layers in this many chunks, recomputed "
                                                "in backward: a much smaller per-block working set at high "
                                                "resolution for one more forward of those layers. 1 = off."}),
            "optimizer_offload": ("BOOLEAN", {"default": _D["optimizer_offload"],
                                              "tooltip": "Keep the LoRA's gradients and optimizer state in host "
                                                         "memory and step the optimizer on the CPU: 12 bytes less GPU "
                                                         "memory per LoRA weight with AdamW, for a CPU step per "
                                                         "step. Not with adamw8bit or schedule-free."}),
        }}

    @classmethod
    def VALIDATE_INPUTS(cls, **inputs):
        """Before anything runs: every widget in range, and (manual mode) the fields fit together."""
        names = [n for n in cls.INPUT_TYPES()["required"] if n not in ("mode", "vram_budget_gb")]
        fields = {n: inputs.get(n) for n in names}
        for name in ("token_chunks", "optimizer_offload"):  # optional: workflows saved before them leave them out
            if name in inputs:
                fields[name] = inputs[name]

        def fields_fit():
            if inputs.get("mode") == "manual" and None not in fields.values():  # linked values are not known yet
                s.Strategy.of(**fields).replace(sharding=launch_sharding())  # under torchrun --fsdp: sharded too
        return validation_result(cls, inputs, fields_fit)

    def make(self, mode, vram_budget_gb, host_ram_budget_gb=0.0, **fields):
        if mode not in ("manual", "auto"):  # a null in an API prompt reaches here: ComfyUI cannot tell it from a link
            raise s.StrategyError(f"input 'mode' is {mode!r}: choose 'manual' or 'auto'")
        if mode == "auto":
            return (AutoStrategy(vram_budget_gb=vram_budget_gb, host_ram_budget_gb=host_ram_budget_gb),)
        return (s.Strategy.of(**fields),)

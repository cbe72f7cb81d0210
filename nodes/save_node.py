"""Save LoRA node: writes the session's LoRA where ComfyUI's LoraLoader finds it, never overwriting."""
from __future__ import annotations

from ..training.distributed import on_main_rank
from ..training.input_checks import check_output_target
from ..training.save_session import save_session_ema, save_session_lora
from . import host
from .input_validation import validation_result


class TightropeSaveLora:
    DESCRIPTION = "Writes the trained LoRA (.safetensors, keys ComfyUI's LoraLoader applies) to the loras folder "\
                  "(the output folder headless), and its EMA as a second file ending in _ema when the Train node "\
                  "kept one. Never overwrites: a counter is added to the name."
    CATEGORY = "Tightrope/train"
    RETURN_TYPES = ("STRING",)
    RETURN_NAMES = ("path",)
    FUNCTION = "save"
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "session": ("TIGHTROPE_SESSION", {"tooltip": "The trained session (from a Train node)."}),
            "filename_prefix": ("STRING", {"default": "tightrope/my_lora",
                                           "tooltip": "File name inside the loras folder; subfolders allowed, "
                                                      "'..' and absolute paths are not."}),
        }, "optional": {
            "save_ema": ("BOOLEAN", {"default": True,
                                     "tooltip": "Also write the EMA weights (Train node ema_decay > 0) as "
                                                "<prefix>_ema_NNNNN_.safetensors (its path is shown under the "
                                                "node); nothing more without an EMA."}),
        }}

    @classmethod
    def VALIDATE_INPUTS(cls, **inputs):
        """Before any training: the file name is safe and the loras folder can be written."""
        prefix = inputs.get("filename_prefix")
        return validation_result(cls, inputs, lambda: prefix is None or check_output_target(host.loras_dir(), prefix))

    def save(self, session, filename_prefix, save_ema=True):
        check_output_target(host.loras_dir(), filename_prefix)
        # under torchrun rank 0 writes and every rank gets its paths
        path = on_main_rank(lambda: save_session_lora(session, host.loras_dir(), filename_prefix))
        ema = on_main_rank(lambda: save_session_ema(session, host.loras_dir(), filename_prefix)) if save_ema else None
        paths = [str(path)] + ([str(ema)] if ema is not None else [])
        return {"ui": {"text": paths}, "result": (str(path),)}

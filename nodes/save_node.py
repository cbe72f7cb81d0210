"""Save LoRA node: writes the session's LoRA where ComfyUI's LoraLoader finds it, never overwriting."""
from __future__ import annotations

from ..memory.host_memory import release_freed_host_memory
from ..training.distributed import on_main_rank
from ..training.input_checks import check_output_target
from ..training.lora.dora_scale import DORA_FOR, check_dora_for
from ..training.save_session import save_session_ema, save_session_lora
from ..training.state.atomic_write import file_counter
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
            "dora_for": (list(DORA_FOR), {"default": "comfyui",
                                          "tooltip": "DoRA only: where the file will be used. 'comfyui': exact in "
                                                     "ComfyUI as released, which divides DoRA's rows by the base "
                                                     "weight's norm (the file folds that in; recorded in its "
                                                     "metadata). 'standard': the LyCORIS/peft DoRA scale, for "
                                                     "tools that divide by the norm of the updated weight (and "
                                                     "ComfyUI once PR #15458 lands). Continuing training reads "
                                                     "either back exactly."}),
        }}

    @classmethod
    def VALIDATE_INPUTS(cls, **inputs):
        """Before any training: the file name is safe and the loras folder can be written."""
        prefix = inputs.get("filename_prefix")
        return validation_result(cls, inputs, lambda: prefix is None or check_output_target(host.loras_dir(), prefix))

    def save(self, session, filename_prefix, save_ema=True, dora_for="comfyui"):
        check_output_target(host.loras_dir(), filename_prefix)
        check_dora_for(dora_for)
        # under torchrun rank 0 writes and every rank gets its paths
        path = on_main_rank(lambda: save_session_lora(session, host.loras_dir(), filename_prefix, dora_for,
                                                      with_ema=save_ema))
        ema = on_main_rank(lambda: save_session_ema(session, host.loras_dir(), filename_prefix, dora_for,
                                                    at_least=file_counter(path))) if save_ema else None
        paths = [str(path)] + ([str(ema)] if ema is not None else [])
        release_freed_host_memory()  # the file's serialised bytes and state-dict copies are freed now
        return {"ui": {"text": paths}, "result": (str(path),)}

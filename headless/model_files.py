"""What to tell a user whose model file a core ComfyUI loader could not find or read (headless, ComfyUI as a
library): one line naming the file and the fix, instead of the loader's own exception."""
from __future__ import annotations

import os

from .graph import NodeSpec

# Model folders of core loader inputs, for the "model file not found" message (other inputs: found by their list).
MODEL_INPUT_FOLDERS = {
    ("UNETLoader", "unet_name"): ("diffusion_models",), ("CheckpointLoaderSimple", "ckpt_name"): ("checkpoints",),
    ("VAELoader", "vae_name"): ("vae", "vae_approx"), ("CLIPLoader", "clip_name"): ("text_encoders",),
    ("DualCLIPLoader", "clip_name1"): ("text_encoders",), ("DualCLIPLoader", "clip_name2"): ("text_encoders",),
    ("TripleCLIPLoader", "clip_name1"): ("text_encoders",), ("TripleCLIPLoader", "clip_name2"): ("text_encoders",),
    ("TripleCLIPLoader", "clip_name3"): ("text_encoders",), ("LoraLoader", "lora_name"): ("loras",),
    ("LoraLoaderModelOnly", "lora_name"): ("loras",), ("CLIPVisionLoader", "clip_name"): ("clip_vision",),
    ("ControlNetLoader", "control_net_name"): ("controlnet",), ("StyleModelLoader", "style_model_name"):
    ("style_models",), ("UpscaleModelLoader", "model_name"): ("upscale_models",),
}


def model_file_failure(node: NodeSpec, exc: Exception, comfyui_version: str) -> str | None:
    """For a core loader that failed reading its model file: one line naming the file and what to do (None if the
    node has no model file or it is not the file's fault)."""
    import folder_paths
    files = []
    for (class_type, name), folders in MODEL_INPUT_FOLDERS.items():
        value = node.inputs.get(name)
        if class_type != node.class_type or not isinstance(value, str):
            continue
        files += [path for folder in folders if (path := folder_paths.get_full_path(folder, value))]
    if not files:
        return None
    path, kind, text = _failed_file(exc, files), type(exc).__name__, str(exc)
    first_line = text.strip().splitlines()[0] if text.strip() else ""
    try:
        with open(path, "rb") as handle:
            head = handle.read(9)
    except OSError:
        head = b""
    looks_safetensors = len(head) == 9 and head[8:9] == b"{"
    if kind == "SafetensorError" or "deserializing header" in text:
        return (f"{kind}: {first_line}: model file {path} is damaged, incomplete (an interrupted download?) or not a "
                f"safetensors file: download it again")
    if kind == "UnpicklingError" and looks_safetensors:
        return (f"model file {path} is a safetensors file with another extension, which ComfyUI reads as a pickle "
                f"(and refuses): rename it to {os.path.splitext(os.path.basename(path))[0]}.safetensors")
    if kind == "UnpicklingError":
        return (f"{kind}: {first_line.split('. ')[0]}: model file {path} is not a model file torch reads safely: "
                f"use the model's .safetensors release")
    if "Could not detect model type" in text:
        return (f"{kind}: {first_line}: ComfyUI {comfyui_version} recognises no model in its keys (keys with an "
                f"extra prefix such as 'diffusion_model.' or 'transformer.', or a model family it does not know): "
                f"use the model's original release file")
    return None


def _failed_file(exc: Exception, files: list[str]) -> str:
    """Which of the node's model files `exc` came from: the one ComfyUI's load_torch_file was reading when it raised
    (a loader of several files, DualCLIPLoader say, reads them in turn), else the node's first."""
    reading, tb = None, exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "load_torch_file" and isinstance(tb.tb_frame.f_locals.get("ckpt"), str):
            reading = tb.tb_frame.f_locals["ckpt"]
        tb = tb.tb_next
    same = [f for f in files if reading is not None and os.path.abspath(f) == os.path.abspath(reading)]
    return same[0] if same else files[0]


def missing_file_hint(folder_paths, value: str, folders: tuple, searched: list, choices: list) -> str:
    """What to do about a model file the loader's list lacks: the file is there but of a type the loader does not
    read (GGUF), it is in another model folder (a checkpoint given to Load Diffusion Model), the value is a path, or
    a listed name is close; else put it in a folder or point at the models."""
    import difflib
    default = ("put the file in one of them, or point at your models with --models-dir DIR or ComfyUI's "
               "extra_model_paths.yaml")
    here = [os.path.join(d, value) for d in searched if os.path.isfile(os.path.join(d, value))]
    if here and value.lower().endswith(".gguf"):
        return (f"it is there ({here[0]}), but a GGUF file is loaded by ComfyUI-GGUF's Unet Loader (GGUF) "
                f"(UnetLoaderGGUF), not by this loader: use that node and run with --custom-node "
                f"/path/to/ComfyUI/custom_nodes/ComfyUI-GGUF")
    if here:
        return (f"it is there ({here[0]}), but this loader reads only "
                f"{', '.join(sorted(folder_paths.supported_pt_extensions))} files: save it as .safetensors")
    if os.path.isabs(value) or (os.path.dirname(value) and os.path.isfile(value)):  # a bare name: not a path
        return (f"{value!r} is a path: this input takes a file name inside those folders (as the loader's list shows "
                f"it); pass the folder that holds diffusion_models/, checkpoints/ ... as --models-dir, or "
                f"put the file in one of them")
    loaders = {"checkpoints": "Load Checkpoint (CheckpointLoaderSimple)",
               "diffusion_models": "Load Diffusion Model (UNETLoader)"}
    for other, loader in loaders.items():
        if other in folders or other not in folder_paths.folder_names_and_paths:
            continue
        if value in folder_paths.get_filename_list(other):
            # another model loader's file: that loader may be the fix; a LoRA, VAE ... there is only misplaced
            use = f"load it with {loader}, or " if set(folders) & set(loaders) else ""
            return (f"it is in ComfyUI's {other} folder ({folder_paths.get_full_path(other, value)}): {use}move it "
                    f"into one of the folders above")
    stems = {}
    for choice in choices:  # compared without extensions, which every name shares
        stems.setdefault(os.path.splitext(choice)[0], choice)
    close = [stems[s] for s in difflib.get_close_matches(os.path.splitext(value)[0], list(stems), n=3, cutoff=0.6)]
    if close:
        return f"did you mean {' or '.join(map(repr, close))}? Else {default}"
    listed = f" (they hold {len(choices)} model file(s), e.g. {', '.join(map(repr, choices[:3]))})" if choices else \
        " (they hold no model file)"
    return default + listed

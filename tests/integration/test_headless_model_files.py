"""Model files users bring to `tightrope run --comfyui`, each refused before training with one line naming the file
and the fix: an NVFP4 checkpoint (ComfyUI's quantized layers in a format Tightrope does not train; a scaled-fp8 one
trains: test_comfy_scaled_fp8.py), a GGUF file given to the core UNETLoader, a checkpoint in the wrong folder, a
truncated download, a safetensors file named .ckpt, keys with an extra prefix. All runs share one ComfyUI process
(headless_batch.py)."""
import json

import pytest
from api_graph import Graph
from comfy_env import run_headless_batch
from safetensors.torch import load_file, save_file
from tiny_models import write_scaled_fp8

from tightrope.demo.tiny_checkpoint import make_tiny_checkpoint


def _models(models):
    dm = models / "diffusion_models"
    base = make_tiny_checkpoint(dm / "flux.safetensors", seed=3)
    sd = load_file(base)
    write_scaled_fp8(dm / "flux_nvfp4.safetensors", base, "nvfp4")
    save_file({f"diffusion_model.{k}": v for k, v in sd.items()}, str(dm / "flux_prefixed.safetensors"))
    data = open(base, "rb").read()
    (dm / "flux_truncated.safetensors").write_bytes(data[: len(data) // 2])
    (dm / "flux_renamed.ckpt").write_bytes(data)
    (dm / "flux-Q8_0.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 64)
    (models / "checkpoints").mkdir()
    (models / "checkpoints" / "flux_ckpt.safetensors").write_bytes(data)
    (dm / "my_style_lora.safetensors").write_bytes(data)  # a LoRA downloaded into the wrong folder
    te = models / "text_encoders"
    te.mkdir()
    (te / "clip_l.safetensors").write_bytes(data)  # read first, and fine
    (te / "t5_truncated.safetensors").write_bytes(data[: len(data) // 2])
    (te / "t5_renamed.pt").write_bytes(data)


def _dual_clip(clip_name2: str) -> dict:
    """Two text encoders, the second one bad: the message names the second."""
    g = Graph()
    clip = g.add("DualCLIPLoader", clip_name1="clip_l.safetensors", clip_name2=clip_name2, type="flux",
                 device="default")
    g.add("CLIPSave", clip=[clip, 0], filename_prefix="clip/x")
    return g.nodes


def _workflow(name: str, lora: str | None = None) -> dict:
    g = Graph()
    unet = g.add("UNETLoader", unet_name=name, weight_dtype="default")
    if lora:
        unet = g.add("LoraLoaderModelOnly", model=[unet, 0], lora_name=lora, strength_model=1.0)
    cond = g.add("TightropeDemoConditioning", model=[unet, 0], text="a red circle", tokens=8)
    latent = g.add("EmptySD3LatentImage", width=64, height=64, batch_size=1)
    dataset = g.add("TightropeDatasetFromLatents", latent=[latent, 0], conditioning=[cond, 0])
    lora = g.add("TightropeLoraSetup", rank=4, alpha=4.0, targets="attention_mlp")
    train = g.add("TightropeTrain", steps=1, learning_rate=0.01, device="cpu", filename_prefix="t/x",
                  model=[unet, 0], dataset=[dataset, 0], lora=[lora, 0])
    g.add("TightropeSaveLora", session=[train, 0], filename_prefix="t/x_final")
    return g.nodes


CASES = {  # case -> (file, exit code, what the one error line must hold)
    "nvfp4": ("flux_nvfp4.safetensors", 2, ["flux_nvfp4.safetensors: its weights are stored quantized as nvfp4",
                                            "load the fp8 scaled or bf16/fp16 file of this model instead"]),
    "gguf": ("flux-Q8_0.gguf", 2, ["it is there (", "Unet Loader (GGUF)", "--custom-node"]),
    "wrong_folder": ("flux_ckpt.safetensors", 2, ["it is in ComfyUI's checkpoints folder (",
                                                   "Load Checkpoint (CheckpointLoaderSimple)"]),
    "typo": ("flux.safetensor", 2, ["did you mean 'flux.safetensors'"]),
    "truncated": ("flux_truncated.safetensors", 1, ["SafetensorError: Error while deserializing header",
                                                    "flux_truncated.safetensors is damaged, incomplete"]),
    "renamed": ("flux_renamed.ckpt", 1, ["flux_renamed.ckpt is a safetensors file with another extension",
                                         "rename it to flux_renamed.safetensors"]),
    "prefixed": ("flux_prefixed.safetensors", 1, ["Could not detect model type of:", "flux_prefixed.safetensors",
                                                  "use the model's original release file"]),
    # the second file of a two-file loader: that one named, not the first
    "second_truncated": (_dual_clip("t5_truncated.safetensors"), 1, ["t5_truncated.safetensors is damaged"]),
    "second_renamed": (_dual_clip("t5_renamed.pt"), 1, ["t5_renamed.pt is a safetensors file with another extension",
                                                        "rename it to t5_renamed.safetensors"]),
    # a LoRA in diffusion_models: moved, not loaded as a diffusion model
    "lora_in_diffusion_models": (_workflow("flux.safetensors", lora="my_style_lora.safetensors"), 2,
                                 ["it is in ComfyUI's diffusion_models folder (",
                                  "): move it into one of the folders"]),
}


@pytest.fixture(scope="module")
def batch(comfyui_python, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("model_files")
    models = tmp / "models"
    _models(models)
    runs = []
    for case, (name, _code, _parts) in CASES.items():
        path = tmp / f"{case}.json"
        path.write_text(json.dumps(_workflow(name) if isinstance(name, str) else name))
        runs.append({"argv": ["run", str(path), "--models-dir", str(models), "--output-dir", str(tmp / "out")],
                     "log": str(tmp / f"{case}.log"), "ui_from": None})
    return run_headless_batch(comfyui_python, tmp, runs, list(CASES), timeout=900)


@pytest.mark.parametrize("case", list(CASES))
def test_a_model_file_that_cannot_train_is_refused_with_one_line_naming_it_and_the_fix(batch, case):
    code, log = batch[case]
    _name, expected_code, parts = CASES[case]
    assert code == expected_code, log[-3000:]
    errors = [i for i, line in enumerate(log.splitlines()) if line.startswith("error: ")]
    assert len(errors) == 1, log[-3000:]
    lines = log.splitlines()[errors[0]:]
    assert len([line for line in lines if line.strip()]) == 1, f"the message runs over several lines: {lines}"
    for part in parts:
        assert part in lines[0], lines[0]
    assert "clip_l.safetensors" not in lines[0] and "load it with Load Diffusion Model" not in lines[0]
    assert "Traceback" not in log and "training:" not in log and "weights_only" not in log

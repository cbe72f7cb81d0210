"""Our reference Flux vs. ComfyUI's own Flux, on the same tiny checkpoint and inputs (fp32, CPU).

Needs a ComfyUI checkout: COMFYUI_DIR=/path/to/ComfyUI (its source dir). ComfyUI runs in its own venv, in a
subprocess: COMFYUI_PYTHON (default $COMFYUI_DIR/../venv/bin/python). Skipped when COMFYUI_DIR is unset (CI).
"""
import dataclasses

import pytest
import torch
from comfy_runner import COMFYUI_DIR, SKIP_REASON, run_in_comfyui
from safetensors.torch import load_file, save_file

from tightrope.training.models.reference_flux import FluxParams
from tightrope.demo.tiny_checkpoint import load_reference_flux, make_tiny_checkpoint

if not COMFYUI_DIR:
    print("skipping ComfyUI comparison: set COMFYUI_DIR to a ComfyUI source dir to run it")
pytestmark = pytest.mark.skipif(not COMFYUI_DIR, reason=SKIP_REASON)

# Runs inside ComfyUI's venv (after comfy_runner.PREAMBLE). Loads the file exactly as the UNETLoader node does and
# calls the diffusion model (comfy.ldm.flux.model.Flux) directly on latent-space inputs, bypassing sampling/sigma
# conversions.
RUNNER = """
    ckpt, inputs_path, out_path = ARGS
    patcher = comfy.sd.load_diffusion_model(ckpt, model_options={"dtype": torch.float32})
    mm.load_models_gpu([patcher])
    base = patcher.model
    dm = base.diffusion_model
    # every file tensor must have landed in the model (ComfyUI renames *_norm.scale -> *_norm.weight)
    file_sd = load_file(ckpt)
    model_sd = dm.state_dict()
    renamed = {(k[:-6] + ".weight" if k.endswith("_norm.scale") else k): v for k, v in file_sd.items()}
    missing = sorted(set(model_sd) - set(renamed))
    unexpected = sorted(set(renamed) - set(model_sd))
    differ = sorted(k for k in set(model_sd) & set(renamed) if not torch.equal(model_sd[k].float(), renamed[k]))
    inp = load_file(inputs_path)
    with torch.no_grad():
        out = dm(inp["x"], inp["timesteps"], inp["context"], y=inp["y"], guidance=inp.get("guidance"))
    save_file({"out": out.contiguous()}, out_path)
    result({
        "model_config": type(base.model_config).__name__, "model_base": type(base).__name__,
        "diffusion_model": type(dm).__module__ + "." + type(dm).__name__,
        "image_model": base.model_config.unet_config.get("image_model"),
        "dtype": str(next(dm.parameters()).dtype), "device": str(mm.get_torch_device()),
        "missing": missing, "unexpected": unexpected, "differ": differ})
"""


@pytest.mark.parametrize("variant,expected_config", [
    ("dev", "Flux"),          # guidance_in present -> ComfyUI's guidance-distilled Flux (flux-dev)
    ("schnell", "FluxSchnell"),  # no guidance_in -> FluxSchnell
])
def test_matches_comfyui(tmp_path, variant, expected_config):
    params = FluxParams.tiny()
    if variant == "schnell":
        params = dataclasses.replace(params, guidance_embed=False)
    ckpt = make_tiny_checkpoint(tmp_path / f"tiny_flux_{variant}.safetensors", params, seed=3)

    g = torch.Generator().manual_seed(11)
    inp = {"x": torch.randn(2, 16, 7, 10, generator=g),  # odd height: exercises circular pad + crop
           "timesteps": torch.tensor([0.25, 0.8]),
           "context": torch.randn(2, 6, params.context_in_dim, generator=g),
           "y": torch.randn(2, params.vec_in_dim, generator=g)}
    if params.guidance_embed:
        inp["guidance"] = torch.tensor([3.5, 1.0])
    save_file(inp, tmp_path / "inputs.safetensors")
    info, _ = run_in_comfyui(tmp_path, RUNNER, ckpt, tmp_path / "inputs.safetensors",
                             tmp_path / "comfy_out.safetensors")
    print(f"\nComfyUI detected: model_config={info['model_config']} model_base={info['model_base']} "
          f"diffusion_model={info['diffusion_model']} image_model={info['image_model']} "
          f"dtype={info['dtype']} device={info['device']}")
    assert info["model_config"] == expected_config and info["image_model"] == "flux"
    assert info["diffusion_model"] == "comfy.ldm.flux.model.Flux"
    assert info["dtype"] == "torch.float32"
    assert not info["missing"] and not info["unexpected"] and not info["differ"], info

    theirs = load_file(tmp_path / "comfy_out.safetensors")["out"]
    model = load_reference_flux(ckpt, params)
    with torch.no_grad():
        ours = model.forward_latent(inp["x"], inp["timesteps"], inp["context"], inp["y"], inp.get("guidance"))
    assert ours.shape == theirs.shape == inp["x"].shape
    diff = (ours - theirs).abs().max().item()
    print(f"max |ours - ComfyUI| = {diff:.3e} (output std {theirs.std().item():.3f})")
    assert diff <= 1e-5

"""A LoRA file written by save_lora, loaded by ComfyUI's own LoRA loader on the tiny Flux checkpoint (fp32, CPU):
every key must be used (no "lora key not loaded") and ComfyUI's patched model must give the output of our
merge_lora_into.

Needs a ComfyUI checkout: COMFYUI_DIR=/path/to/ComfyUI (its source dir). ComfyUI runs in its own venv, in a
subprocess: COMFYUI_PYTHON (default $COMFYUI_DIR/../venv/bin/python). Skipped when COMFYUI_DIR is unset (CI).
"""
import pytest
import torch
from comfy_runner import COMFYUI_DIR, SKIP_REASON, run_in_comfyui
from safetensors.torch import load_file, save_file

from tightrope.training.lora.layers import LoraSpec, inject_lora, lora_parameters
from merge_lora import merge_lora_into
from tightrope.training.lora.files import read_lora_file, save_lora
from tightrope.training.models.reference_flux import FluxParams
from tightrope.demo.tiny_checkpoint import load_reference_flux, make_tiny_checkpoint

if not COMFYUI_DIR:
    print("skipping ComfyUI LoRA check: set COMFYUI_DIR to a ComfyUI source dir to run it")
pytestmark = pytest.mark.skipif(not COMFYUI_DIR, reason=SKIP_REASON)

# Runs inside ComfyUI's venv (after comfy_runner.PREAMBLE): the UNETLoader + LoraLoader path (load_diffusion_model,
# load_torch_file, load_lora_for_models), then the patched diffusion model called directly on latent-space inputs.
RUNNER = """
    ckpt, lora_path, inputs_path, out_path = ARGS
    collect = Collect()
    logging.getLogger().addHandler(collect)

    patcher = comfy.sd.load_diffusion_model(ckpt, model_options={"dtype": torch.float32})
    lora = comfy.utils.load_torch_file(lora_path, safe_load=True)
    patched, _ = comfy.sd.load_lora_for_models(patcher, None, lora, 1.0, 0.0)
    mm.load_models_gpu([patched])
    dm = patched.model.diffusion_model
    inp = load_file(inputs_path)
    with torch.no_grad():
        out = dm(inp["x"], inp["timesteps"], inp["context"], y=inp["y"], guidance=inp.get("guidance"))
    save_file({"out": out.contiguous()}, out_path)
    result({"patched_keys": sorted(patched.patches), "warnings": collect.messages,
            "dtype": str(next(dm.parameters()).dtype)})
"""


@pytest.mark.parametrize("spec,dtype", [
    (LoraSpec(rank=4, alpha=8.0, targets="attention"), "fp32"),
    (LoraSpec(rank=8, alpha=4.0, rslora=True, targets="all_linear"), "bf16"),  # alpha*sqrt(r) in the file
], ids=["attention-fp32", "all_linear-rslora-bf16"])
def test_comfyui_applies_our_lora(tmp_path, spec, dtype):
    params = FluxParams.tiny()
    ckpt = make_tiny_checkpoint(tmp_path / "tiny_flux.safetensors", params, seed=3)

    # a LoRA with non-zero B (a fresh one is a no-op and would prove nothing)
    trained = load_reference_flux(ckpt, params)
    targeted = inject_lora(trained, spec, "flux")
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in lora_parameters(trained).values():
            p.copy_(0.05 * torch.randn(p.shape, generator=g))
    lora_path = save_lora(tmp_path / "loras", "tightrope/check", trained, spec, metadata={}, dtype=dtype)
    assert len(read_lora_file(lora_path)[0]) == 3 * len(targeted)

    g = torch.Generator().manual_seed(11)
    inp = {"x": torch.randn(2, 16, 7, 10, generator=g), "timesteps": torch.tensor([0.25, 0.8]),
           "context": torch.randn(2, 6, params.context_in_dim, generator=g),
           "y": torch.randn(2, params.vec_in_dim, generator=g), "guidance": torch.tensor([3.5, 1.0])}
    save_file(inp, tmp_path / "inputs.safetensors")
    info, stderr = run_in_comfyui(tmp_path, RUNNER, ckpt, lora_path, tmp_path / "inputs.safetensors",
                                  tmp_path / "comfy_out.safetensors")
    log = "\n".join(info["warnings"]) + stderr
    assert "lora key not loaded" not in log and "NOT LOADED" not in log, log
    assert info["patched_keys"] == sorted(f"diffusion_model.{n}.weight" for n in targeted)
    assert info["dtype"] == "torch.float32"

    ours_model = load_reference_flux(ckpt, params)
    assert merge_lora_into(ours_model, lora_path) == len(targeted)
    with torch.no_grad():
        ours = ours_model.forward_latent(inp["x"], inp["timesteps"], inp["context"], inp["y"], inp["guidance"])
        base = load_reference_flux(ckpt, params).forward_latent(inp["x"], inp["timesteps"], inp["context"],
                                                                 inp["y"], inp["guidance"])
    theirs = load_file(tmp_path / "comfy_out.safetensors")["out"]
    diff = (ours - theirs).abs().max().item()
    print(f"\n{len(targeted)} LoRA layers patched by ComfyUI; max |ours - ComfyUI| = {diff:.3e}, "
          f"LoRA effect {(theirs - base).abs().max().item():.3f}")
    assert (theirs - base).abs().max() > 1e-2  # the LoRA did something
    assert diff <= 1e-5

"""The ComfyUI model adapter inside ComfyUI's python (a subprocess, no server): predict() is ComfyUI's own
apply_model in velocity form, training leaves the user's MODEL as it was, fp8 base weights train with an fp32 LoRA,
a MODEL that already has a LoRA trains on ComfyUI's patched weights, and eps-prediction models are refused."""
import math

import pytest
from comfy_env import needs_comfyui, run_on_tiny_flux

pytestmark = needs_comfyui

# Runs inside ComfyUI's venv, after comfy_runner.PREAMBLE, with this checkout importable as tightrope
RUNNER = """
    import comfy.model_sampling
    from pathlib import Path
    from tightrope.training.models.comfy import ComfyModelAdapter, _check_flow
    from tightrope.training.data.builder import dataset_from_conditioning
    from tightrope.demo.conditioning import demo_conditioning
    from tightrope.training.lora.layers import LoraSpec
    from tightrope.training.train_config import ConfigError, TrainConfig
    from tightrope.training.training_run import run_training_node
    ckpt, loras = ARGS
    out = {}

    def train(patcher, steps, prefix, channels=16):
        cond = demo_conditioning(patcher, "a red circle", 8, 0)
        data = dataset_from_conditioning({"samples": torch.randn(2, channels, 8, 8, generator=g)}, cond)
        return run_training_node(TrainConfig(learning_rate=1e-2), steps, session=None, model=patcher, dataset=data,
                                 lora=LoraSpec(rank=4), strategy=None, device="cpu", save_dir=Path(loras),
                                 filename_prefix=prefix, save_every=0, progress=None, should_stop=None)

    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():  # as ComfyUI runs nodes
        p = comfy.sd.load_diffusion_model(ckpt)
        adapter = ComfyModelAdapter(p)
        before = {k: v.clone() for k, v in p.model.diffusion_model.state_dict().items()}
        session, model_out, _ = train(p, 2, "it/fp32")
        after = p.model.diffusion_model.state_dict()
        out["base_unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
        out["input_patches"], out["output_patches"] = len(p.patches), len(model_out.patches)
        out["in_training_after"] = mm.in_training
        out["losses"] = list(session.losses)
        out["latent_channels"] = adapter.latent_channels()
        try:  # an SD1/SDXL VAE's 4-channel latents: refused before the first step
            train(p, 1, "it/sdxl_latents", channels=4)
            out["sdxl_latents"] = "trained"
        except ValueError as e:
            out["sdxl_latents"] = f"{type(e).__name__}: {e}"

        cond = demo_conditioning(p, "a red circle", 8, 0)
        x, t = torch.randn(2, 16, 8, 8, generator=g), torch.tensor([0.3, 0.7])
        ctx, pooled = cond[0][0].repeat(2, 1, 1), cond[0][1]["pooled_output"].repeat(2, 1)
        with torch.inference_mode(False), adapter.training_module() as module:
            out["in_training_inside"] = mm.in_training
            v = adapter.predict(module, x, t, ctx, pooled, 3.5)
        x0 = p.model.apply_model(x, t, c_crossattn=ctx, y=pooled, guidance=torch.full((2,), 3.5))
        out["velocity_vs_apply_model"] = (x - v * t.view(-1, 1, 1, 1) - x0).abs().max().item()

        p8 = comfy.sd.load_diffusion_model(ckpt, model_options={"dtype": torch.float8_e4m3fn})
        w8 = p8.model.diffusion_model.double_blocks[0].img_attn.qkv.weight.clone()
        session8, _, _ = train(p8, 2, "it/fp8")
        out["fp8_losses"] = list(session8.losses)
        out["fp8_lora_dtypes"] = sorted({str(v.dtype) for v in session8.lora_state.values()})
        w8_after = p8.model.diffusion_model.double_blocks[0].img_attn.qkv.weight
        out["fp8_base"] = [str(w8_after.dtype), torch.equal(w8.float(), w8_after.float())]

        patched = model_out  # a MODEL with a LoRA on it: its training copy must hold ComfyUI's patched weights
        with torch.inference_mode(False), ComfyModelAdapter(patched).training_module() as module:
            ours = {k: v.clone() for k, v in module.state_dict().items()}
        mm.load_models_gpu([patched])
        theirs = patched.model.diffusion_model.state_dict()
        out["patched_copy_equal"] = all(torch.equal(ours[k], theirs[k]) for k in ours)
        out["patched_copy_changed"] = sum(not torch.equal(ours[k], before[k]) for k in ours)
        mm.unload_all_models()

        # timestep_shift 0 trains at the model's own sampling shift, as a ModelSampling node leaves it
        from comfy_extras.nodes_model_advanced import ModelSamplingFlux, ModelSamplingSD3
        out["shift"] = adapter.sampling_shift()
        out["shift_flux_512"] = ComfyModelAdapter(ModelSamplingFlux().patch(p, 1.15, 0.5, 512, 512)[0]).sampling_shift()
        out["shift_sd3_node"] = ComfyModelAdapter(ModelSamplingSD3().patch(p, 5.0)[0]).sampling_shift()
        out["session_shift"] = session.config.timestep_shift

        class EpsSampling(comfy.model_sampling.ModelSamplingDiscrete, comfy.model_sampling.EPS):
            pass
        try:
            _check_flow("SD1.5", EpsSampling())
            out["eps"] = "accepted"
        except ConfigError as e:
            out["eps"] = str(e)
    result(out)
"""


@pytest.mark.usefixtures("comfyui_python")  # Tightrope's requirements installed in ComfyUI's python
def test_adapter_in_comfyui(tmp_path):
    r = run_on_tiny_flux(tmp_path, RUNNER)
    assert r["base_unchanged"] and r["input_patches"] == 0 and r["output_patches"] > 0
    assert r["in_training_inside"] is True and r["in_training_after"] is False
    assert r["velocity_vs_apply_model"] <= 1e-5
    assert all(map(math.isfinite, r["losses"] + r["fp8_losses"]))
    assert r["fp8_lora_dtypes"] == ["torch.float32"] and r["fp8_base"] == ["torch.float8_e4m3fn", True]
    assert r["patched_copy_equal"] and r["patched_copy_changed"] == r["output_patches"]
    assert r["latent_channels"] == 16 and r["sdxl_latents"].startswith(
        "DatasetError: the dataset's latents have 4 channels, but this flux model (tiny_flux.safetensors) takes "
        "16-channel latents")
    assert "eps-prediction model, which Tightrope does not support" in r["eps"]
    # ComfyUI samples Flux at sigma = e^mu / (e^mu + 1/t - 1): mu 1.15 by default; ModelSamplingFlux at 512 px sets
    # mu = 0.5 + (1.15 - 0.5) * (1024 - 256) / (4096 - 256) = 0.63; ModelSamplingSD3 sets the shift itself.
    # Read back as sigma(0.5) / (1 - sigma(0.5)): a few ulps
    assert r["shift"] == pytest.approx(math.exp(1.15), rel=1e-12) and r["session_shift"] == r["shift"]
    assert r["shift_flux_512"] == pytest.approx(math.exp(0.63), rel=1e-12)
    assert r["shift_sd3_node"] == pytest.approx(5.0, rel=1e-12)


IMAGE_INPUT_RUNNER = """
    from tightrope.training.models.comfy import ComfyModelAdapter
    from tightrope.training.train_config import ConfigError
    ckpt, = ARGS
    with torch.inference_mode():
        p = comfy.sd.load_diffusion_model(ckpt)
    adapter = ComfyModelAdapter(p)
    x, t = torch.randn(1, 16, 1, 8, 8), torch.tensor([0.5])
    try:
        with adapter.training_module() as module:
            adapter.predict(module, x, t, torch.randn(1, 8, 4096), torch.zeros(1, 0), 1.0)
        result("trained")
    except ConfigError as e:
        result(str(e))
"""


@pytest.mark.usefixtures("comfyui_python")
def test_a_model_with_image_input_channels_is_refused(tmp_path):
    """Wan 2.2 I2V's layout (16 noise + 4 mask + 16 image channels in): ComfyUI would fill the image channels with
    zeros in training and with the start image in sampling. Before: trained on zeros, silently."""
    from comfy_env import run_in_comfyui, tightrope_env
    from tiny_models import wan_shapes, write_checkpoint
    shapes = wan_shapes()
    shapes["patch_embedding.weight"] = (128, 36, 1, 2, 2)
    ckpt = write_checkpoint(tmp_path / "wan_i2v.safetensors", shapes, seed=2)
    r, _ = run_in_comfyui(tmp_path, IMAGE_INPUT_RUNNER, ckpt, env=tightrope_env(tmp_path))
    assert "takes an image input besides the noise" in r and "text-to-image/video models only" in r

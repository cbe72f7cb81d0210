"""DoRA, LoHa and LoKr files in the real ComfyUI (0.33, CPU, fp32), on the tiny Flux and SD3.5 checkpoints: the
adapter is injected with peft into ComfyUI's own diffusion model, moved off its init, saved by save_lora, then
loaded by ComfyUI's LoRA loading (load_lora_for_models, LoraLoaderModelOnly's code path). Every key must be used
(no "lora key not loaded"), every adapted layer patched, and the patched model must give the trained model's output.

Tolerance: both sides compute in fp32; ComfyUI adds the update into the weight (W + s * update) where peft runs the
update as a separate branch (LoRA/DoRA) or a separate delta weight (LoHa/LoKr), so outputs of size ~1 differ by
rounding only: 1e-5, the bound the plain-LoRA check (tests/training/test_lora_file_vs_comfyui.py) uses.
DoRA: ComfyUI 0.33 divides by the base weight's row norms; the default file (dora_for='comfyui',
training/lora/dora_scale.py) folds |W_i| / |W_i + update_i| into dora_scale, so it too is compared with the trained
output directly. The 'standard' file (peft's magnitude) is loaded too, to show that factor is not rounding.
"""
import sys

import pytest
import torch
from comfy_env import COMFYUI_DIR, SKIP_REASON, tightrope_env
from comfy_runner import run_in_comfyui
from safetensors.torch import save_file
from tiny_models import CHECKPOINTS

if not COMFYUI_DIR:
    print("skipping the DoRA/LoHa/LoKr ComfyUI check: set COMFYUI_DIR to a ComfyUI source dir to run it")
pytestmark = pytest.mark.skipif(not COMFYUI_DIR, reason=SKIP_REASON)

# Runs inside ComfyUI's venv, after comfy_runner.PREAMBLE
RUNNER = """
    import copy
    from tightrope.training.lora.layers import LoraSpec, inject_lora, lora_parameters, lora_state
    from tightrope.training.models import adapter_for
    from tightrope.training.lora.files import save_lora
    family, ckpt, inputs_path, folder, algorithms = ARGS
    algorithms = algorithms.split(",")

    inp = load_file(inputs_path)
    extra = {"guidance": inp["guidance"]} if "guidance" in inp else {}
    def run(dm):
        with torch.no_grad():
            return dm(inp["x"], inp["timesteps"], inp["context"], y=inp["y"], **extra)

    results = {}
    for algorithm in algorithms:
        patcher = comfy.sd.load_diffusion_model(ckpt, model_options={"dtype": torch.float32})
        trained = copy.deepcopy(patcher.model.diffusion_model)
        base_out = run(trained)
        spec = LoraSpec(rank=4, alpha=3.0, algorithm=algorithm, targets="all_linear")
        torch.manual_seed(0)
        names = inject_lora(trained, spec, family)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in lora_parameters(trained).values():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
        trained_out = run(trained)
        path = save_lora(folder, algorithm, trained, spec, metadata={})

        collect = Collect()
        logging.getLogger().addHandler(collect)
        lora = comfy.utils.load_torch_file(str(path), safe_load=True)
        patched, _ = comfy.sd.load_lora_for_models(patcher, None, lora, 1.0, 0.0)
        mm.load_models_gpu([patched])
        comfy_out = run(patched.model.diffusion_model)
        # the Train node's MODEL output: the same state patched by ComfyUI through the adapter (with_lora_state)
        fresh = comfy.sd.load_diffusion_model(ckpt, model_options={"dtype": torch.float32})
        via_node = adapter_for(fresh).with_lora_state(spec, lora_state(trained))
        mm.load_models_gpu([via_node])
        node_out = run(via_node.model.diffusion_model)
        logging.getLogger().removeHandler(collect)

        standard_diff = None
        if algorithm == "dora":  # the LyCORIS/peft convention, which ComfyUI 0.33 applies off by |W+dW|/|W| per row
            std = comfy.utils.load_torch_file(str(save_lora(folder, "std", trained, spec, metadata={},
                                                            dora_for="standard")), safe_load=True)
            fresh = comfy.sd.load_diffusion_model(ckpt, model_options={"dtype": torch.float32})
            std_patched, _ = comfy.sd.load_lora_for_models(fresh, None, std, 1.0, 0.0)
            mm.load_models_gpu([std_patched])
            standard_diff = (run(std_patched.model.diffusion_model) - trained_out).abs().max().item()
        expected = trained_out
        results[algorithm] = {
            "layers": sorted(f"diffusion_model.{n}.weight" for n in names), "patched": sorted(patched.patches),
            "keys": len(lora), "warnings": collect.messages,
            "diff": (comfy_out - expected).abs().max().item(), "node_diff": (node_out - comfy_out).abs().max().item(),
            "standard_diff": standard_diff,
            "effect": (comfy_out - base_out).abs().max().item(), "scale": trained_out.abs().max().item()}
    result(results)
"""


def flux_inputs(g):
    return {"x": torch.randn(2, 16, 6, 8, generator=g), "timesteps": torch.tensor([0.25, 0.8]),
            "context": torch.randn(2, 6, 64, generator=g), "y": torch.randn(2, 32, generator=g),
            "guidance": torch.tensor([3.5, 1.0])}


def sd3_inputs(g):
    return {"x": torch.randn(2, 16, 8, 8, generator=g), "timesteps": torch.tensor([250.0, 800.0]),
            "context": torch.randn(2, 6, 64, generator=g), "y": torch.randn(2, 32, generator=g)}


@pytest.mark.parametrize("family,make_inputs", [("flux", flux_inputs), ("sd3", sd3_inputs)])
def test_comfyui_applies_each_adapter_as_trained(tmp_path, family, make_inputs):
    name, write, _ = CHECKPOINTS[family]
    ckpt = write(tmp_path / name)
    save_file(make_inputs(torch.Generator().manual_seed(11)), tmp_path / "inputs.safetensors")
    results, _ = run_in_comfyui(tmp_path, RUNNER, family, ckpt, tmp_path / "inputs.safetensors", tmp_path / "loras",
                                "dora,loha,lokr", env=tightrope_env(tmp_path))
    for algorithm, r in results.items():
        log = "\n".join(r["warnings"])
        print(f"\n{family} {algorithm}: {len(r['layers'])} layers, {r['keys']} keys; max |ComfyUI - expected| = "
              f"{r['diff']:.2e}, effect {r['effect']:.3f}" + (f"; the standard DoRA file misses by {r['standard_diff']:.2e}"
              if r["standard_diff"] is not None else ""),
              file=sys.stderr)
        assert "lora key not loaded" not in log and "ERROR" not in log, log
        assert r["patched"] == r["layers"] and r["layers"]
        assert r["effect"] > 1e-2, "the adapter did nothing: the comparison would prove nothing"
        assert r["diff"] <= 1e-5 * max(1.0, r["scale"])
        assert r["node_diff"] == 0.0, "the Train node's MODEL output differs from the saved file loaded by ComfyUI"
        if algorithm == "dora":  # the factor the comfyui file folds in is no rounding: the comparison can fail
            assert r["standard_diff"] > 100 * 1e-5 * max(1.0, r["scale"])

"""SD3.5, Lumina 2, Wan 2.1 and Qwen-Image (the last two loaded as fp8) each train through the real server, and the
Train node's MODEL output (ComfyUI's own LoRA patching, as LoraLoaderModelOnly) samples with every LoRA key applied."""
import json
import math

import pytest
import torch
from api_graph import Graph, saved_latent

from tightrope.training.lora.files import read_lora_file

SAMPLING_SHIFT = {"sd3": 3.0, "lumina2": 6.0, "wan": 8.0, "qwen_image": math.exp(1.15)}  # Qwen-Image: as Flux


@pytest.mark.parametrize("family", ["sd3", "lumina2", "wan", "qwen_image"])
def test_family_trains_in_comfyui(comfy_server, checkpoint, family):
    name, weight_dtype = checkpoint(family)
    g = Graph()
    unet = g.add("UNETLoader", unet_name=name, weight_dtype=weight_dtype)
    cond = g.add("TightropeDemoConditioning", model=[unet, 0], text="a red circle", tokens=8)
    latent = g.add("EmptySD3LatentImage", width=64, height=64, batch_size=1)
    dataset = g.add("TightropeDatasetFromLatents", latent=[latent, 0], conditioning=[cond, 0])
    lora = g.add("TightropeLoraSetup", rank=4, alpha=4.0, targets="attention_mlp")
    train = g.add("TightropeTrain", steps=1, learning_rate=0.01, device="cpu", filename_prefix=f"tightrope/it_{family}",
                  model=[unet, 0], dataset=[dataset, 0], lora=[lora, 0])
    save = g.add("TightropeSaveLora", session=[train, 0], filename_prefix=f"tightrope/it_{family}_final")
    out = g.sample([train, 1], cond, latent, f"it/{family}_trained", steps=1)
    entry = comfy_server.run(g.nodes)

    tensors, meta = read_lora_file(entry["outputs"][save]["text"][0])
    assert meta["tightrope.family"] == family and meta["tightrope.steps"] == "1"
    assert meta["tightrope.base_model"] == name
    # timestep_shift 0 (the default) trained at the shift ComfyUI samples the family with (0.33's sampling_settings)
    assert json.loads(meta["tightrope.training"])["timestep_shift"] == pytest.approx(SAMPLING_SHIFT[family], rel=1e-12)
    assert any(t.abs().max() > 0 for k, t in tensors.items() if "lora_B" in k), "the step left lora_B at zero"
    assert torch.isfinite(saved_latent(comfy_server, entry, out)).all()
    log = comfy_server.log()
    assert "lora key not loaded" not in log and "NOT LOADED" not in log and "unet missing" not in log \
        and "unet unexpected" not in log, log[-3000:]
    print(f"\n{family}: {len(tensors) // 3} LoRA layers trained, loaded with weight_dtype={weight_dtype}")

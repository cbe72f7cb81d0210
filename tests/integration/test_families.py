"""SD3.5, Lumina 2, Wan 2.1 and Qwen-Image (the last two loaded as fp8), and Wan 2.2 (A14B's two experts, TI2V 5B)
each train through the real server, and the Train node's MODEL output (ComfyUI's own LoRA patching, as
LoraLoaderModelOnly) samples with every LoRA key applied."""
import json
import math
from pathlib import Path

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


EXPERTS = {"wan22_high": (0.875, 1.0), "wan22_low": (0.0, 0.875)}  # the README's Wan 2.2 A14B recipe


def test_wan22_trains_in_comfyui(comfy_server, checkpoint):
    """Wan 2.2 A14B's two experts (each its own UNETLoader and Train chain, on its own timesteps) and TI2V 5B (48
    latent channels, from Wan22ImageToVideoLatent without a start image) train in one workflow; each saved LoRA then
    loads by LoraLoaderModelOnly with every key applied, and samples."""
    g, chains = Graph(), {}
    vae = g.add("VAELoader", vae_name="taef1")  # Wan22ImageToVideoLatent wants a VAE; without an image it is unused
    for expert in (*EXPERTS, "wan22_5b"):
        name, weight_dtype = checkpoint(expert)
        unet = g.add("UNETLoader", unet_name=name, weight_dtype=weight_dtype)
        cond = g.add("TightropeDemoConditioning", model=[unet, 0], text="a red circle", tokens=8)
        latent = g.add("Wan22ImageToVideoLatent", vae=[vae, 0], width=64, height=64, length=1, batch_size=1) \
            if expert == "wan22_5b" else g.add("EmptySD3LatentImage", width=64, height=64, batch_size=1)
        dataset = g.add("TightropeDatasetFromLatents", latent=[latent, 0], conditioning=[cond, 0])
        lora = g.add("TightropeLoraSetup", rank=4, alpha=4.0, targets="attention_mlp")
        lo, hi = EXPERTS.get(expert, (0.0, 1.0))
        train = g.add("TightropeTrain", steps=2, learning_rate=0.01, device="cpu", filename_prefix=f"it/{expert}",
                      model=[unet, 0], dataset=[dataset, 0], lora=[lora, 0], timestep_min=lo, timestep_max=hi)
        save = g.add("TightropeSaveLora", session=[train, 0], filename_prefix=f"tightrope/it_{expert}_final")
        chains[expert] = (name, save, g.sample([train, 1], cond, latent, f"it/{expert}_trained", steps=1))
    entry = comfy_server.run(g.nodes)

    loaded, loras = Graph(), comfy_server.base / "models" / "loras"
    for expert, (name, save, out) in chains.items():
        path = entry["outputs"][save]["text"][0]
        tensors, meta = read_lora_file(path)
        training = json.loads(meta["tightrope.training"])
        assert meta["tightrope.family"] == "wan" and meta["tightrope.base_model"] == name
        assert [training["timestep_min"], training["timestep_max"]] == list(EXPERTS.get(expert, (0.0, 1.0)))
        assert training["timestep_shift"] == pytest.approx(8.0, rel=1e-12)  # ComfyUI's Wan 2.1/2.2 sampling shift
        assert any(".ffn.2." in k for k in tensors)  # the feed-forward (comfy.ops.linear_input_act) trained too
        latent = saved_latent(comfy_server, entry, out)
        assert torch.isfinite(latent).all() and latent.shape[1] == (48 if expert == "wan22_5b" else 16)
        unet = loaded.add("UNETLoader", unet_name=name, weight_dtype="default")
        model = loaded.add("LoraLoaderModelOnly", model=[unet, 0], lora_name=str(Path(path).relative_to(loras)),
                           strength_model=1.0)
        cond = loaded.add("TightropeDemoConditioning", model=[unet, 0], text="a red circle", tokens=8)
        latent = loaded.add("EmptySD3LatentImage", width=64, height=64, batch_size=1) if expert != "wan22_5b" else \
            loaded.add("Wan22ImageToVideoLatent", vae=[loaded.add("VAELoader", vae_name="taef1"), 0], width=64,
                       height=64, length=1, batch_size=1)
        loaded.sample([model, 0], cond, latent, f"it/{expert}_loaded", steps=1)
    comfy_server.run(loaded.nodes)
    log = comfy_server.log()
    assert "lora key not loaded" not in log and "NOT LOADED" not in log and "unet missing" not in log \
        and "unet unexpected" not in log, log[-3000:]

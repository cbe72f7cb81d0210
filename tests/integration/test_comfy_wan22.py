"""Wan 2.2 in the real ComfyUI (0.33, CPU, fp32), inside its python (a subprocess, no server), on tiny random
checkpoints in the released files' key layouts (tiny_models.wan_shapes):

- A14B text-to-video: two experts with Wan 2.1 14B's keys (ComfyUI loads each as WAN21_T2V, sampling shift 8), each
  trained on its own timesteps (high noise 0.875..1, low noise 0..0.875, the README's recipe); every drawn t is in
  the range, the LoRA records it, and ComfyUI's LoRA loader applies every key.
- TI2V 5B: 48-channel latents of its own VAE (ComfyUI: WAN22_T2V, latent format Wan22). Without a start image it is
  text-to-video: no image channels (c_concat) and no denoise_mask, so it trains on the 48-channel latents of
  Wan22ImageToVideoLatent (no start image) or its VAE; 16-channel latents (another VAE's) are refused before training.
- "scaled fp8" Wan (Comfy-Org's *_fp8_scaled files, both layouts): Wan's feed-forward reads its down-projection's
  weight outside that layer's forward (comfy.ops.linear_input_act), which the training copy's quantized layers
  (models/comfy_quant.py) must answer; it trains resident and offloaded to the same LoRA, the training forward is
  ComfyUI's own, and the LoRA on the feed-forward layers loads with no ignored key.
"""
import json

import pytest
from comfy_env import needs_comfyui, run_in_comfyui, tightrope_env
from tiny_models import wan_shapes, write_checkpoint, write_scaled_fp8

pytestmark = needs_comfyui

RUNNER = """
    from pathlib import Path
    import comfy_extras.nodes_wan as nodes_wan
    from tightrope.demo.conditioning import demo_conditioning
    from tightrope.memory.strategy import Strategy
    from tightrope.training.data.builder import dataset_from_conditioning
    from tightrope.training.lora.files import read_lora_file
    from tightrope.training.lora.layers import LoraSpec
    from tightrope.training.models.comfy import ComfyModelAdapter
    from tightrope.training.save_session import save_session_lora
    from tightrope.training.train_config import TrainConfig
    from tightrope.training.training_run import run_training_node
    cases, loras = json.loads(ARGS[0]), Path(ARGS[1])
    drawn = []
    predict = ComfyModelAdapter.predict
    def recording(self, module, x_t, t, *a, **k):
        drawn.extend(t.tolist())
        return predict(self, module, x_t, t, *a, **k)
    ComfyModelAdapter.predict = recording

    def train(p, samples, name, lo=0.0, hi=1.0, offload=0.0, targets="attention"):
        data = dataset_from_conditioning({"samples": samples}, demo_conditioning(p, "a red circle", 8, 0))
        drawn.clear()
        with torch.inference_mode():
            return run_training_node(TrainConfig(learning_rate=1e-2, seed=0, timestep_min=lo, timestep_max=hi), 3,
                                     session=None, model=p, dataset=data, lora=LoraSpec(rank=4, targets=targets),
                                     strategy=Strategy.of(compute_dtype="fp32", offload_fraction=offload),
                                     device="cpu", save_dir=loras, filename_prefix=name, save_every=0, progress=None,
                                     should_stop=None)[0]

    def saved(p, s, name):
        path = save_session_lora(s, loras, name, "comfyui")
        lora = load_file(str(path))
        collect = Collect()
        logging.getLogger().addHandler(collect)
        with torch.inference_mode():
            patched, _ = comfy.sd.load_lora_for_models(p, None, lora, 1.0, 0)
        logging.getLogger().removeHandler(collect)
        layers = sorted({k.rsplit(".lora_", 1)[0].rsplit(".alpha", 1)[0] + ".weight" for k in lora})
        meta = json.loads(read_lora_file(str(path))[1]["tightrope.training"])
        return {"warnings": collect.messages, "layers": layers, "all_patched": sorted(patched.patches) == layers,
                "range": [meta["timestep_min"], meta["timestep_max"]], "shift": meta["timestep_shift"]}

    def velocity_vs_comfyui(p, channels):  # the training forward (no LoRA) against ComfyUI's apply_model
        g = torch.Generator().manual_seed(1)
        x, t = torch.randn(2, channels, 1, 8, 8, generator=g), torch.tensor([0.3, 0.9])
        ctx = demo_conditioning(p, "a red circle", 8, 0)[0][0].repeat(2, 1, 1)
        adapter = ComfyModelAdapter(p)
        with adapter.training_module() as module:
            v = adapter.predict(module, x, t, ctx, torch.zeros(2, 0), 1.0)
        with torch.inference_mode():
            mm.load_models_gpu([p])
            x0 = p.model.apply_model(x, t, c_crossattn=ctx)
            mm.unload_all_models()
        return (x - v * t.view(-1, 1, 1, 1, 1) - x0).abs().max().item()

    out = {}
    for name, path, kind in cases:
        r = out[name] = {}
        with torch.inference_mode():
            p = comfy.sd.load_diffusion_model(path)
        adapter = ComfyModelAdapter(p)
        r["model"] = [type(p.model).__name__, type(p.model.model_config).__name__, adapter.latent_channels(),
                      adapter.sampling_shift()]
        g = torch.Generator().manual_seed(0)
        if kind in ("high", "low"):
            lo, hi = (0.875, 1.0) if kind == "high" else (0.0, 0.875)
            s = train(p, torch.randn(2, 16, 8, 8, generator=g), name, lo, hi)
            r["drawn"], r["losses"] = [min(drawn), max(drawn), len(drawn)], s.losses
            r["lora"] = saved(p, s, name)
        elif kind == "5b":
            latent = nodes_wan.Wan22ImageToVideoLatent.execute(None, 128, 128, 1, 1)[0]
            r["latent"] = list(latent["samples"].shape) + sorted(k for k in latent if k != "samples")
            conds = p.model.extra_conds(noise=torch.zeros(1, 48, 1, 8, 8), device="cpu",
                                        cross_attn=torch.zeros(1, 8, 4096))
            r["conds"] = sorted(conds)
            s = train(p, latent["samples"] + torch.randn(latent["samples"].shape, generator=g), name)
            r["losses"] = s.losses
            r["lora"] = saved(p, s, name)
            r["velocity_diff"] = velocity_vs_comfyui(p, 48)
            try:
                train(p, torch.randn(2, 16, 8, 8, generator=g), name + "_16")
            except Exception as e:
                r["refused"] = [type(e).__name__, str(e)]
        else:  # a scaled fp8 file: the LoRA on the feed-forward too, resident and offloaded
            runs = {k: train(p, torch.randn(2, 16, 8, 8, generator=torch.Generator().manual_seed(0)), f"{name}_{k}",
                             offload=f, targets="attention_mlp") for k, f in (("resident", 0.0), ("offload", 1.0))}
            first = runs["resident"]
            r["losses"] = first.losses
            r["same_lora"] = all(torch.equal(first.lora_state[n], runs["offload"].lora_state[n])
                                 for n in first.lora_state)
            r["ffn_trained"] = all(t.abs().max().item() > 0 for n, t in first.lora_state.items()
                                   if ".ffn." in n and "lora_B" in n)
            r["lora"] = saved(p, first, name)
            r["velocity_diff"] = velocity_vs_comfyui(p, 16)
    result(out)
"""


def test_wan22_a14b_5b_and_scaled_fp8_train_in_comfyui(tmp_path):
    high = write_checkpoint(tmp_path / "wan2.2_t2v_high_noise_tiny.safetensors", wan_shapes(), seed=21)
    low = write_checkpoint(tmp_path / "wan2.2_t2v_low_noise_tiny.safetensors", wan_shapes(), seed=22)
    ti2v = write_checkpoint(tmp_path / "wan2.2_ti2v_5B_tiny.safetensors", wan_shapes(channels=48), seed=23)
    cases = [["high", high, "high"], ["low", low, "low"], ["ti2v", ti2v, "5b"]]
    for form in ("scaled_fp8", "comfy_quant"):
        cases.append([form, write_scaled_fp8(tmp_path / f"wan_{form}.safetensors", high, form), "fp8"])
    r, _ = run_in_comfyui(tmp_path, RUNNER, json.dumps(cases), tmp_path / "loras", env=tightrope_env(tmp_path))
    print(f"\n{json.dumps(r, indent=1)}")

    for name, (lo, hi) in (("high", (0.875, 1.0)), ("low", (0.0, 0.875))):
        e = r[name]
        assert e["model"][:3] == ["WAN21", "WAN21_T2V", 16] and e["model"][3] == pytest.approx(8.0, rel=1e-12)
        t_min, t_max, n = e["drawn"]
        assert n == 3 and lo <= t_min <= t_max <= hi, e["drawn"]  # one draw a step, each in the expert's range
        assert e["lora"]["range"] == [lo, hi] and e["lora"]["shift"] == pytest.approx(8.0, rel=1e-12)
        assert e["lora"]["warnings"] == [] and e["lora"]["all_patched"] and e["lora"]["layers"]
        assert all(v == v for v in e["losses"])

    five = r["ti2v"]
    assert five["model"][:3] == ["WAN22", "WAN22_T2V", 48] and five["model"][3] == pytest.approx(8.0, rel=1e-12)
    assert five["latent"] == [1, 48, 1, 8, 8]  # Wan22ImageToVideoLatent without a start image: no noise_mask
    assert "c_concat" not in five["conds"] and "denoise_mask" not in five["conds"]  # text-to-video
    assert five["lora"]["warnings"] == [] and five["lora"]["all_patched"] and five["lora"]["layers"]
    assert all(v == v for v in five["losses"])
    assert five["velocity_diff"] <= 1e-5
    kind, message = five["refused"]
    assert kind == "DatasetError" and "latents have 16 channels" in message and "takes 48-channel latents" in message

    for form in ("scaled_fp8", "comfy_quant"):
        e = r[form]
        assert e["model"][:3] == ["WAN21", "WAN21_T2V", 16]
        assert all(v == v for v in e["losses"]) and e["same_lora"] and e["ffn_trained"]
        assert e["lora"]["warnings"] == [] and e["lora"]["all_patched"]
        assert any(".ffn.2." in k for k in e["lora"]["layers"])
        assert e["velocity_diff"] <= 1e-5

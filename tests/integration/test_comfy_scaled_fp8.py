"""A "scaled fp8" model (Comfy-Org's *_fp8_scaled files: fp8 weights with a per-tensor scale), which ComfyUI loads
into its quantized mixed-precision layers, trains a LoRA in the real ComfyUI (0.33, CPU, fp32 compute), inside its
python (a subprocess, no server). A tiny random Flux is written in both layouts ComfyUI reads (tiny_models.
write_scaled_fp8: the `scaled_fp8` marker + `.scale_weight`, and `.comfy_quant` metadata + `.weight_scale`).

Checked: one wrapped layer against plain PyTorch; training resident, with layer offload (whole and half, with
activation offload), checkpointing, per-block compile and the auto planner, each LoRA equal to the resident run's;
the user's MODEL unchanged; the saved file loaded by ComfyUI's LoRA loader with no ignored key, patching every layer
and changing the output toward what training computed. What stays refused (NVFP4, DoRA/LoHa/LoKr) is named.
"""
import json
import textwrap

import pytest
import torch
from comfy_env import needs_comfyui, run_in_comfyui, tightrope_env
from comfy_runner import TRAIN_TINY
from tiny_models import CHECKPOINTS, write_scaled_fp8

from tightrope.demo.tiny_checkpoint import make_tiny_checkpoint

pytestmark = needs_comfyui

RUNNER = TRAIN_TINY + textwrap.dedent("""
    from pathlib import Path
    from tightrope.demo.conditioning import demo_conditioning
    from tightrope.memory.runtime import MemoryRuntime
    from tightrope.memory.strategy import Strategy
    from tightrope.training.lora.layers import LoraSpec, inject_lora, lora_parameters
    from tightrope.training.models.comfy import ComfyModelAdapter
    from tightrope.training.save_session import save_session_lora
    from tightrope.training.strategy_choice import AutoStrategy
    path, loras, runs_wanted = ARGS
    out = {}

    with torch.inference_mode():  # as ComfyUI runs nodes: UNETLoader
        p = comfy.sd.load_diffusion_model(path)
    dm = p.model.diffusion_model
    w = dm.double_blocks[0].img_attn.qkv.weight
    out["weight"] = [type(w).__name__, dm.double_blocks[0].img_attn.qkv.quant_format, str(w._qdata.dtype)]
    before = {n: (t.data_ptr(), t._qdata.clone() if hasattr(t, "_qdata") else t.clone())
              for n, t in dm.named_parameters()}

    # one wrapped layer against plain PyTorch: the dequantized weight, then the LoRA branch
    adapter = ComfyModelAdapter(p)
    with adapter.training_module() as module:
        spec = LoraSpec(rank=4, alpha=2.0)
        inject_lora(module, spec, "flux")
        layer = module.double_blocks[0].img_attn.qkv
        g = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for t in lora_parameters(module).values():
                t.copy_(0.1 * torch.randn(t.shape, generator=g))
        base = layer.base_layer
        out["copy"] = [type(base.weight_qdata).__name__, str(base.weight_qdata.dtype),
                       base.weight_qdata.data_ptr() == w._qdata.data_ptr(), base.weight_qdata.is_inference()]
        x = torch.randn(2, 5, layer.in_features, generator=g, requires_grad=True)
        y = layer(x)
        weight = base.weight_qdata.float() * base.weight_param_scale.float()
        a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        ref = x @ weight.T + base.bias + spec.scale * ((x @ a.T) @ b.T)
        out["layer_diff"], out["layer_scale"] = (y - ref).abs().max().item(), ref.abs().max().item()
        y.square().sum().backward()
        out["layer_grads"] = [x.grad is not None, a.grad is not None, base.weight_qdata.grad is None]
        with MemoryRuntime(module, Strategy.of(compute_dtype="fp32", offload_fraction=1.0), "cpu") as rt:
            out["host_copy_bytes"] = rt.offload.host_copy_bytes()
            out["offloaded"] = len(rt.offloaded)

    def train(strategy, prefix):
        return train_tiny(p, strategy, prefix, loras)

    fp32 = dict(compute_dtype="fp32")
    strategies = {"resident": Strategy.of(**fp32, offload_fraction=0.0),
                  "offload": Strategy.of(**fp32, offload_fraction=1.0),
                  "offload_half_act": Strategy.of(**fp32, offload_fraction=0.5, activation_offload=True,
                                                  checkpoint="all"),
                  "checkpoint": Strategy.of(**fp32, checkpoint="all"),
                  "compile": Strategy.of(**fp32, checkpoint="all", compile="per_block"),
                  "resident_bf16": Strategy.of(compute_dtype="bf16", offload_fraction=0.0),
                  # weight_dtype casts plain weights only: the fp8 data and scales stay as stored (they were cast)
                  "weights_bf16": Strategy.of(compute_dtype="bf16", weight_dtype="bf16", offload_fraction=0.0),
                  "weights_fp32_offload": Strategy.of(**fp32, weight_dtype="fp32", offload_fraction=1.0),
                  "auto": AutoStrategy(vram_budget_gb=1.0)}  # the planner probes the model, picks a bf16 plan
    runs = {k: train(strategies[k], k) for k in runs_wanted.split(",")}
    first = runs["resident"]
    out["losses"] = {k: s.losses for k, s in runs.items()}
    base = {k: runs["resident_bf16" if k in ("resident_bf16", "weights_bf16") else "resident"].lora_state
            for k in runs}
    if "auto" in runs:  # the plan depends on the memory the probe finds (token chunks when short): its own strategy
        base["auto"] = train(runs["auto"].strategy, "auto_plan").lora_state
    out["lora_equal"] = {k: all(torch.equal(base[k][n], s.lora_state[n]) for n in first.lora_state)
                         for k, s in runs.items()}
    out["lora_diff"] = {k: max((base[k][n] - s.lora_state[n]).abs().max().item() for n in first.lora_state)
                        for k, s in runs.items()}
    if "auto" in runs:
        out["auto_plan"] = str(runs["auto"].strategy)
    out["model_unchanged"] = all(t.data_ptr() == before[n][0] and torch.equal(
        t._qdata if hasattr(t, "_qdata") else t, before[n][1]) for n, t in dm.named_parameters())

    saved = save_session_lora(first, Path(loras), "scaled", "comfyui")
    lora = load_file(str(saved))
    out["keys"] = sorted(lora)[:3]
    collect = Collect()
    logging.getLogger().addHandler(collect)
    with torch.inference_mode():
        patched, _ = comfy.sd.load_lora_for_models(p, None, lora, 1.0, 0)
    out["lora_warnings"] = collect.messages
    out["patched"] = sorted(patched.patches)
    out["file_layers"] = sorted({k.rsplit(".lora_", 1)[0].rsplit(".alpha", 1)[0] + ".weight" for k in lora})
    g = torch.Generator().manual_seed(1)
    cond = demo_conditioning(p, "a red circle", 8, 0)
    x, t = torch.randn(2, 16, 8, 8, generator=g), torch.tensor([0.3, 0.7])
    ctx, pooled = cond[0][0].repeat(2, 1, 1), cond[0][1]["pooled_output"].repeat(2, 1)
    x0 = {}
    for name, m in {"plain": p, "patched": patched}.items():
        with torch.inference_mode():
            mm.load_models_gpu([m])
            x0[name] = m.model.apply_model(x, t, c_crossattn=ctx, y=pooled, guidance=torch.full((2,), 3.5))
            mm.unload_all_models()
    # what training computed: the training copy with the trained LoRA, as x0 (x - t * velocity)
    adapter = ComfyModelAdapter(p)
    with adapter.training_module() as module:
        inject_lora(module, LoraSpec(rank=4), "flux")
        with torch.no_grad():
            for n, t_ in lora_parameters(module).items():
                t_.copy_(first.lora_state[n])
            v = adapter.predict(module, x, t, ctx, pooled, 3.5)
    trained = x - v * t.view(-1, 1, 1, 1)
    # a LoRA already on the MODEL: the training copy computes with ComfyUI's patched (requantized) weights
    adapter = ComfyModelAdapter(patched)
    with adapter.training_module() as module:
        v = adapter.predict(module, x, t, ctx, pooled, 3.5)
    out["patched_velocity_vs_apply_model"] = (x - v * t.view(-1, 1, 1, 1) - x0["patched"]).abs().max().item()
    out["lora_changes_output"] = (x0["plain"] - x0["patched"]).abs().max().item()
    out["patched_vs_trained"] = (x0["patched"] - trained).abs().max().item()
    result(out)
""")

REFUSALS = """
    from tightrope.training.lora.layers import LoraSpec, inject_lora
    from tightrope.training.models.comfy import ComfyModelAdapter
    fp8, nvfp4 = ARGS
    out = {}
    try:
        ComfyModelAdapter(comfy.sd.load_diffusion_model(nvfp4))
    except Exception as e:
        out["nvfp4"] = [type(e).__name__, str(e)]
    adapter = ComfyModelAdapter(comfy.sd.load_diffusion_model(fp8))
    for algorithm in ("dora", "loha", "lokr"):
        with adapter.training_module() as module:
            try:
                inject_lora(module, LoraSpec(rank=4, algorithm=algorithm), "flux")
            except Exception as e:
                out[algorithm] = [type(e).__name__, str(e)]
    result(out)
"""


@pytest.fixture
def flux(tmp_path):
    return make_tiny_checkpoint(tmp_path / "tiny_flux.safetensors", seed=3)


@pytest.mark.parametrize("form,runs", [
    ("scaled_fp8", "resident,offload,offload_half_act,checkpoint,compile,resident_bf16,weights_bf16,"
                   "weights_fp32_offload,auto"),
    ("comfy_quant", "resident,offload"),
])
def test_a_scaled_fp8_model_trains_a_lora_offloaded_or_not(tmp_path, flux, form, runs):
    path = write_scaled_fp8(tmp_path / f"flux_{form}.safetensors", flux, form)
    r, _ = run_in_comfyui(tmp_path, RUNNER, path, tmp_path / "loras", runs, env=tightrope_env(tmp_path))
    print(f"\n{json.dumps(r, indent=1)}")
    assert r["weight"] == ["QuantizedTensor", "float8_e4m3fn", "torch.float8_e4m3fn"]
    # the training copy holds the fp8 bytes ComfyUI loaded as a plain frozen parameter: no copy, not inference
    assert r["copy"] == ["Parameter", "torch.float8_e4m3fn", True, False]
    assert r["offloaded"] > 0 and r["host_copy_bytes"] == 0  # streamed from those bytes
    # ComfyUI's forward (dequantize, fp32 matmul) + peft's LoRA branch vs. the same in plain PyTorch: both fp32 with
    # the same dequantized values, so only the matmuls' summation order differs (width 128: ~1e-6 of outputs ~1)
    assert r["layer_diff"] <= 1e-5 * max(1.0, r["layer_scale"])
    assert r["layer_grads"] == [True, True, True]  # gradients reach the input and the LoRA, none the base weight
    for name, losses in r["losses"].items():
        assert len(losses) == 3 and all(map(lambda v: v == v and abs(v) < 1e6, losses)), (name, losses)
    assert r["losses"]["resident"][-1] < r["losses"]["resident"][0]
    # moving bytes, recomputing and planning change nothing: each LoRA is the resident run's (the auto plan's: that
    # of its plan given as a fixed strategy), bit for bit; compiled blocks fuse fp32 ops differently (rounding, 3
    # steps at lr 1e-2)
    assert all(ok for k, ok in r["lora_equal"].items() if k != "compile"), r["lora_equal"]
    assert r["lora_diff"].get("compile", 0.0) <= 1e-4
    assert r["model_unchanged"]
    assert r["keys"][0].startswith("diffusion_model.double_blocks.0.img_attn.proj.")
    # ComfyUI's own LoRA loader: no ignored key, every trained layer patched, the output changed. It requantizes
    # W + dW to fp8 with a new scale, so it samples with about what training computed: much nearer than without it
    assert r["lora_warnings"] == []
    assert r["patched"] == r["file_layers"] and len(r["patched"]) > 0
    assert r["lora_changes_output"] > 1e-2
    assert r["patched_vs_trained"] < 0.25 * r["lora_changes_output"]
    assert r["patched_velocity_vs_apply_model"] <= 1e-5


def test_what_stays_refused_on_a_quantized_model(tmp_path, flux):
    fp8 = write_scaled_fp8(tmp_path / "flux_fp8.safetensors", flux, "scaled_fp8")
    nvfp4 = write_scaled_fp8(tmp_path / "flux_nvfp4.safetensors", flux, "nvfp4")
    r, _ = run_in_comfyui(tmp_path, REFUSALS, fp8, nvfp4, env=tightrope_env(tmp_path))
    print(f"\n{json.dumps(r, indent=1)}")
    kind, message = r["nvfp4"]
    assert kind == "ConfigError" and message.startswith(f"{nvfp4}: its weights are stored quantized as nvfp4")
    assert "load the fp8 scaled or bf16/fp16 file of this model instead" in message
    for algorithm in ("dora", "loha", "lokr"):
        kind, message = r[algorithm]
        assert kind == "LoraError" and f"algorithm={algorithm!r}" in message, r[algorithm]
        assert "(float8_e4m3fn, a 'scaled fp8' / fp8-mixed model file)" in message and "use algorithm 'lora'" in message


WAN = """
    from pathlib import Path
    from tightrope.demo.conditioning import demo_conditioning
    from tightrope.memory.strategy import Strategy
    from tightrope.training.data.builder import dataset_from_conditioning
    from tightrope.training.lora.layers import LoraSpec
    from tightrope.training.models.comfy import ComfyModelAdapter
    from tightrope.training.strategy_choice import AutoStrategy
    from tightrope.training.train_config import TrainConfig
    from tightrope.training.training_run import run_training_node
    path, loras = ARGS
    with torch.inference_mode():
        p = comfy.sd.load_diffusion_model(path)
    out = {"ffn2": type(p.model.diffusion_model.blocks[0].ffn[2].weight).__name__}
    with ComfyModelAdapter(p).training_module() as module:
        out["copy_ffn2"] = type(module.blocks[0].ffn[2].weight).__name__  # a rebuilt QuantizedTensor, not a parameter
        out["copy_params"] = sorted(n for n, _ in module.blocks[0].ffn[2].named_parameters())
    runs = {}
    for name, strategy in {"resident": Strategy.of(compute_dtype="fp32"),
                           "offload": Strategy.of(compute_dtype="fp32", offload_fraction=1.0,
                                                  activation_offload=True, checkpoint="all"),
                           "auto": AutoStrategy(vram_budget_gb=1.0)}.items():
        cond = demo_conditioning(p, "a red circle", 8, 0)
        latents = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(0))  # an image LATENT: 4-D
        data = dataset_from_conditioning({"samples": latents}, cond)
        with torch.inference_mode():
            runs[name] = run_training_node(TrainConfig(learning_rate=1e-2, seed=0), 2, session=None, model=p,
                                           dataset=data, lora=LoraSpec(rank=4, targets="attention_mlp"),
                                           strategy=strategy, device="cpu", save_dir=Path(loras),
                                           filename_prefix=name, save_every=0, progress=None, should_stop=None)[0]
    first = runs["resident"].lora_state
    out["ffn2_trained"] = any("ffn.2" in n for n in first)
    out["lora_equal"] = all(torch.equal(first[n], runs["offload"].lora_state[n]) for n in first)
    out["losses"] = {k: s.losses for k, s in runs.items()}
    result(out)
"""


def test_a_scaled_fp8_wan_trains(tmp_path):
    """Wan's FFN hands its last Linear to comfy.ops.linear_input_act, which reads the layer's `.weight` before
    calling it: the training copy's quantized layers keep that attribute (the QuantizedTensor rebuilt from their
    parameters); it was missing (AttributeError), so no Wan fp8 scaled file trained. The planner (auto) probes it
    with the latents training gives it: an image LATENT (4-D) with the video time axis added (it probed them 4-D:
    a ValueError in Wan's forward, bf16 files as well)."""
    name, writer, _ = CHECKPOINTS["wan"]
    path = write_scaled_fp8(tmp_path / "wan_fp8_scaled.safetensors", writer(tmp_path / name))
    r, _ = run_in_comfyui(tmp_path, WAN, path, tmp_path / "loras", env=tightrope_env(tmp_path))
    print(f"\n{json.dumps(r, indent=1)}")
    assert r["ffn2"] == r["copy_ffn2"] == "QuantizedTensor"
    assert "weight_qdata" in r["copy_params"] and "weight" not in r["copy_params"]  # still plain parameters
    assert r["ffn2_trained"] and r["lora_equal"]
    assert all(len(losses) == 2 and all(v == v for v in losses) for losses in r["losses"].values()), r["losses"]
    assert set(r["losses"]) == {"resident", "offload", "auto"}

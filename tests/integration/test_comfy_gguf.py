"""A GGUF model loaded by ComfyUI-GGUF trains, offloaded or not, inside ComfyUI's python (a subprocess, no server).

Needs, besides COMFYUI_DIR: COMFYUI_GGUF_DIR, a checkout of https://github.com/city96/ComfyUI-GGUF, and its
requirement `gguf` in ComfyUI's python; skipped, with the reason printed, without them. A tiny random Flux is written
as GGUF (Q8_0 matrices, F32 the rest) and loaded as ComfyUI-GGUF's Unet Loader (GGUF) loads it.
"""
import json
import os
import subprocess
import textwrap

import pytest
from comfy_env import needs_comfyui, run_in_comfyui, tightrope_env
from comfy_runner import TRAIN_TINY

GGUF_DIR = os.environ.get("COMFYUI_GGUF_DIR")
pytestmark = needs_comfyui

WRITER = """
    import numpy as np, gguf
    from safetensors.numpy import load_file as load_np
    src, dst = ARGS
    writer = gguf.GGUFWriter(dst, "flux")  # as ComfyUI-GGUF's tools/convert.py + llama-quantize write it
    for key, value in load_np(src).items():
        value = value.astype(np.float32)
        q = gguf.GGMLQuantizationType.Q8_0 if value.ndim == 2 and value.shape[-1] % 32 == 0 \\
            else gguf.GGMLQuantizationType.F32
        writer.add_tensor(key, gguf.quants.quantize(value, q) if q != gguf.GGMLQuantizationType.F32 else value,
                          raw_dtype=q)
    writer.write_header_to_file(); writer.write_kv_data_to_file(); writer.write_tensors_to_file(); writer.close()
    result(dst)
"""

RUNNER = TRAIN_TINY + textwrap.dedent("""
    from pathlib import Path
    from comfyui_gguf.loader import gguf_sd_loader
    from comfyui_gguf.nodes import GGUFModelPatcher
    from comfyui_gguf.ops import GGMLOps
    from tightrope.demo.conditioning import demo_conditioning
    from tightrope.memory.runtime import MemoryRuntime
    from tightrope.memory.strategy import Strategy
    from tightrope.training.models.comfy import ComfyModelAdapter
    from tightrope.training.save_session import save_session_lora
    path, loras = ARGS
    out = {}

    with torch.inference_mode():  # as ComfyUI runs nodes: UnetLoaderGGUF.load_unet
        model = comfy.sd.load_diffusion_model_state_dict(gguf_sd_loader(path),
                                                         model_options={"custom_operations": GGMLOps()})
        p = GGUFModelPatcher.clone(model)
    dm = p.model.diffusion_model
    w = dm.double_blocks[0].img_attn.qkv.weight
    out["weight"] = [type(w).__name__, w.tensor_type.name, list(w.shape), list(w.size())]
    before = {k: t.clone() for k, t in dm.state_dict(keep_vars=True).items() if t.device.type != "meta"}
    raw = {n: (t.data_ptr(), t.as_subclass(torch.Tensor).clone()) for n, t in dm.named_parameters()}

    def train(patcher, strategy, prefix):
        return train_tiny(patcher, strategy, prefix, loras)

    runs = {}
    for name, kw in {"resident": dict(offload_fraction=0.0), "offload 1.0": dict(offload_fraction=1.0),
                     "offload 0.5 + act. offload": dict(offload_fraction=0.5, activation_offload=True)}.items():
        runs[name] = train(p, Strategy.of(compute_dtype="fp32", checkpoint="all", **kw), name.split()[0])
    first = runs["resident"]
    out["losses"] = {k: s.losses for k, s in runs.items()}
    out["lora_equal"] = {k: all(torch.equal(first.lora_state[n], s.lora_state[n]) for n in first.lora_state)
                         for k, s in runs.items()}
    out["model_unchanged"] = all(torch.equal(before[k], t) for k, t in dm.state_dict(keep_vars=True).items()
                                 if k in before)
    out["bytes_unchanged"] = all(t.data_ptr() == raw[n][0] and torch.equal(t.as_subclass(torch.Tensor), raw[n][1])
                                 and not getattr(t, "patches", []) for n, t in dm.named_parameters())

    adapter = ComfyModelAdapter(p)
    with adapter.training_module() as module:
        cw = module.double_blocks[0].img_attn.qkv.weight
        out["copy"] = [type(cw).__name__, cw.data_ptr() == w.data_ptr(), cw.is_inference()]
        with MemoryRuntime(module, Strategy.of(compute_dtype="fp32", offload_fraction=1.0), "cpu") as rt:
            out["host_copy_bytes"] = rt.offload.host_copy_bytes()
            out["offloaded"] = len(rt.offloaded)

    path = save_session_lora(first, Path(loras), "gguf", "comfyui")
    collect = Collect()
    logging.getLogger().addHandler(collect)
    with torch.inference_mode():
        patched, _ = comfy.sd.load_lora_for_models(p, None, load_file(str(path)), 1.0, 0)
    out["lora_warnings"] = collect.messages
    g = torch.Generator().manual_seed(1)
    cond = demo_conditioning(p, "a red circle", 8, 0)
    x, t = torch.randn(2, 16, 8, 8, generator=g), torch.tensor([0.3, 0.7])
    ctx, pooled = cond[0][0].repeat(2, 1, 1), cond[0][1]["pooled_output"].repeat(2, 1)
    x0 = {}
    for name, m in {"plain": p, "patched": patched}.items():  # the training copy predicts what ComfyUI samples with
        a = ComfyModelAdapter(m)
        with a.training_module() as module:
            v = a.predict(module, x, t, ctx, pooled, 3.5)
        with torch.inference_mode():
            mm.load_models_gpu([m])
            x0[name] = m.model.apply_model(x, t, c_crossattn=ctx, y=pooled, guidance=torch.full((2,), 3.5))
            mm.unload_all_models()
        out[f"{name}_velocity_vs_apply_model"] = (x - v * t.view(-1, 1, 1, 1) - x0[name]).abs().max().item()
    out["lora_changes_output"] = (x0["plain"] - x0["patched"]).abs().max().item()
    result(out)
""")


@pytest.fixture
def gguf_env(tmp_path, comfyui_python):
    if not GGUF_DIR:
        print("skipping the ComfyUI-GGUF tests: set COMFYUI_GGUF_DIR to a checkout of city96/ComfyUI-GGUF")
        pytest.skip("COMFYUI_GGUF_DIR not set (a checkout of city96/ComfyUI-GGUF)")
    if subprocess.run([comfyui_python, "-c", "import gguf"], capture_output=True).returncode:
        print("skipping the ComfyUI-GGUF tests: ComfyUI's python has no `gguf` (pip install -r ComfyUI-GGUF's "
              "requirements.txt into it)")
        pytest.skip("no gguf package in ComfyUI's python")
    env = tightrope_env(tmp_path)
    (tmp_path / "pythonpath" / "comfyui_gguf").symlink_to(os.path.abspath(GGUF_DIR), target_is_directory=True)
    return env


def tiny_gguf(tmp_path, env, dst) -> str:
    """A tiny random Flux as GGUF: Q8_0 matrices (rows a multiple of 32), F32 the rest."""
    from tightrope.demo.tiny_checkpoint import make_tiny_checkpoint
    ckpt = make_tiny_checkpoint(tmp_path / "tiny_flux.safetensors", seed=3)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    return run_in_comfyui(tmp_path, WRITER, ckpt, dst, env=env)[0]


def test_a_gguf_model_trains_offloaded_from_its_own_bytes(tmp_path, gguf_env):
    path = tiny_gguf(tmp_path, gguf_env, str(tmp_path / "tiny_flux.gguf"))
    r, _ = run_in_comfyui(tmp_path, RUNNER, path, tmp_path / "loras", env=gguf_env)
    print(f"\n{json.dumps(r, indent=1)}")
    assert r["weight"] == ["GGMLTensor", "Q8_0", [384, 128], [384, 136]]  # quantized: 34 bytes per 32 values
    assert r["copy"] == ["GGMLTensor", True, False]  # the training copy shares the GGUF bytes, outside inference mode
    assert r["offloaded"] > 0 and r["host_copy_bytes"] == 0  # streamed from the bytes ComfyUI-GGUF loaded
    # offloading moves bytes exactly, so each run's LoRA is the resident run's, bit for bit
    assert all(r["lora_equal"].values()) and len(r["lora_equal"]) == 3
    assert r["losses"]["resident"][-1] < r["losses"]["resident"][0]
    assert r["model_unchanged"] and r["bytes_unchanged"]  # the user's MODEL: same bytes, same values, no patches
    assert r["lora_warnings"] == []  # every key of the saved LoRA applies to the GGUF model
    # ComfyUI-GGUF's layers dequantize (and apply a LoRA already on the MODEL) in the training copy as when sampling
    assert r["plain_velocity_vs_apply_model"] <= 1e-5 and r["patched_velocity_vs_apply_model"] <= 1e-5
    assert r["lora_changes_output"] > 1e-3


def test_a_gguf_workflow_runs_headless_with_the_custom_node_pack(tmp_path, gguf_env, comfyui_python):
    """`tightrope run --comfyui DIR --custom-node ComfyUI-GGUF`: the workflow's Unet Loader (GGUF) runs headless as in
    the server, and the LoRA trained on the GGUF model is saved; without the pack, its node type is named."""
    from api_graph import Graph
    models, out = tmp_path / "models", tmp_path / "out"
    tiny_gguf(tmp_path, gguf_env, str(models / "diffusion_models" / "tiny_flux.gguf"))
    g = Graph()
    unet = g.add("UnetLoaderGGUF", unet_name="tiny_flux.gguf")
    cond = g.add("TightropeDemoConditioning", model=[unet, 0], text="a red circle", tokens=8)
    latent = g.add("EmptySD3LatentImage", width=64, height=64, batch_size=2)
    data = g.add("TightropeDatasetFromLatents", latent=[latent, 0], conditioning=[cond, 0])
    lora = g.add("TightropeLoraSetup", rank=4, alpha=4.0)
    strategy = g.add("TightropeMemoryStrategy", offload_fraction=1.0, checkpoint="all")
    train = g.add("TightropeTrain", steps=2, learning_rate=0.01, device="cpu", filename_prefix="gguf/run",
                  model=[unet, 0], dataset=[data, 0], lora=[lora, 0], strategy=[strategy, 0])
    g.add("TightropeSaveLora", session=[train, 0], filename_prefix="gguf/final")
    (tmp_path / "wf.json").write_text(json.dumps(g.nodes))

    def run(*extra):
        return subprocess.run([comfyui_python, "-m", "tightrope", "run", str(tmp_path / "wf.json"), "--comfyui",
                               os.environ["COMFYUI_DIR"], "--models-dir", str(models), "--output-dir", str(out),
                               *extra], env=gguf_env, capture_output=True, text=True, timeout=600)
    done = run("--custom-node", os.path.abspath(GGUF_DIR))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert len(list((out / "gguf").glob("final_*.safetensors"))) == 1
    missing = run()
    assert missing.returncode == 2 and "UnetLoaderGGUF" in missing.stderr and "Traceback" not in missing.stderr
    not_a_pack = run("--custom-node", str(tmp_path))
    assert not_a_pack.returncode == 2 and "is not a custom node pack" in not_a_pack.stderr

"""`tightrope run --comfyui DIR`: ComfyUI's own nodes in-process, no server. Tiny random Flux and SD3.5 checkpoints are
loaded by the core UNETLoader (from --models-dir), trained headless (Flux from a UI-format workflow), sampled between
two Train nodes (KSampler -> VAEDecode -> SaveImage), and their LoRAs loaded by the core LoraLoaderModelOnly with no
key left over; bad input (a missing model file, a core node that fails) gets its message without a traceback.

The runs share one ComfyUI python process (headless_batch.py: ComfyUI is imported once); the parity test runs the CLI
as users do, `python -m tightrope run`, and compares with a real server.
"""
import json
import subprocess

import pytest
import torch
from api_graph import Graph
from comfy_env import COMFYUI_DIR, REPO, run_headless_batch, tightrope_env
from PIL import Image
from safetensors.torch import load_file
from tiny_models import CHECKPOINTS, write_taef1

from tightrope.training.lora.files import read_lora_file

FLUX, SD3 = CHECKPOINTS["flux"][0], CHECKPOINTS["sd3"][0]


def write_models(models) -> None:
    for family in ("flux", "sd3"):
        name, write, _dtype = CHECKPOINTS[family]
        write(models / "diffusion_models" / name)
    (models / "diffusion_models" / "broken.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{oops}xx")
    (models / "vae_approx").mkdir(parents=True, exist_ok=True)
    write_taef1(models / "vae_approx")


def base_graph(checkpoint: str) -> tuple[Graph, dict]:
    """UNETLoader, demo conditioning for it (no text encoder needed), an empty 64 px latent batch of 2."""
    g = Graph()
    unet = g.add("UNETLoader", unet_name=checkpoint, weight_dtype="default")
    cond = g.add("TightropeDemoConditioning", model=[unet, 0], text="a red circle", tokens=8)
    latent = g.add("EmptySD3LatentImage", width=64, height=64, batch_size=2)
    return g, {"unet": unet, "cond": cond, "latent": latent}


def training_graph(checkpoint: str, family: str, steps: int) -> tuple[Graph, dict]:
    g, ids = base_graph(checkpoint)
    dataset = g.add("TightropeDatasetFromLatents", latent=[ids["latent"], 0], conditioning=[ids["cond"], 0])
    lora = g.add("TightropeLoraSetup", rank=4, alpha=4.0, targets="attention_mlp")
    ids["train"] = g.add("TightropeTrain", steps=steps, learning_rate=0.01, device="cpu", seed=1,
                         filename_prefix=f"tightrope/{family}", model=[ids["unet"], 0], dataset=[dataset, 0],
                         lora=[lora, 0])
    return g, ids


def sampler(g: Graph, model: list, ids: dict, steps: int = 2) -> str:
    return g.add("KSampler", model=model, seed=5, steps=steps, cfg=1.0, sampler_name="euler", scheduler="simple",
                 positive=[ids["cond"], 0], negative=[ids["cond"], 0], latent_image=[ids["latent"], 0], denoise=1.0)


def flux_with_sample() -> dict:
    """Train 2 steps -> sample the trained MODEL -> TAEF1 decode -> SaveImage -> train 1 more step -> Save LoRA."""
    g, ids = training_graph(FLUX, "flux", steps=2)
    vae = g.add("VAELoader", vae_name="taef1")
    decoded = g.add("VAEDecode", samples=[sampler(g, [ids["train"], 1], ids), 0], vae=[vae, 0])
    g.add("SaveImage", images=[decoded, 0], filename_prefix="headless/flux_sample")
    more = g.add("TightropeTrain", steps=1, learning_rate=0.01, device="cpu", filename_prefix="tightrope/flux_more",
                 session=[ids["train"], 0])
    g.add("TightropeSaveLora", session=[more, 0], filename_prefix="tightrope/flux_final")
    return g.nodes


def trained(checkpoint: str, family: str) -> dict:
    g, ids = training_graph(checkpoint, family, steps=1)
    g.add("TightropeSaveLora", session=[ids["train"], 0], filename_prefix=f"tightrope/{family}_final")
    return g.nodes


def lora_check(checkpoint: str, family: str) -> dict:
    """The base model and the core LoraLoaderModelOnly with the trained LoRA, sampled alike, as latents."""
    g, ids = base_graph(checkpoint)
    loaded = g.add("LoraLoaderModelOnly", model=[ids["unet"], 0], strength_model=1.0,
                   lora_name=f"tightrope/{family}_final_00001_.safetensors")
    g.add("SaveLatent", samples=[sampler(g, [loaded, 0], ids), 0], filename_prefix=f"headless/{family}_lora")
    g.add("SaveLatent", samples=[sampler(g, [ids["unet"], 0], ids), 0], filename_prefix=f"headless/{family}_base")
    return g.nodes


@pytest.fixture(scope="module")
def batch(comfyui_python, tmp_path_factory):
    """Every headless run of this module, in order, in one ComfyUI process: {name: (exit code, log text)}."""
    tmp = tmp_path_factory.mktemp("headless_comfyui")
    models, out = tmp / "models", tmp / "out"
    write_models(models)
    missing = {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": "nope.safetensors", "weight_dtype": "default"}},
               **{k: v for k, v in trained(FLUX, "missing").items() if k != "1"}}
    broken = {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": "broken.safetensors", "weight_dtype": "default"}},
              **{k: v for k, v in trained(FLUX, "broken").items() if k != "1"}}
    workflows = {"flux": flux_with_sample(), "flux_check": lora_check(FLUX, "flux"), "sd3": trained(SD3, "sd3"),
                 "sd3_check": lora_check(SD3, "sd3"), "missing": missing, "broken": broken}
    runs = []
    shipped = REPO / "workflows" / "flux_dev_lora_8gb.json"
    runs.append({"argv": ["run", str(shipped), "--models-dir", str(models), "--output-dir", str(tmp / "shipped")],
                 "log": str(tmp / "shipped.log"), "ui_from": None})
    workflows = {"shipped": None, **workflows}
    for name, prompt in workflows.items():
        if prompt is None:
            continue
        path = tmp / f"{name}.json"
        if name != "flux":  # the Flux run is saved in the UI format (written by the driver, with ComfyUI's classes)
            path.write_text(json.dumps(prompt))
        runs.append({"argv": ["run", str(path), "--models-dir", str(models), "--output-dir", str(out)],
                     "log": str(tmp / f"{name}.log"), "ui_from": prompt if name == "flux" else None})
    result = run_headless_batch(comfyui_python, tmp, runs, workflows, timeout=1200)
    result["out"], result["models"] = out, models
    return result


def _ok(batch, name: str) -> str:
    code, log = batch[name]
    assert code == 0, log[-4000:]
    return log


def test_flux_trains_headless_from_a_ui_workflow_with_core_loaders(batch):
    log = _ok(batch, "flux")
    tensors, meta = read_lora_file(batch["out"] / "tightrope" / "flux_final_00001_.safetensors")
    assert meta["tightrope.family"] == "flux" and meta["tightrope.steps"] == "3"
    assert meta["tightrope.base_model"] == FLUX
    assert any(t.abs().max() > 0 for k, t in tensors.items() if "lora_B" in k), "training left lora_B at zero"
    assert "[1/12] node 1 'UNETLoader'" in log


def test_comfyui_loads_without_import_failures(batch):
    """comfy_extras/nodes_replacements.py registers the UI's node replacements with the server: headless, with no
    server, it printed "IMPORT FAILED ... pip install -r requirements.txt" at every run (found by a helper)."""
    logs = "".join(log for name, value in batch.items() if isinstance(value, tuple) for log in value[1:])
    assert "IMPORT FAILED" not in logs and "did not import correctly" not in logs, logs[:4000]


def test_sample_image_written_between_two_train_nodes(batch):
    log = _ok(batch, "flux")
    order = [log.index(f"node {i} '{kind}'") for i, kind in ((6, "TightropeTrain"), (10, "SaveImage"),
                                                              (11, "TightropeTrain"))]
    assert order == sorted(order), "the sample is not taken between the two Train nodes"
    image = Image.open(batch["out"] / "headless" / "flux_sample_00001_.png")
    assert image.size == (64, 64)
    saved_workflow = json.loads(image.info["workflow"])  # SaveImage's hidden EXTRA_PNGINFO: the UI-format file
    assert {n["type"] for n in saved_workflow["nodes"]} >= {"UNETLoader", "TightropeTrain", "SaveImage"}


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_core_lora_loader_applies_every_key_and_changes_the_sample(batch, family):
    _ok(batch, family)
    log = _ok(batch, f"{family}_check")
    assert "lora key not loaded" not in log and "NOT LOADED" not in log, log[-3000:]
    lora, base = (load_file(str(batch["out"] / "headless" / f"{family}_{kind}_00001_.latent"))["latent_tensor"]
                  for kind in ("lora", "base"))
    effect = (lora - base).abs().max().item()
    print(f"\n{family}: the LoRA changes the headless sample by {effect:.3e}")
    assert torch.isfinite(lora).all() and effect > 1e-4


def test_missing_model_file_names_the_file_and_the_folders(batch):
    code, log = batch["missing"]
    assert code == 2, log[-3000:]
    assert ("error: node 1 'UNETLoader' input 'unet_name': model file 'nope.safetensors' not found in ComfyUI's "
            "diffusion_models folders (") in log
    assert str(batch["models"] / "diffusion_models") in log and "--models-dir" in log and "Traceback" not in log


def test_failing_core_node_reports_its_message_without_traceback(batch):
    code, log = batch["broken"]
    assert code == 1, log[-3000:]
    error = next(line for line in log.splitlines() if line.startswith("error: "))
    assert error.startswith("error: node 1 'UNETLoader' failed: SafetensorError: Error while deserializing header"), error
    assert "Traceback" not in log


def test_lora_equals_the_one_a_comfyui_server_trains(comfy_server, checkpoint, comfyui_python, tmp_path):
    """The same API workflow (seed 1, CPU, fp32 strategy) queued in a real server and run by `python -m tightrope
    run --comfyui`: the same node classes on the same weights and seeds, so the LoRAs must be equal bit for bit."""
    name, _dtype = checkpoint("flux")
    g, ids = training_graph(name, "parity", steps=2)
    strategy = g.add("TightropeMemoryStrategy", compute_dtype="fp32", weight_dtype="fp32")
    g.nodes[ids["train"]]["inputs"]["strategy"] = [strategy, 0]
    save = g.add("TightropeSaveLora", session=[ids["train"], 0], filename_prefix="tightrope/parity_final")
    served = read_lora_file(comfy_server.run(g.nodes)["outputs"][save]["text"][0])

    path = tmp_path / "parity.json"
    path.write_text(json.dumps(g.nodes))
    proc = subprocess.run([comfyui_python, "-m", "tightrope", "run", str(path), "--comfyui", COMFYUI_DIR,
                           "--models-dir", str(comfy_server.base / "models"), "--output-dir", str(tmp_path / "out")],
                          env=tightrope_env(tmp_path), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    headless = read_lora_file(tmp_path / "out" / "tightrope" / "parity_final_00001_.safetensors")
    assert served[0].keys() == headless[0].keys() and len(served[0]) > 0
    for key, tensor in served[0].items():
        assert torch.equal(tensor, headless[0][key]), key
    assert served[1]["tightrope.steps"] == headless[1]["tightrope.steps"] == "2"


def test_shipped_flux_dev_workflow_needs_only_its_model_files(batch):
    """workflows/flux_dev_lora_8gb.json, unchanged, against ComfyUI's real node classes: every node type and input is
    known; what is missing are the four model files (this test has none), each named with the folders searched."""
    code, log = batch["shipped"]
    assert code == 2, log[-3000:]
    for node, name, file, folders in ((1, "unet_name", "flux1-dev.safetensors", "diffusion_models"),
                                      (2, "clip_name1", "clip_l.safetensors", "text_encoders"),
                                      (2, "clip_name2", "t5xxl_fp16.safetensors", "text_encoders"),
                                      (3, "vae_name", "ae.safetensors", "vae or vae_approx")):
        assert f"input '{name}': model file '{file}' not found in ComfyUI's {folders} folders (" in log, log[-3000:]
    assert "core node" not in log and "has no input" not in log and "Traceback" not in log

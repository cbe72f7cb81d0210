"""Every shipped workflow validates against the nodes' INPUT_TYPES; the demo runs end to end headless."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from merge_lora import with_lora_file

from tightrope import NODE_CLASS_MAPPINGS
from tightrope.headless import load_workflow, run_workflow
from tightrope.nodes import host
from tightrope.training.lora.files import read_lora_file

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = sorted((ROOT / "workflows").glob("*.json"))


def _core_stand_in(widgets, connections, outputs):
    """A class declaring a ComfyUI core node's schema (0.33) so the graph validates without ComfyUI; combos accept
    the saved value (ComfyUI itself checks model file names against its folders)."""
    class Core:
        RETURN_TYPES = tuple(outputs)
        FUNCTION = "run"
        OUTPUT_NODE = not outputs

        @classmethod
        def INPUT_TYPES(cls):
            spec = {name: (kind, {}) for name, kind in connections}
            spec.update({name: kind for name, kind in widgets})
            return {"required": spec}
    return Core


def _core_schemas() -> dict:
    spec = importlib.util.spec_from_file_location("make_workflows", ROOT / "scripts" / "make_workflows.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CORE


def _mappings_for(workflow: dict) -> dict:
    CORE = _core_schemas()
    mappings = dict(NODE_CLASS_MAPPINGS)
    for node in workflow["nodes"]:
        if node["type"] in CORE:
            names, conns, outs = CORE[node["type"]]
            values = [v for n, v in zip(names, node["widgets_values"]) if n != "control_after_generate"]
            names = [n for n in names if n != "control_after_generate"]
            kinds = [("INT", {"control_after_generate": True}) if n == "seed" else
                     ("FLOAT", {}) if isinstance(v, float) else ("INT", {}) if isinstance(v, int) else ([v], {})
                     for n, v in zip(names, values)]
            mappings[node["type"]] = _core_stand_in(list(zip(names, kinds)), conns, outs)
    return mappings


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_workflow_validates(path, tmp_path, monkeypatch):
    workflow = json.loads(path.read_text())
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_dataset").mkdir()  # the folder the Flux workflows name for the user's images must exist
    (tmp_path / "my_videos").mkdir()  # and the Wan workflow's folder of clips
    assert workflow["version"] == 0.4 and workflow["links"] and workflow["nodes"]
    graph = load_workflow(workflow, _mappings_for(workflow))
    types = {spec.class_type for spec in graph.values()}
    assert {"TightropeTrain", "TightropeSaveLora", "TightropeLoraSetup", "TightropeMemoryStrategy"} <= types


def test_wan_video_workflow_feeds_clips_to_a_wan_model(tmp_path, monkeypatch):
    """workflows/wan21_t2v_1.3b_lora_12gb.json: Comfy-Org's repackaged Wan 2.1 T2V 1.3B files, umt5 through CLIPLoader
    type wan, 33-frame clips at 16 fps, an auto strategy with a VRAM budget, and every node wired to the next."""
    workflow = json.loads((ROOT / "workflows" / "wan21_t2v_1.3b_lora_12gb.json").read_text())
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_videos").mkdir()
    graph = load_workflow(workflow, _mappings_for(workflow))
    by_type = {spec.class_type: (node_id, spec.inputs) for node_id, spec in graph.items()}
    assert by_type["UNETLoader"][1]["unet_name"] == "wan2.1_t2v_1.3B_fp16.safetensors"
    assert by_type["CLIPLoader"][1] == {"clip_name": "umt5_xxl_fp8_e4m3fn_scaled.safetensors", "type": "wan",
                                        "device": "default"}
    assert by_type["VAELoader"][1]["vae_name"] == "wan_2.1_vae.safetensors"
    dataset = by_type["TightropeLoadDataset"][1]
    assert (dataset["frames"], dataset["fps"], dataset["folder"]) == (33, 16.0, "my_videos")
    assert 832 * 480 <= dataset["resolution"] ** 2 < 2 * 832 * 480  # Wan's 480p sizes fit the pixel budget
    assert list(dataset["vae"]) == [by_type["VAELoader"][0], 0]
    assert list(dataset["clip"]) == [by_type["CLIPLoader"][0], 0]
    strategy = by_type["TightropeMemoryStrategy"][1]
    assert strategy["mode"] == "auto" and strategy["vram_budget_gb"] > 0
    train = by_type["TightropeTrain"][1]
    assert {k: list(train[k]) for k in ("model", "dataset", "lora", "strategy")} == {
        "model": [by_type["UNETLoader"][0], 0], "dataset": [by_type["TightropeLoadDataset"][0], 0],
        "lora": [by_type["TightropeLoraSetup"][0], 0], "strategy": [by_type["TightropeMemoryStrategy"][0], 0]}
    assert train["timestep_shift"] == 0.0  # 0: Wan's own sampling shift
    assert list(by_type["TightropeSaveLora"][1]["session"]) == [by_type["TightropeTrain"][0], 0]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    with host.headless(out):
        results = run_workflow(load_workflow(WORKFLOWS[0].parent / "demo.json", NODE_CLASS_MAPPINGS),
                               NODE_CLASS_MAPPINGS)
    return out, results


def test_demo_trains_and_writes_lora_and_plots(demo_run):
    out, results = demo_run
    session = results["8"][0]
    assert session.step == 150 and len(session.losses) == 150
    first, last = sum(session.losses[:20]) / 20, sum(session.losses[-20:]) / 20
    assert last <= 0.8 * first, (first, last)
    lora_path = Path(results["9"][0])
    assert lora_path.parent == out / "tightrope" and lora_path.exists()
    tensors, meta = read_lora_file(lora_path)
    modules = {k.rsplit(".lora_", 1)[0] for k in tensors if ".lora_" in k}
    assert modules and all(f"{m}.alpha" in tensors and f"{m}.lora_B.weight" in tensors for m in modules)
    assert all(k.startswith("diffusion_model.") for k in tensors) and meta["tightrope.steps"] == "150"
    assert sorted(p.name for p in (out / "tightrope").glob("demo_*.png")) == \
        ["demo_loss_00001_.png", "demo_memory_00001_.png"]
    assert len(list((out / "tightrope").glob("demo_checkpoint_*.safetensors"))) == 3  # steps 50, 100, 150


def test_saved_lora_changes_the_model_like_the_model_output(demo_run):
    _, results = demo_run
    session, lora_path = results["8"][0], results["9"][0]
    base = session.model
    g = torch.Generator().manual_seed(3)
    x, ctx, y = torch.randn(1, 16, 8, 8, generator=g), torch.randn(1, 6, 64, generator=g), torch.randn(1, 32, generator=g)
    t, guidance = torch.tensor([0.5]), torch.tensor([1.0])
    with torch.no_grad():
        plain = base.flux.forward_latent(x, t, ctx, y, guidance)
        from_file = with_lora_file(base, lora_path).flux.forward_latent(x, t, ctx, y, guidance)
        from_node = results["8"][1].flux.forward_latent(x, t, ctx, y, guidance)
    assert (from_file - plain).abs().max() > 1e-3
    torch.testing.assert_close(from_file, from_node, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(base.flux.forward_latent(x, t, ctx, y, guidance), plain)  # input left as it was


def test_shipped_workflows_are_what_the_generator_makes():
    """Every node's every widget is saved: a node input added without regenerating (`python
    scripts/make_workflows.py`) leaves a workflow the frontend re-saves differently (and the generator refuses)."""
    spec = importlib.util.spec_from_file_location("make_workflows", ROOT / "scripts" / "make_workflows.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert sorted(module.WORKFLOWS) == sorted(p.name for p in WORKFLOWS)
    for name, make in module.WORKFLOWS.items():
        assert json.loads((ROOT / "workflows" / name).read_text()) == make(), f"regenerate workflows/{name}"

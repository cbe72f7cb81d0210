"""workflows/wan21_t2v_1.3b_lora_12gb.json against ComfyUI's real node classes (`tightrope run --comfyui`, both runs in
one ComfyUI process, as test_headless_comfyui.py does for the Flux workflow).

Unchanged, with a tiny random Wan 2.1 and a tiny random video TAE (ComfyUI's TAEHV, 16 channels, 8x in space, 4x in
time) saved under the workflow's own file names: every node type and input is known, both files are found, and only the
text encoder (umt5 xxl, not in this test) is reported missing. Then the same file with its CLIPLoader swapped for a
stand-in of Wan's text width and sized down (a folder of tiny .mp4 clips made with PyAV, 9 frames, 32 px, 2 steps),
everything else as shipped (the auto Memory Strategy included): it trains on the clips and saves a Wan LoRA.
"""
import json

import pytest
from comfy_env import REPO, run_headless_batch, run_in_comfyui, tightrope_env
from test_comfy_wan_video import WIDE_TEXT
from tiny_models import wan_shapes, write_checkpoint

from tightrope.training.lora.files import read_lora_file

SHIPPED = REPO / "workflows" / "wan21_t2v_1.3b_lora_12gb.json"

MAKE_FILES = """
    from pathlib import Path
    import av
    from PIL import Image
    import comfy.taesd.taehv as taehv
    models, folder = Path(ARGS[0]), Path(ARGS[1])
    g = torch.Generator().manual_seed(0)
    (models / "vae").mkdir(parents=True)
    tae = {k: torch.randn(v.shape, generator=g) / max(1, v[0].numel()) ** 0.5
           for k, v in taehv.TAEHV(16).state_dict().items()}
    save_file(tae, str(models / "vae" / "wan_2.1_vae.safetensors"))  # a tiny random video VAE, Wan 2.1's name
    folder.mkdir(parents=True)
    for i, size in enumerate(((32, 32), (48, 32))):
        with av.open(str(folder / f"clip{i}.mp4"), "w") as out:
            stream = out.add_stream("libx264", rate=16)
            stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
            for k in range(12):
                frame = Image.new("RGB", size, ((20 * k + 90 * i) % 256, 100, 200 - 10 * k))
                for packet in stream.encode(av.VideoFrame.from_image(frame)):
                    out.mux(packet)
            for packet in stream.encode():
                out.mux(packet)
        (folder / f"clip{i}.txt").write_text(f"a fading clip number {i}")
    result("ok")
"""


def tiny_copy(workflow: dict, folder: str) -> dict:
    """The shipped UI workflow with the text encoder swapped for WideDemoText and the sizes made tiny."""
    workflow = json.loads(json.dumps(workflow))
    for node in workflow["nodes"]:
        values = node["widgets_values"]
        if node["type"] == "CLIPLoader":
            node.update(type="WideDemoText", widgets_values=[], properties={"Node name for S&R": "WideDemoText"})
        elif node["type"] == "TightropeLoadDataset":  # folder, resolution, ..., frames, fps
            values[0], values[1], values[6] = folder, 32, 9
        elif node["type"] == "TightropeTrain":  # steps, ..., warmup_steps
            values[0], values[4] = 2, 0
    return workflow


@pytest.fixture(scope="module")
def batch(comfyui_python, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("headless_wan")
    models, clips = tmp / "models", tmp / "clips"
    run_in_comfyui(tmp, MAKE_FILES, models, clips, env=tightrope_env(tmp))
    (models / "diffusion_models").mkdir()
    write_checkpoint(models / "diffusion_models" / "wan2.1_t2v_1.3B_fp16.safetensors", wan_shapes(), seed=2)
    (tmp / "wide_text").mkdir()
    (tmp / "wide_text" / "__init__.py").write_text(WIDE_TEXT)
    tiny = tmp / "wan_tiny.json"
    tiny.write_text(json.dumps(tiny_copy(json.loads(SHIPPED.read_text()), str(clips))))
    runs = [{"argv": ["run", str(SHIPPED), "--models-dir", str(models), "--output-dir", str(tmp / "shipped")],
             "log": str(tmp / "shipped.log"), "ui_from": None},
            {"argv": ["run", str(tiny), "--models-dir", str(models), "--output-dir", str(tmp / "out"),
                      "--custom-node", str(tmp / "wide_text")], "log": str(tmp / "tiny.log"), "ui_from": None}]
    result = run_headless_batch(comfyui_python, tmp, runs, ["shipped", "tiny"], timeout=900)
    result["out"] = tmp / "out"
    return result


def test_shipped_wan_workflow_needs_only_its_text_encoder(batch):
    """Unchanged: the tiny Wan and VAE under the shipped names are found; what is missing is the umt5 file and the
    user's folder of clips (the test runs where there is no my_videos), nothing else."""
    code, log = batch["shipped"]
    assert code == 2, log[-3000:]
    assert "error: 2 problems in the workflow:" in log, log[-3000:]
    assert ("node 2 'CLIPLoader' input 'clip_name': model file 'umt5_xxl_fp8_e4m3fn_scaled.safetensors' not "
            "found in ComfyUI's text_encoders folders (") in log, log[-3000:]
    assert "node 4 'TightropeLoadDataset' failed its own input check: dataset folder 'my_videos' does not exist" in log
    assert "wan2.1_t2v_1.3B_fp16" not in log and "wan_2.1_vae" not in log, log[-3000:]
    assert "core node" not in log and "has no input" not in log and "Traceback" not in log


def test_shipped_wan_workflow_trains_on_clips_with_tiny_models(batch):
    code, log = batch["tiny"]
    assert code == 0, log[-4000:]
    assert "in 4 entries, 4 used by this load" in log, log[-3000:]  # two clips and their captions
    tensors, meta = read_lora_file(batch["out"] / "tightrope" / "wan21_t2v_lora_00001_.safetensors")
    assert meta["tightrope.family"] == "wan" and meta["tightrope.steps"] == "2", meta
    assert meta["tightrope.base_model"] == "wan2.1_t2v_1.3B_fp16.safetensors"
    assert any(t.abs().max() > 0 for k, t in tensors.items() if "lora_B" in k), "training left lora_B at zero"
    assert any(".ffn." in k for k in tensors) and any(".self_attn." in k for k in tensors)  # attention_mlp on Wan

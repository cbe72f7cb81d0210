"""Wan on video clips in the real ComfyUI (0.33, CPU, fp32).

In ComfyUI's python (a subprocess, no server): a folder of real .mp4 clips (PyAV, ComfyUI's own dependency) and an
image goes through the Load Dataset node with a real ComfyUI video VAE (a tiny random TAEHV, ComfyUI's 'lighttaew2_1'
layout: 16 channels, 8x in space, 4x in time): each clip is one sample of 1 + (frames - 1) / 4 latent frames, equal
to ComfyUI's own Load Video decode + VAE Encode of the same frames; the image is one frame; a second load encodes
nothing. A tiny random Wan 2.1 trains 3 steps on it: the clips' frames reach the model, the training forward on
multi-frame latents equals ComfyUI's apply_model, and the saved LoRA loads with every key applied.

Through the real server: EmptyHunyuanLatentVideo (the LATENT Wan workflows sample) -> Dataset from Latents -> Train
-> Save LoRA, and the trained MODEL samples that video latent.
"""
import json

import pytest
import torch
from api_graph import Graph, saved_latent
from comfy_env import needs_comfyui, run_in_comfyui, tightrope_env
from tiny_models import qwen_image_shapes, wan_shapes, write_checkpoint

from tightrope.training.lora.files import read_lora_file

RUNNER = """
    import warnings
    from pathlib import Path
    import av
    from PIL import Image
    import comfy.taesd.taehv as taehv
    from comfy_api.latest._input_impl.video_types import VideoFromFile
    from tightrope.demo.encoders import DemoCaptionEmbedder
    from tightrope.memory.strategy import Strategy
    from tightrope.nodes.dataset_nodes import TightropeLoadDataset
    from tightrope.training.lora.layers import LoraSpec
    from tightrope.training.models.comfy import ComfyModelAdapter
    from tightrope.training.save_session import save_session_lora
    from tightrope.training.train_config import TrainConfig
    from tightrope.training.training_run import run_training_node
    from tightrope.nodes import host
    ckpt, folder, loras = ARGS[0], Path(ARGS[1]), Path(ARGS[2])
    host.cache_dir = lambda: loras.parent / "cache"  # not ComfyUI's user folder (folder_paths is imported here)

    def colour(k):
        return (k * 23) % 256, (k * 41 + 40) % 256, (255 - k * 17) % 256

    def write_clip(name, size, fps, n, caption):
        with av.open(str(folder / name), "w") as out:
            stream = out.add_stream("libx264", rate=fps)
            stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
            stream.options = {"crf": "0", "preset": "ultrafast"}
            for k in range(n):
                for packet in stream.encode(av.VideoFrame.from_image(Image.new("RGB", size, colour(k)))):
                    out.mux(packet)
            for packet in stream.encode():
                out.mux(packet)
        (folder / name).with_suffix(".txt").write_text(caption)

    folder.mkdir(parents=True)
    write_clip("square.mp4", (32, 32), 16, 12, "a square clip")  # 12 frames: the first 9 train as they are
    write_clip("wide.mp4", (64, 32), 30, 30, "a wide clip")  # resampled to 16 fps
    Image.new("RGB", (32, 32), colour(3)).save(folder / "still.png")
    (folder / "still.txt").write_text("a still image")

    g = torch.Generator().manual_seed(0)
    shapes = taehv.TAEHV(16).state_dict()
    vae = comfy.sd.VAE(sd={k: torch.randn(v.shape, generator=g) / max(1, v[0].numel()) ** 0.5
                           for k, v in shapes.items()})
    text = DemoCaptionEmbedder(4096, 0, max_tokens=8)  # Wan's text width (the VAE is what is under test)

    def load():
        with warnings.catch_warnings(record=True) as said, torch.inference_mode():
            warnings.simplefilter("always")
            (data,) = TightropeLoadDataset().load(str(folder), vae, text, 32, 0.0, True, True, "none", 9, 16.0)
        return data, [str(w.message) for w in said]

    data, said = load()
    out = {"vae": [vae.latent_dim, vae.temporal_compression_decode()], "said": said, "encoded": data.encoded_images,
           "shapes": {data.caption(i): list(data.latent_shape(i)) for i in range(data.num_images)}}
    again, _ = load()
    out["again"] = [again.encoded_images, again.image_cache_hits]
    i = next(i for i in range(data.num_images) if data.caption(i) == "a square clip")
    images = VideoFromFile(str(folder / "square.mp4")).get_components().images[:9]  # ComfyUI's Load Video
    with torch.inference_mode():
        reference = vae.encode((images * 255).round() / 255)[0]  # VAE Encode of its frames, at 8 bits as ours
    out["vs_comfyui"] = [(data.latent(i) - reference).abs().max().item(), reference.abs().max().item()]

    seen = []
    predict = ComfyModelAdapter.predict
    def recording(self, module, x_t, t, *a, **k):
        seen.append(list(x_t.shape))
        return predict(self, module, x_t, t, *a, **k)
    ComfyModelAdapter.predict = recording
    with torch.inference_mode():
        p = comfy.sd.load_diffusion_model(ckpt)
        s = run_training_node(TrainConfig(learning_rate=1e-2, seed=0), 3, session=None, model=p, dataset=data,
                              lora=LoraSpec(rank=4), strategy=Strategy.of(compute_dtype="fp32"), device="cpu",
                              save_dir=loras, filename_prefix="video", save_every=0, progress=None,
                              should_stop=None)[0]
    ComfyModelAdapter.predict = predict
    out["seen"], out["losses"] = sorted(seen), s.losses

    x, t = torch.randn(2, 16, 3, 4, 4, generator=g), torch.tensor([0.3, 0.9])  # 3 latent frames
    ctx = text.encode(["a square clip", "a wide clip"])[0]
    adapter = ComfyModelAdapter(p)
    with adapter.training_module() as module:
        v = adapter.predict(module, x, t, ctx, torch.zeros(2, 0), 1.0)
    with torch.inference_mode():
        mm.load_models_gpu([p])
        x0 = p.model.apply_model(x, t, c_crossattn=ctx)
        mm.unload_all_models()
    out["velocity_diff"] = (x - v * t.view(-1, 1, 1, 1, 1) - x0).abs().max().item()

    # an image model (Flux) refuses the clips before any step, in one line naming the dataset and the fix
    from tightrope.demo.tiny_checkpoint import make_tiny_checkpoint
    from tightrope.training.input_checks import check_dataset_fits_model
    from tightrope.training.session import TrainingSession
    with torch.inference_mode():
        flux = comfy.sd.load_diffusion_model(make_tiny_checkpoint(loras.parent / "flux.safetensors"))
    out["takes_video"] = [adapter.takes_video(), ComfyModelAdapter(flux).takes_video()]
    try:
        check_dataset_fits_model(TrainingSession(model=flux, dataset=data, lora=LoraSpec(rank=4),
                                                 strategy=Strategy.of(compute_dtype="fp32"), config=TrainConfig()))
    except Exception as e:
        out["flux_refused"] = [type(e).__name__, str(e)]
    try:
        ComfyModelAdapter(flux).process_latents(torch.zeros(1, 16, 3, 4, 4))
    except Exception as e:
        out["flux_process"] = [type(e).__name__, str(e)]

    path = save_session_lora(s, loras, "video_final", "comfyui")
    lora = load_file(str(path))
    collect = Collect()
    logging.getLogger().addHandler(collect)
    with torch.inference_mode():
        patched, _ = comfy.sd.load_lora_for_models(p, None, lora, 1.0, 0)
    logging.getLogger().removeHandler(collect)
    layers = sorted({k.rsplit(".lora_", 1)[0].rsplit(".alpha", 1)[0] + ".weight" for k in lora})
    out["lora"] = [collect.messages, len(layers), sorted(patched.patches) == layers]
    result(out)
"""


@needs_comfyui
def test_wan_trains_on_a_folder_of_clips_in_comfyui(tmp_path):
    ckpt = write_checkpoint(tmp_path / "tiny_wan21.safetensors", wan_shapes(), seed=2)
    r, _ = run_in_comfyui(tmp_path, RUNNER, ckpt, tmp_path / "data", tmp_path / "loras", env=tightrope_env(tmp_path))
    print(f"\n{json.dumps(r, indent=1)}")
    assert r["vae"] == [3, 4]
    shapes = r["shapes"]
    assert shapes["a square clip"] == [16, 3, 4, 4]  # 9 frames -> 1 + 8 / 4 latent frames, 32x32 -> 4x4
    assert shapes["a wide clip"][:2] == [16, 3] and shapes["a wide clip"][3] > shapes["a wide clip"][2]
    assert shapes["a still image"] == [16, 4, 4]  # an image: one frame (the adapter adds its time axis)
    assert r["encoded"] == 3 and r["again"] == [0, 3]  # the second load: every latent from the cache
    diff, scale = r["vs_comfyui"]
    assert diff <= 0.002 * scale, r["vs_comfyui"]  # = ComfyUI's Load Video + VAE Encode (up to YUV->RGB rounding)
    # batch 1, one bucket a batch: an epoch of 3 steps sees each shape once, as (B, C, T, h, w), the frames intact
    assert r["seen"] == sorted([[1, 16, 3, 4, 4], [1, 16, 3, *shapes["a wide clip"][2:]], [1, 16, 1, 4, 4]])
    assert all(v == v for v in r["losses"])
    assert r["velocity_diff"] <= 1e-5
    assert r["takes_video"] == [True, False]
    kind, message = r["flux_refused"]
    assert kind == "DatasetError" and "the dataset holds 2 video clip(s)" in message
    assert "takes image latents: train a video model (Wan)" in message
    kind, message = r["flux_process"]
    assert kind == "ConfigError" and "takes image latents, not video latents of shape (1, 16, 3, 4, 4)" in message
    warnings, layers, all_patched = r["lora"]
    assert warnings == [] and layers and all_patched


QWEN_RUNNER = """
    from tightrope.training.models.comfy import ComfyModelAdapter
    with torch.inference_mode():
        adapter = ComfyModelAdapter(comfy.sd.load_diffusion_model(ARGS[0]))
    out = {"family": adapter.family, "takes_video": adapter.takes_video(),
           "image": list(adapter.process_latents(torch.zeros(1, 16, 4, 4)).shape)}
    try:
        adapter.process_latents(torch.zeros(1, 16, 3, 4, 4))
    except Exception as e:
        out["refused"] = [type(e).__name__, str(e)]
    result(out)
"""


@needs_comfyui
def test_qwen_image_refuses_clips(tmp_path):
    """Qwen-Image reads Wan's 3-D latents (its VAE is Wan 2.1's), but is an image model: clips are refused as for
    Flux (they trained its time axis, silently)."""
    ckpt = write_checkpoint(tmp_path / "tiny_qwen_image.safetensors", qwen_image_shapes(), seed=5,
                            dtype=torch.bfloat16)
    r, _ = run_in_comfyui(tmp_path, QWEN_RUNNER, ckpt, env=tightrope_env(tmp_path))
    assert r["family"] == "qwen_image" and r["takes_video"] is False
    assert r["image"] == [1, 16, 1, 4, 4]  # an image's latent gets its time axis of 1, as before
    kind, message = r["refused"]
    assert kind == "ConfigError" and "takes image latents, not video latents" in message

def test_wan_trains_on_a_video_latent_through_the_server(comfy_server, checkpoint):
    name, weight_dtype = checkpoint("wan")
    g = Graph()
    unet = g.add("UNETLoader", unet_name=name, weight_dtype=weight_dtype)
    cond = g.add("TightropeDemoConditioning", model=[unet, 0], text="a red circle", tokens=8)
    latent = g.add("EmptyHunyuanLatentVideo", width=64, height=64, length=9, batch_size=2)  # (2, 16, 3, 8, 8)
    dataset = g.add("TightropeDatasetFromLatents", latent=[latent, 0], conditioning=[cond, 0])
    lora = g.add("TightropeLoraSetup", rank=4, alpha=4.0)
    train = g.add("TightropeTrain", steps=2, learning_rate=0.01, device="cpu", filename_prefix="tightrope/it_video",
                  model=[unet, 0], dataset=[dataset, 0], lora=[lora, 0], batch_size=2)
    save = g.add("TightropeSaveLora", session=[train, 0], filename_prefix="tightrope/it_video_final")
    out = g.sample([train, 1], cond, latent, "it/video_trained", steps=1)
    entry = comfy_server.run(g.nodes)
    tensors, meta = read_lora_file(entry["outputs"][save]["text"][0])
    assert meta["tightrope.family"] == "wan" and meta["tightrope.steps"] == "2"
    assert any(t.abs().max() > 0 for k, t in tensors.items() if "lora_B" in k), "training left lora_B at zero"
    sampled = saved_latent(comfy_server, entry, out)
    assert sampled.shape == (2, 16, 3, 8, 8) and torch.isfinite(sampled).all()
    assert "lora key not loaded" not in comfy_server.log()


MAKE_FILES = """
    from pathlib import Path
    import av
    from PIL import Image
    import comfy.taesd.taehv as taehv
    models, folder = Path(ARGS[0]), Path(ARGS[1])
    g = torch.Generator().manual_seed(0)
    (models / "vae_approx").mkdir(parents=True)
    tae = {k: torch.randn(v.shape, generator=g) / max(1, v[0].numel()) ** 0.5
           for k, v in taehv.TAEHV(16).state_dict().items()}
    save_file(tae, str(models / "vae_approx" / "lighttaew2_1.safetensors"))  # a tiny random one
    folder.mkdir(parents=True)
    with av.open(str(folder / "clip.webm"), "w") as out:
        stream = out.add_stream("libvpx-vp9", rate=24)
        stream.width, stream.height, stream.pix_fmt = 64, 64, "yuv420p"
        for k in range(30):
            for packet in stream.encode(av.VideoFrame.from_image(Image.new("RGB", (64, 64), (8 * k, 100, 200)))):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    (folder / "clip.txt").write_text("a fading clip")
    Image.new("RGB", (64, 64), (200, 30, 30)).save(folder / "still.png")
    (folder / "still.txt").write_text("a red square")
    result("ok")
"""


WIDE_TEXT = """
from tightrope.demo.encoders import DemoCaptionEmbedder


class WideDemoText:
    \"\"\"A stand-in CLIP of Wan's text width (4096): the tiny Wan's real text encoder would be UMT5-XXL.\"\"\"
    RETURN_TYPES, FUNCTION, CATEGORY = ("CLIP",), "load", "test"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {}}

    def load(self):
        return (DemoCaptionEmbedder(4096, 0, max_tokens=8),)


NODE_CLASS_MAPPINGS = {"WideDemoText": WideDemoText}
"""


@needs_comfyui
def test_wan_trains_on_clips_headless(tmp_path, comfyui_python):
    """`tightrope run --comfyui`: ComfyUI's VAELoader (a video TAE) -> Load Dataset (a .webm clip and an image,
    frames 9 at 12 fps) -> Train -> Save LoRA, the same node code as in ComfyUI; run again, every latent is cached."""
    from comfy_env import run_headless_batch
    models, folder = tmp_path / "models", tmp_path / "data"
    run_in_comfyui(tmp_path, MAKE_FILES, models, folder, env=tightrope_env(tmp_path))
    (models / "diffusion_models").mkdir()
    write_checkpoint(models / "diffusion_models" / "tiny_wan21.safetensors", wan_shapes(), seed=2)
    (tmp_path / "wide_text").mkdir()
    (tmp_path / "wide_text" / "__init__.py").write_text(WIDE_TEXT)
    g = Graph()
    unet = g.add("UNETLoader", unet_name="tiny_wan21.safetensors", weight_dtype="default")
    vae = g.add("VAELoader", vae_name="lighttaew2_1.safetensors")
    text = g.add("WideDemoText")
    dataset = g.add("TightropeLoadDataset", folder=str(folder), vae=[vae, 0], clip=[text, 0], resolution=32,
                    frames=9, fps=12.0)
    lora = g.add("TightropeLoraSetup", rank=4, alpha=4.0)
    train = g.add("TightropeTrain", steps=2, learning_rate=0.01, device="cpu", filename_prefix="tightrope/clips",
                  model=[unet, 0], dataset=[dataset, 0], lora=[lora, 0])
    g.add("TightropeSaveLora", session=[train, 0], filename_prefix="tightrope/clips_final")
    out, workflow = tmp_path / "out", tmp_path / "clips.json"
    workflow.write_text(json.dumps(g.nodes))
    argv = ["run", str(workflow), "--models-dir", str(models), "--output-dir", str(out), "--custom-node",
            str(tmp_path / "wide_text")]
    runs = [{"argv": argv, "log": str(tmp_path / "clips.log"), "ui_from": None},
            {"argv": argv, "log": str(tmp_path / "again.log"), "ui_from": None}]  # the same cache: no new entry
    result = run_headless_batch(comfyui_python, tmp_path, runs, ["clips", "again"], timeout=900)
    for name in ("clips", "again"):
        code, log = result[name]
        assert code == 0, log[-4000:]
    tensors, meta = read_lora_file(out / "tightrope" / "clips_final_00001_.safetensors")
    assert meta["tightrope.family"] == "wan" and meta["tightrope.steps"] == "2"
    assert any(t.abs().max() > 0 for k, t in tensors.items() if "lora_B" in k)
    for name in ("clips", "again"):  # a clip, an image and their two captions, all four read by the second load too
        assert "in 4 entries, 4 used by this load" in result[name][1], result[name][1][-3000:]


pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

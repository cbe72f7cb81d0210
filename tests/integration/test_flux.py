"""Training a tiny Flux through a real ComfyUI server's HTTP API: progress on the websocket, the LoRA file, the core
LoraLoaderModelOnly applying it (no key left over) with the same samples as the Train node's MODEL output, and
/interrupt during a long run."""
import math
import re
import time
import uuid

import pytest
import torch
from api_graph import Graph, saved_latent
from comfy_websocket import WebSocket

from tightrope.training.lora.files import read_lora_file

STEPS = 4


@pytest.fixture(scope="module")
def flux_run(comfy_server, checkpoint):
    """One training prompt (images -> ComfyUI's VAE -> Load Dataset -> Train -> Save LoRA, plus samples from the
    base model and from the Train node's MODEL output), run with a websocket listening."""
    name, weight_dtype = checkpoint("flux")
    g = Graph()
    ids = g.train_flux((name, weight_dtype), prefix="tightrope/it_flux", images="it_flux_images", steps=STEPS,
                       learning_rate=0.01)
    unet, train, save = ids["unet"], ids["train"], ids["save"]
    cond = g.add("TightropeDemoConditioning", model=[unet, 0], text="a red circle", tokens=8)
    latent = g.add("EmptySD3LatentImage", width=64, height=64, batch_size=1)
    trained = g.sample([train, 1], cond, latent, "it/flux_trained_model")
    base = g.sample([unet, 0], cond, latent, "it/flux_base")
    client = uuid.uuid4().hex
    ws = WebSocket(comfy_server, client)
    try:
        prompt_id = comfy_server.queue(g.nodes, client)
        entry = comfy_server.wait(prompt_id)
        time.sleep(0.5)  # the last websocket messages
    finally:
        ws.close()
    return {"entry": entry, "prompt_id": prompt_id, "ws": ws, "train": train, "save": save,
            "unet": (name, weight_dtype), "trained": saved_latent(comfy_server, entry, trained),
            "base": saved_latent(comfy_server, entry, base)}


def test_progress_on_the_websocket(flux_run):
    progress = [m for m in flux_run["ws"].of_type("progress", flux_run["prompt_id"]) if m["node"] == flux_run["train"]]
    assert [m["value"] for m in progress][-1] == STEPS and all(m["max"] == STEPS for m in progress), progress
    assert flux_run["ws"].of_type("execution_success", flux_run["prompt_id"])


def test_lora_file_written(comfy_server, flux_run):
    path = flux_run["entry"]["outputs"][flux_run["save"]]["text"][0]
    assert path.startswith(str(comfy_server.base / "models" / "loras" / "tightrope"))
    tensors, meta = read_lora_file(path)
    assert meta["tightrope.family"] == "flux" and meta["tightrope.steps"] == str(STEPS)
    assert meta["tightrope.base_model"] == flux_run["unet"][0]
    assert any(t.abs().max() > 0 for k, t in tensors.items() if "lora_B" in k), "training left lora_B at zero"


def test_core_lora_loader_matches_train_output(comfy_server, flux_run):
    path = flux_run["entry"]["outputs"][flux_run["save"]]["text"][0]
    lora_name = str(path).split("/models/loras/", 1)[1]
    g = Graph()
    unet = g.add("UNETLoader", unet_name=flux_run["unet"][0], weight_dtype=flux_run["unet"][1])
    loader = g.add("LoraLoaderModelOnly", model=[unet, 0], lora_name=lora_name, strength_model=1.0)
    cond = g.add("TightropeDemoConditioning", model=[unet, 0], text="a red circle", tokens=8)
    latent = g.add("EmptySD3LatentImage", width=64, height=64, batch_size=1)
    out = g.sample([loader, 0], cond, latent, "it/flux_core_lora")
    core = saved_latent(comfy_server, comfy_server.run(g.nodes), out)
    log = comfy_server.log()
    assert "lora key not loaded" not in log and "NOT LOADED" not in log, log[-3000:]
    effect = (core - flux_run["base"]).abs().max().item()
    diff = (core - flux_run["trained"]).abs().max().item()
    print(f"\nLoRA changes the sample by {effect:.3e}; core loader vs Train node MODEL: {diff:.3e}")
    assert effect > 1e-4
    assert torch.equal(core, flux_run["trained"])


def test_interrupt_keeps_server_and_last_lora(comfy_server, checkpoint):
    name, weight_dtype = checkpoint("flux")
    g = Graph()
    unet = g.add("UNETLoader", unet_name=name, weight_dtype=weight_dtype)
    cond = g.add("TightropeDemoConditioning", model=[unet, 0], text="a long run", tokens=8)
    latent = g.add("EmptySD3LatentImage", width=64, height=64, batch_size=2)
    dataset = g.add("TightropeDatasetFromLatents", latent=[latent, 0], conditioning=[cond, 0])
    lora = g.add("TightropeLoraSetup", rank=4, alpha=4.0)
    train = g.add("TightropeTrain", steps=400, learning_rate=0.01, device="cpu", save_every=2,
                  filename_prefix="tightrope/it_interrupt", model=[unet, 0], dataset=[dataset, 0], lora=[lora, 0])
    g.add("TightropeSaveLora", session=[train, 0], filename_prefix="tightrope/it_interrupt_final")  # an output
    client = uuid.uuid4().hex
    ws = WebSocket(comfy_server, client)
    try:
        prompt_id = comfy_server.queue(g.nodes, client)
        deadline = time.time() + 300
        while not [m for m in ws.of_type("progress", prompt_id) if m["value"] >= 3]:
            assert time.time() < deadline, "no training progress within 300 s"
            time.sleep(0.1)
        comfy_server.post("/interrupt", {})  # (progress messages come every 0.5% of the steps: 400 -> every 2)
        entry = comfy_server.wait(prompt_id, expect="error")
    finally:
        ws.close()
    assert any(kind == "execution_interrupted" for kind, _ in entry["status"]["messages"]), entry["status"]
    assert comfy_server.alive()

    saved = sorted((comfy_server.base / "models" / "loras" / "tightrope").glob("it_interrupt_0*.safetensors"))
    assert saved, "no LoRA was saved before the interrupt"
    tensors, meta = read_lora_file(saved[-1])  # intact: safetensors reads it whole
    assert int(meta["tightrope.steps"]) >= 3 and all(math.isfinite(t.abs().max().item()) for t in tensors.values())

    g = Graph()  # the next prompt runs, and the last LoRA loads through the core loader
    unet = g.add("UNETLoader", unet_name=name, weight_dtype=weight_dtype)
    loader = g.add("LoraLoaderModelOnly", model=[unet, 0], lora_name=f"tightrope/{saved[-1].name}",
                   strength_model=1.0)
    cond = g.add("TightropeDemoConditioning", model=[unet, 0], text="a long run", tokens=8)
    latent = g.add("EmptySD3LatentImage", width=64, height=64, batch_size=1)
    out = g.sample([loader, 0], cond, latent, "it/flux_after_interrupt", steps=1)
    assert torch.isfinite(saved_latent(comfy_server, comfy_server.run(g.nodes), out)).all()


def test_queued_again_after_an_interrupt_the_train_node_goes_on_to_the_uninterrupted_lora(comfy_server, checkpoint):
    """The Train node's `resume` widget (on by default) in a real server: /interrupt mid-run, queue the same prompt
    again, and the node trains only the steps it had left; its final LoRA is bit for bit the one an uninterrupted
    run of the same graph saves (same CPU, fp32 LoRA, every draw a function of (seed, step))."""
    name, weight_dtype = checkpoint("flux")
    steps, saved = 30, {}
    for prefix in ("tightrope/it_resume_whole", "tightrope/it_resume_cut"):
        g = Graph()
        ids = g.train_flux((name, weight_dtype), prefix=prefix, images="it_resume_images", steps=steps,
                           learning_rate=0.01, schedule="cosine")
        if prefix.endswith("cut"):
            client = uuid.uuid4().hex
            ws = WebSocket(comfy_server, client)
            try:
                prompt_id = comfy_server.queue(g.nodes, client)
                deadline = time.time() + 300
                while not [m for m in ws.of_type("progress", prompt_id) if m["node"] == ids["train"]
                           and m["value"] >= 3]:
                    assert time.time() < deadline, "no training progress within 300 s"
                    time.sleep(0.05)
                comfy_server.post("/interrupt", {})
                comfy_server.wait(prompt_id, expect="error")
            finally:
                ws.close()
        entry = comfy_server.run(g.nodes)
        saved[prefix] = read_lora_file(entry["outputs"][ids["save"]]["text"][0])
    log = comfy_server.log()
    went_on = re.findall(r"Train node \S+ goes on from step (\d+) of its run \(steps 0-30\)", log)
    print(f"\ninterrupted at step {went_on[-1] if went_on else None} of {steps}")
    assert went_on and 3 <= int(went_on[-1]) < steps, log[-3000:]
    # the interrupted node said where it stopped (before: the server's progress hook raised first, and it did not)
    assert re.search(rf"Train node {ids['train']} interrupted at step {went_on[-1]}: its LoRA is saved in '.*'; "
                     "queue the workflow again to go on from there", log), log[-3000:]
    (whole, whole_meta), (cut, cut_meta) = saved.values()
    assert whole_meta["tightrope.steps"] == cut_meta["tightrope.steps"] == str(steps)
    assert whole.keys() == cut.keys() and all(torch.equal(cut[k], t) for k, t in whole.items())


def test_optimizer_offload_trains_the_same_lora_in_comfyui(comfy_server, checkpoint):
    """A ComfyUI MODEL (ModelPatcher, node code under inference_mode) with the optimizer on the host: the LoRA its
    run saves is the device optimizer's run's, bit for bit (on the CPU both step with the fused AdamW)."""
    name, weight_dtype = checkpoint("flux")
    saved = {}
    for offloaded in (False, True):
        g = Graph()
        strategy = g.add("TightropeMemoryStrategy", offload_fraction=1.0, checkpoint="all", compute_dtype="fp32",
                         optimizer_offload=offloaded)
        ids = g.train_flux((name, weight_dtype), prefix=f"tightrope/it_optoff_{offloaded}", images="it_optoff_images",
                           steps=3, learning_rate=0.01, strategy=[strategy, 0])
        entry = comfy_server.run(g.nodes)
        saved[offloaded] = read_lora_file(entry["outputs"][ids["save"]]["text"][0])[0]
    assert saved[True].keys() == saved[False].keys()
    change = max(t.abs().max().item() for k, t in saved[False].items() if "lora_B" in k)  # B starts at 0
    assert change > 1e-4
    for k, t in saved[False].items():
        assert torch.equal(saved[True][k], t), k

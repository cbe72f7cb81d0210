"""A real ComfyUI server refuses a bad value in the last nodes of a training chain when the prompt is queued (the nodes'
VALIDATE_INPUTS), before any node runs: NaN passes ComfyUI's own min/max check, a bad Save LoRA prefix has no check
of ComfyUI's at all."""
import json

import pytest
from api_graph import Graph
from tightrope.bench.comfy_server import PromptFailed


def test_a_bad_chain_is_refused_at_queue_time(comfy_server):
    g = Graph()
    model = g.add("TightropeDemoModel", seed=0)
    encoders = g.add("TightropeDemoEncoders", seed=0)
    folder = g.add("TightropeDemoImages", subfolder="it_queue_check", count=4, size=32, seed=0)
    dataset = g.add("TightropeLoadDataset", folder=[folder, 0], vae=[encoders, 0], clip=[encoders, 1], resolution=32)
    lora = g.add("TightropeLoraSetup", rank=4, alpha=4.0)
    first = g.add("TightropeTrain", steps=2, device="cpu", model=[model, 0], dataset=[dataset, 0], lora=[lora, 0])
    second = g.add("TightropeTrain", steps=2, device="cpu", session=[first, 0], learning_rate=float("nan"))
    save = g.add("TightropeSaveLora", session=[second, 0], filename_prefix="../escape")
    with pytest.raises(PromptFailed, match="400") as refused:
        comfy_server.queue(g.nodes)
    body = json.loads(str(refused.value).split(": ", 1)[1])
    errors = body["node_errors"]
    assert set(errors) == {second, save}, errors
    second_says = json.dumps(errors[second])
    assert "input 'learning_rate' is nan, not a finite number: use a value in 1e-07..1.0" in second_says
    assert "filename_prefix='../escape' contains '..'" in json.dumps(errors[save])
    assert not (comfy_server.base / "output" / "it_queue_check").exists()  # nothing ran


def test_a_train_node_with_nothing_to_train_is_refused_at_queue_time(comfy_server):
    """Neither a session nor model, dataset and lora connected: refused when queued (it failed when the node ran,
    after the model had loaded and the dataset was encoded), naming what to connect."""
    g = Graph()
    train = g.add("TightropeTrain", steps=1, device="cpu", model=[g.add("TightropeDemoModel", seed=0), 0])
    g.add("TightropeSaveLora", session=[train, 0])
    with pytest.raises(PromptFailed, match="400") as refused:
        comfy_server.queue(g.nodes)
    errors = json.loads(str(refused.value).split(": ", 1)[1])["node_errors"]
    assert set(errors) == {train}, errors
    assert "the Train node has no dataset, lora input: connect model, dataset and lora (to start) or a session from " \
        "another Train node (to continue)" in json.dumps(errors[train])


def test_the_demo_stand_ins_in_comfyuis_own_nodes_say_they_are_training_only(comfy_server):
    """The demo Flux and encoders travel on MODEL / CLIP wires (so Tightrope's nodes take them like loaded ones) but
    are no ModelPatcher or CLIP: in ComfyUI's own nodes the error names that and the fix, not a bare missing
    attribute from ComfyUI's code. (CLIPTextEncode runs before the KSampler that needs it; ModelSamplingFlux clones
    its model first thing.)"""
    g = Graph()
    text = g.add("CLIPTextEncode", clip=[g.add("TightropeDemoEncoders", seed=0), 1], text="a red circle")
    latent = g.add("EmptyLatentImage", width=64, height=64, batch_size=1)
    g.sample([g.add("TightropeDemoModel", seed=0), 0], text, latent, prefix="it_demo_sampler")
    assert _error(comfy_server, g) == ("CLIPTextEncode", "DemoCaptionEmbedder has no 'tokenize': it is Tightrope's "
                                       "training-only text encoder, not a ComfyUI text encoder, so ComfyUI's own nodes "
                                       "cannot use it; wire it to Tightrope's nodes only, or load real text encoders "
                                       "(DualCLIPLoader) to encode prompts")
    g = Graph()
    patched = g.add("ModelSamplingFlux", model=[g.add("TightropeDemoModel", seed=0), 0], max_shift=1.15,
                    base_shift=0.5, width=64, height=64)
    encoders = g.add("TightropeDemoEncoders", seed=0)
    folder = g.add("TightropeDemoImages", subfolder="it_demo_sampling", count=2, size=32, seed=0)
    dataset = g.add("TightropeLoadDataset", folder=[folder, 0], vae=[encoders, 0], clip=[encoders, 1], resolution=32)
    train = g.add("TightropeTrain", steps=1, model=[patched, 0], dataset=[dataset, 0],
                  lora=[g.add("TightropeLoraSetup", rank=4, alpha=4.0), 0])
    g.add("TightropeSaveLora", session=[train, 0])
    node, message = _error(comfy_server, g)
    assert node == "ModelSamplingFlux" and "ReferenceFluxModel has no 'clone': it is Tightrope's training-only " \
        "model" in message and message.endswith("load a real model (Load Diffusion Model) to sample")


def _error(server, graph: Graph) -> tuple[str, str]:
    entry = server.wait(server.queue(graph.nodes), timeout=300, expect="error")
    (error,) = [m[1] for m in entry["status"]["messages"] if m[0] == "execution_error"]
    assert error["exception_type"] == "AttributeError", error
    return error["node_type"], error["exception_message"].strip()

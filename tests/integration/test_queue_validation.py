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

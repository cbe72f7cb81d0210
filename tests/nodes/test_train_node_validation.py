"""The Train node's validation, loss and log inputs: added last and optional, so saved workflows keep loading; a
second dataset scored every N steps, kept by a continued session, in the report and the run's log."""
import json
from pathlib import Path

import pytest
import torch

from tightrope.headless.input_spec import widget_specs
from tightrope.headless.ui_format import widget_values_by_name
from tightrope.nodes import host
from tightrope.nodes.dataset_nodes import TightropeLoadDataset
from tightrope.nodes.demo_nodes import TightropeDemoEncoders, TightropeDemoImages, TightropeDemoModel
from tightrope.nodes.lora_node import TightropeLoraSetup
from tightrope.nodes.train_node import TightropeTrain

NEW = ["loss", "huber_delta", "validation_fraction", "validation_every", "log_dir", "resume"]
DEMO = Path(__file__).resolve().parents[1] / "workflows" / "data" / "demo_0_1.json"  # demo.json as 0.1 saved it


def test_new_widgets_are_last_and_optional_so_a_saved_workflow_keeps_its_values():
    specs = widget_specs(TightropeTrain)
    assert [s.name for s in specs[-len(NEW):]] == NEW and not any(s.required for s in specs[-len(NEW):])
    node = next(n for n in json.loads(DEMO.read_text())["nodes"] if n["type"] == "TightropeTrain")
    problems = []
    values = widget_values_by_name(node, TightropeTrain, str(node["id"]), problems)
    assert not problems and not set(NEW) & set(values)  # the new widgets take their defaults
    assert values["learning_rate"] == node["widgets_values"][1] and values["on_nonfinite"] == "stop"


@pytest.fixture
def out(tmp_path):
    with host.headless(tmp_path):
        yield tmp_path


def _dataset(name, count, seed):
    (folder,) = TightropeDemoImages().make(name, count, 32, seed)
    vae, clip = TightropeDemoEncoders().load(0)
    return TightropeLoadDataset().load(folder, vae, clip, 32, 0.0, True, False)[0]


def test_train_node_scores_a_second_dataset_and_a_continued_session_keeps_it(out, capsys):
    spec = {k: v[1]["default"] for k, v in TightropeTrain.INPUT_TYPES()["required"].items()}
    widgets = spec | dict(steps=2, batch_size=2, device="cpu", learning_rate=1e-3, filename_prefix="rt/lora")
    lora = TightropeLoraSetup().setup(4, 4.0, False, 0.0, "attention", "default")[0]
    with torch.inference_mode():  # as ComfyUI and the headless runner call nodes
        session, _, report = TightropeTrain().train(
            **widgets, model=TightropeDemoModel().load(0)[0], dataset=_dataset("imgs", 4, 0), lora=lora,
            validation_dataset=_dataset("val", 2, 1), validation_every=1, loss="huber", huber_delta=0.5)
        assert session.config.loss == "huber" and session.config.huber_delta == 0.5
        assert [s for s, _ in session.validation_losses] == [0, 1, 2]
        assert "validation loss: step 0 " in report
        more, _, _ = TightropeTrain().train(**widgets | {"steps": 1}, session=session, validation_every=1,
                                            loss="huber", huber_delta=0.5)
    assert [s for s, _ in more.validation_losses] == [0, 1, 2, 3]  # the session's validation set, step 2 not again
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("tightrope: validation")] == [
        f"tightrope: validation loss at step {s}: {v:.4f}" for s, v in more.validation_losses]

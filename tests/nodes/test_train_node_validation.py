"""The Train node's validation, loss and log inputs: added last and optional, so saved workflows keep loading; a
second dataset scored every N steps, kept by a continued session, in the report and the run's log."""
import json
from pathlib import Path

import pytest
import torch

from tightrope import NODE_CLASS_MAPPINGS
from tightrope.headless.input_spec import widget_specs
from tightrope.headless.validation import validate_graph
from tightrope.headless.workflow_format import load_workflow, to_api_prompt
from tightrope.headless.ui_format import widget_values_by_name
from tightrope.nodes import host
from tightrope.nodes.dataset_nodes import TightropeLoadDataset
from tightrope.nodes.demo_nodes import TightropeDemoEncoders, TightropeDemoImages, TightropeDemoModel
from tightrope.nodes.lora_node import TightropeLoraSetup
from tightrope.nodes.train_node import TightropeTrain
from tightrope.training.train_config import TrainConfig

NEW = ["loss", "huber_delta", "validation_fraction", "validation_every", "log_dir", "resume", "timestep_min",
       "timestep_max"]
DEMO = Path(__file__).resolve().parents[1] / "workflows" / "data" / "demo_0_1.json"  # demo.json as 0.1 saved it


def test_new_widgets_are_last_and_optional_so_a_saved_workflow_keeps_its_values():
    specs = widget_specs(TightropeTrain)
    assert [s.name for s in specs[-len(NEW):]] == NEW and not any(s.required for s in specs[-len(NEW):])
    node = next(n for n in json.loads(DEMO.read_text())["nodes"] if n["type"] == "TightropeTrain")
    problems = []
    values = widget_values_by_name(node, TightropeTrain, str(node["id"]), problems)
    assert not problems and not set(NEW) & set(values)  # the new widgets take their defaults
    assert values["learning_rate"] == node["widgets_values"][1] and values["on_nonfinite"] == "stop"



def test_a_workflow_saved_before_the_timestep_range_trains_every_timestep_and_one_saved_after_reads_it():
    """demo_0_1's Train nodes (saved before the range) load without it: the node then builds TrainConfig without
    timestep_min/max, the full range. A node saved with them (the frontend appends them last) reads them back."""
    data = json.loads(DEMO.read_text())
    for node in (n for n in data["nodes"] if n["type"] == "TightropeTrain"):
        problems = []
        values = widget_values_by_name(node, TightropeTrain, str(node["id"]), problems)
        assert not problems and "timestep_min" not in values and "timestep_max" not in values
        config = {k: v for k, v in values.items() if k in TrainConfig.__dataclass_fields__}
        assert TrainConfig(**config).timestep_range == (0.0, 1.0)
        assert TrainConfig(**config).timestep_shift == node["widgets_values"][10]  # the others keep their places
    graph = validate_graph(load_workflow(DEMO, NODE_CLASS_MAPPINGS), NODE_CLASS_MAPPINGS)  # `tightrope run`: defaults
    trains = [n for n in to_api_prompt(graph).values() if n["class_type"] == "TightropeTrain"]
    assert [(n["inputs"]["timestep_min"], n["inputs"]["timestep_max"]) for n in trains] == [(0.0, 1.0)] * 2
    specs = widget_specs(TightropeTrain)
    node = {"type": "TightropeTrain", "widgets_values": [values.get(s.name, s.default) for s in specs]}
    node["widgets_values"][8:8] = ["fixed"]  # seed's control_after_generate
    node["widgets_values"][-2:] = [0.875, 1.0]
    problems = []
    values = widget_values_by_name(node, TightropeTrain, "7", problems)
    assert not problems and (values["timestep_min"], values["timestep_max"], values["resume"]) == (0.875, 1.0, True)


def test_an_empty_timestep_range_is_refused_before_any_node_runs():
    inputs = {k: v[1].get("default") for k, v in TightropeTrain.INPUT_TYPES()["required"].items()}
    inputs |= {"filename_prefix": None, "device": "cpu", "session": None}
    verdict = TightropeTrain.VALIDATE_INPUTS(**inputs, timestep_min=0.9, timestep_max=0.875)
    assert isinstance(verdict, str) and verdict.startswith("timestep_max=0.875 is not above timestep_min=0.9")
    assert "input 'timestep_max' is 1.5, above its max" in TightropeTrain.VALIDATE_INPUTS(**inputs, timestep_max=1.5)
    assert TightropeTrain.VALIDATE_INPUTS(**inputs, timestep_min=0.875) is True  # max keeps its default, 1
    assert "is not above" in TightropeTrain.VALIDATE_INPUTS(**inputs, timestep_min=1.0)
    tooltips = {n: TightropeTrain.INPUT_TYPES()["optional"][n][1]["tooltip"] for n in ("timestep_min", "timestep_max")}
    assert all("high_noise model 0.875 to 1, its low_noise model 0 to 0.875" in t for t in tooltips.values())


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

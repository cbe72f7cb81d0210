"""`tightrope run --comfyui` on ComfyUI's own V3 (comfy_api) core nodes, checked and run as ComfyUI runs them: the lazy
If/Else switch computes only the branch it takes, Autogrow and DynamicCombo inputs are expanded, a node's own
validate_inputs owns its checks (CustomCombo takes any input; LoadAudio names a missing file), an unfinished side
branch is ignored, a workflow without an output node is refused. In one ComfyUI process (headless_batch.py).
tests/headless/test_comfyui_parity.py checks the same rules with stand-in nodes, without ComfyUI."""
import json

import pytest
from comfy_env import run_headless_batch
from PIL import Image


SWITCH = {"1": {"class_type": "PrimitiveInt", "inputs": {"value": 3}},
          "2": {"class_type": "PrimitiveInt", "inputs": {"value": 4}},
          "3": {"class_type": "ComfySwitchNode", "inputs": {"switch": True, "on_false": ["1", 0], "on_true": ["2", 0]}},
          "4": {"class_type": "PreviewAny", "inputs": {"source": ["3", 0]}}}
DYNAMIC = {
    "1": {"class_type": "StringFormat", "inputs": {"f_string": "{a}+{b}", "values.a": "x", "values.b": "y"}},
    "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 0]}},
    "3": {"class_type": "CustomCombo", "inputs": {"choice": "mine", "option0": "mine"}},
    "4": {"class_type": "PreviewAny", "inputs": {"source": ["3", 0]}},
    "5": {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 32, "batch_size": 1, "color": 0}},
    "6": {"class_type": "ResizeImageMaskNode", "inputs": {"input": ["5", 0], "resize_type": "scale by multiplier",
                                                          "resize_type.multiplier": 2.0, "scale_method": "area"}},
    "7": {"class_type": "SaveImage", "inputs": {"images": ["6", 0], "filename_prefix": "v3/resized"}},
    "8": {"class_type": "KSampler", "inputs": {"steps": -5}},  # an unfinished side branch: not checked, not run
    "9": {"class_type": "GetImageSize", "inputs": {"image": ["6", 0]}},  # reports to PromptServer.instance (none)
    "10": {"class_type": "PreviewAny", "inputs": {"source": ["9", 0]}},
}
BAD_AUDIO = {"1": {"class_type": "LoadAudio", "inputs": {"audio": "nope.wav"}},
             "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 0]}}}
NO_OUTPUT = {"1": {"class_type": "PrimitiveInt", "inputs": {"value": 3}}}
DYNAMIC_UI = {  # ResizeImageMaskNode saved by the frontend: its DynamicCombo's values are not read from this format
    "nodes": [{"id": 1, "type": "EmptyImage", "mode": 0, "inputs": [], "widgets_values": [64, 32, 1, 0],
               "outputs": [{"name": "IMAGE", "type": "IMAGE", "links": [1]}]},
              {"id": 2, "type": "ResizeImageMaskNode", "mode": 0,
               "widgets_values": ["scale by multiplier", 2.0, "area"],
               "inputs": [{"name": "input", "type": "IMAGE", "link": 1}],
               "outputs": [{"name": "IMAGE", "type": "IMAGE", "links": [2]}]},
              {"id": 3, "type": "SaveImage", "mode": 0, "widgets_values": ["v3/ui"],
               "inputs": [{"name": "images", "type": "IMAGE", "link": 2}], "outputs": []}],
    "links": [[1, 1, 0, 2, 0, "IMAGE"], [2, 2, 0, 3, 0, "IMAGE"]], "version": 0.4}
WORKFLOWS = {"switch": SWITCH, "dynamic": DYNAMIC, "bad_audio": BAD_AUDIO, "no_output": NO_OUTPUT,
             "dynamic_ui": DYNAMIC_UI}


@pytest.fixture(scope="module")
def batch(comfyui_python, tmp_path_factory):
    """{name: (exit code, log text)} of `tightrope run` on each of WORKFLOWS, plus "out": the output dir."""
    tmp = tmp_path_factory.mktemp("headless_v3")
    runs = []
    for name, workflow in WORKFLOWS.items():
        (tmp / f"{name}.json").write_text(json.dumps(workflow))
        runs.append({"argv": ["run", str(tmp / f"{name}.json"), "--output-dir", str(tmp / "out")],
                     "log": str(tmp / f"{name}.log"), "ui_from": None})
    result = run_headless_batch(comfyui_python, tmp, runs, WORKFLOWS, timeout=900)
    result["out"] = tmp / "out"
    return result


def _error(batch, name: str, code: int) -> str:
    got, log = batch[name]
    assert got == code and "Traceback" not in log, log[-3000:]
    return next(line for line in log.splitlines() if line.startswith("error: "))


def test_the_lazy_switch_runs_only_the_branch_it_takes(batch):
    code, log = batch["switch"]
    assert code == 0, log[-3000:]
    assert "node 4 'PreviewAny':\n  text: 4\n" in log
    assert "node 1 'PrimitiveInt'" not in log and "[3/3] node 4 'PreviewAny'" in log


def test_dynamic_inputs_and_own_validation_of_v3_nodes(batch):
    code, log = batch["dynamic"]
    assert code == 0, log[-3000:]
    assert "node 2 'PreviewAny':\n  text: x+y\n" in log and "node 4 'PreviewAny':\n  text: mine\n" in log
    assert Image.open(batch["out"] / "v3" / "resized_00001_.png").size == (128, 64)
    assert "node 10 'PreviewAny':\n  text: 128\n" in log  # GetImageSize ran with no server to report to
    assert "KSampler" not in log


def test_v3_validate_inputs_names_the_missing_file(batch):
    assert _error(batch, "bad_audio", 2) == \
        "error: node 1 'LoadAudio' failed its own input check: Invalid audio file: nope.wav"


def test_no_output_node_and_dynamic_ui_node_are_refused_in_one_line(batch):
    assert _error(batch, "no_output", 2) == (  # a Primitive alone does not load ComfyUI: Tightrope's outputs are named
        "error: the workflow has no output node, so nothing in it would run (ComfyUI refuses it too: 'Prompt has no "
        "outputs'): add an output node (TightropePlots, TightropeSaveLora) and link what should run into it")
    assert _error(batch, "dynamic_ui", 2).endswith(
        "node 2 'ResizeImageMaskNode' has V3 dynamic inputs (DynamicCombo), which headless runs read only from "
        "API-format files: in ComfyUI use Workflow > Export (API) and run that file, or run this workflow inside "
        "ComfyUI")

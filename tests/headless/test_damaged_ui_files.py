"""Damaged UI-format files (what the frontend never saves: a hand edit, a truncated copy, another tool's bug) give one
clear error naming the file, the node (or link) and what is wrong, not a KeyError or TypeError from deep in the reader;
`tightrope run` prints it on one line and exits 2."""
import contextlib
import json

import pytest
from headless_ui_builder import constant_add_record

from tightrope import cli
from tightrope.headless.graph import Link, WorkflowError
from tightrope.headless.workflow_format import load_workflow

FIX = "the file is damaged: re-save it from ComfyUI, or fix it by hand"
ADD, RECORD = 1, 2  # positions in constant_add_record()'s nodes of node 2 'Add' and node 3 'Record'


def _set(path, value):
    """A change to the workflow: set data[path...] = value (or delete it, for value DELETE)."""
    def change(workflow):
        *parents, last = path
        target = workflow
        for key in parents:
            target = target[key]
        if value is DELETE:
            del target[last]
        else:
            target[last] = value
    return change


DELETE = object()
DAMAGE = {  # name: (change, what the message says after "<file>: ")
    "node without type": (_set(["nodes", ADD, "type"], DELETE), 'node 2 has no "type" (the node\'s class name)'),
    "type not a name": (_set(["nodes", ADD, "type"], 7), 'node 2 has "type" 7, not a node class name'),
    "node without id": (_set(["nodes", ADD, "id"], DELETE), "nodes[1] ('Add') has no \"id\""),
    "node not an object": (_set(["nodes", 0], "Constant"), "nodes[0] is 'Constant', not an object"),
    "two nodes, one id": (_set(["nodes", RECORD, "id"], 2), "node 2: two nodes have this id"),
    "link missing": (_set(["links", 0], DELETE),
                     "node 2 input 'a' uses link 1, which the workflow's \"links\" lack"),
    "link from a missing node": (_set(["links", 1, 1], 99), "node 3 input 'value' uses link 2, which comes from "
                                                            "node 99, which the workflow lacks"),
    "link cut short": (_set(["links", 1], [2, 2, 0]), "node 3 input 'value' uses link 2, which has only 3 of its 6 "
                                                      "fields [id, from_node, from_slot, to_node, to_slot, type] "
                                                      "([2, 2, 0])"),
    "link without id": (_set(["links", 1], [None, 2, 0, 3, 0, "INT"]),
                        "links[1] has id None, not a link id"),
    "link slot not a number": (_set(["links", 0, 2], "0"),
                               "node 2 input 'a' uses link 1, which has from_slot '0', not a slot number"),
    "link object without origin slot": (_set(["links", 0], {"id": 1, "origin_id": 1, "target_id": 2}),
                                        "node 2 input 'a' uses link 1, which has from_slot None, not a slot number"),
    "links not a list": (_set(["links"], {"1": [1, 1, 0, 2, 0, "INT"]}),
                         "\"links\" is {'1': [1, 1, 0, 2, 0, 'INT']}, not a list"),
    "input not an object": (_set(["nodes", ADD, "inputs", 0], "a"),
                            'node 2 inputs[0] is \'a\', not an input object with a "name"'),
    "linked input without name": (_set(["nodes", RECORD, "inputs", 0, "name"], DELETE),
                                  'node 3 inputs[0] has link 2 but no "name" (the input it feeds)'),
    "widget name not a name": (_set(["nodes", RECORD, "inputs", 0, "widget"], {"name": ["value"]}),
                               'node 3 inputs[0] has "widget" {\'name\': [\'value\']}, not {"name": ...}'),
    "input link not an id": (_set(["nodes", RECORD, "inputs", 0, "link"], [2]),
                             "node 3 input 'value' has link [2], not a link id"),
    "widgets_values a number": (_set(["nodes", ADD, "widgets_values"], 5),
                                'node 2 has "widgets_values" 5, not a list of values'),
    "mode not a number": (_set(["nodes", ADD, "mode"], "bypass"),
                          "node 2 has \"mode\" 'bypass', not a number (0 runs, 2 muted, 4 bypassed)"),
}


def _write(tmp_path, workflow) -> str:
    path = tmp_path / "damaged.json"
    path.write_text(json.dumps(workflow))
    return str(path)


@pytest.mark.parametrize("name", DAMAGE)
def test_damage_is_one_problem_naming_file_node_and_fix(name, tmp_path, mappings):
    change, what = DAMAGE[name]
    workflow = constant_add_record()
    change(workflow)
    path = _write(tmp_path, workflow)
    with pytest.raises(WorkflowError) as caught:
        load_workflow(path, mappings)
    assert caught.value.problems == [f"{path}: {what}: {FIX}"]


def test_short_widgets_values_name_the_file_and_the_node(tmp_path, mappings):
    path = _write(tmp_path, constant_add_record((0, 5, 42)))  # cut after `seed`: its control mode, `mode` missing
    with pytest.raises(WorkflowError) as caught:
        load_workflow(path, mappings)
    assert caught.value.problems == [
        f"{path}: node 2 'Add' has 3 widgets_values but its widgets need 6 (a, b, seed + control mode, mode, bias): "
        f"the workflow was saved with a different version of this node; open it in ComfyUI, check the node's values, "
        f"and save it again"]


def test_a_damaged_link_no_input_uses_is_ignored_like_the_frontend(mappings):
    workflow = constant_add_record()
    workflow["links"] += [[9, 1, 0], {"id": 10, "origin_id": 1}]
    assert load_workflow(workflow, mappings)["3"].inputs == {"value": Link("2", 0), "label": "total"}


@pytest.mark.parametrize("name", ["node without type", "link object without origin slot", "widgets_values a number"])
def test_run_prints_one_line_and_exits_2(name, tmp_path, mappings, monkeypatch, capsys):
    monkeypatch.setattr(cli, "load_node_mappings", lambda library=None: dict(mappings))
    monkeypatch.delenv("COMFYUI_DIR", raising=False)
    monkeypatch.setattr(cli, "headless_host", lambda *args, **kwargs: contextlib.nullcontext())
    change, what = DAMAGE[name]
    workflow = constant_add_record()
    change(workflow)
    path = _write(tmp_path, workflow)
    assert cli.main(["run", path, "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {path}: {what}: {FIX}\n"

import json

import pytest
from headless_ui_builder import constant_add_record, ui_node, ui_workflow

from tightrope.headless.graph import Link, WorkflowError
from tightrope.headless.input_spec import node_input_specs
from tightrope.headless.workflow_format import load_workflow, workflow_format


def _shape(graph):
    return {node_id: (node.class_type, node.inputs) for node_id, node in graph.items()}


def _problems(source, mappings):
    with pytest.raises(WorkflowError) as caught:
        load_workflow(source, mappings)
    return caught.value.problems


# --- both formats -------------------------------------------------------------------------------------------

def test_ui_and_api_versions_of_the_same_graph_load_identically(ui_workflow, api_workflow, mappings):
    assert workflow_format(ui_workflow) == "ui" and workflow_format(api_workflow) == "api"
    assert _shape(load_workflow(ui_workflow, mappings)) == _shape(load_workflow(api_workflow, mappings))


def test_ui_fixture_resolves_frontend_only_nodes(ui_workflow, mappings):
    graph = load_workflow(ui_workflow, mappings)
    assert "4" not in graph and "5" not in graph and "6" not in graph  # MarkdownNote, Reroute, PrimitiveNode
    assert "7" not in graph and "8" not in graph  # muted, bypassed
    assert graph["2"].inputs["a"] == Link("1", 0)  # bypassed Double hands its input through; widget became input
    assert "extra" not in graph["2"].inputs  # fed by a muted node: absent, not an error (it is optional)
    assert graph["3"].inputs == {"value": Link("2", 0), "label": "sum"}  # through the Reroute; the Primitive's value


def test_files_load_from_a_path(tmp_path, api_workflow, mappings):
    path = tmp_path / "w.json"
    path.write_text(json.dumps(api_workflow))
    assert set(load_workflow(str(path), mappings)) == {"1", "2", "3", "9", "10", "11", "12"}


def test_api_body_posted_to_prompt_is_unwrapped(api_workflow, mappings):
    assert _shape(load_workflow({"prompt": api_workflow, "client_id": "x"}, mappings)) == \
        _shape(load_workflow(api_workflow, mappings))


# --- widgets_values ---------------------------------------------------------------------------------------------

def test_control_after_generate_values_are_skipped(mappings):
    graph = load_workflow(constant_add_record((0, 9, 1234, "increment", "sub", 2.5)), mappings)
    assert graph["2"].inputs == {"a": Link("1", 0), "b": 9, "seed": 1234, "mode": "sub", "bias": 2.5}


def test_which_widgets_have_control_values(fake_nodes):
    extras = {name: spec.saved_extras for name, spec in node_input_specs(fake_nodes.Add).items()}
    assert extras == {"a": (), "b": (), "seed": ("control mode",), "mode": (), "bias": (), "extra": ()}

    class Explicit:
        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {"seed": ("INT", {"control_after_generate": False}),
                                 "pick": (["x", "y"], {"control_after_generate": True}),
                                 "scale": ("FLOAT", {"control_after_generate": True})}}
    extras = {name: spec.saved_extras for name, spec in node_input_specs(Explicit).items()}
    assert extras == {"seed": (), "pick": ("control mode", "control filter"), "scale": ("control mode",)}


def test_widgets_values_as_a_dict_and_as_widgets_values_named(mappings):
    named = {"a": 0, "b": 3, "seed": 8, "control_after_generate": "fixed", "mode": "add", "bias": 1.0}
    workflow = constant_add_record()
    workflow["nodes"][1]["widgets_values"] = dict(named)
    assert load_workflow(workflow, mappings)["2"].inputs["b"] == 3
    # a list that doesn't fit the node any more, but names saved beside it (frontend 1.4x): names win
    workflow["nodes"][1]["widgets_values"] = [0, 3]
    workflow["nodes"][1]["widgets_values_named"] = dict(named, b=4)
    assert load_workflow(workflow, mappings)["2"].inputs["b"] == 4


def test_wrong_number_of_widgets_values_names_node_and_layout(mappings):
    problems = _problems(constant_add_record((0, 5, 42, "randomize", "add", 0.5, 9)), mappings)
    assert problems == ["node 2 'Add' has 7 widgets_values but its widgets need 6 (a, b, seed + control mode, "
                        "mode, bias): the workflow was saved with a different version of this node; open it in "
                        "ComfyUI, check the node's values, and save it again"]
    assert "has 2 widgets_values" in _problems(constant_add_record((0, 5)), mappings)[0]  # `seed` is required


def test_list_ending_before_optional_widgets_takes_their_defaults(mappings):
    graph = load_workflow(constant_add_record((0, 5, 42, "randomize", "add")), mappings)  # saved before `bias`
    assert graph["2"].inputs["bias"] == 0.0


def test_shifted_values_are_caught_at_the_control_slot(mappings):
    problems = _problems(constant_add_record((0, 5, 42, "add", "randomize", 0.5)), mappings)
    assert "widgets_values[3] should be the control_after_generate mode of 'seed'" in problems[0]


def test_combo_and_range_violations_are_named_together(mappings):
    with pytest.raises(WorkflowError, match=r"^2 problems in the workflow:\n  - node 2 'Add'") as caught:
        load_workflow(constant_add_record((0, 300, 42, "fixed", "mul", 0.5)), mappings)
    problems = caught.value.problems
    assert any("node 2 'Add' input 'b' is 300, above its max of 255" in p for p in problems)
    assert any("node 2 'Add' input 'mode' is 'mul', not one of its choices" in p and "'add', 'sub'" in p
               for p in problems)


# --- frontend-only nodes, muting, bypassing -----------------------------------------------------------------

def test_primitive_node_value_feeds_the_linked_widget(mappings):
    workflow = constant_add_record()
    workflow["nodes"][1]["inputs"].append({"name": "b", "type": "INT", "widget": {"name": "b"}, "link": 9})
    workflow["nodes"].append(ui_node(9, "PrimitiveNode", [77, "fixed"],
                                     outputs=[("INT", "INT", [9])]))
    workflow["nodes"][-1]["outputs"][0]["widget"] = {"name": "b"}
    workflow["links"].append([9, 9, 0, 2, 1, "INT"])
    assert load_workflow(workflow, mappings)["2"].inputs["b"] == 77


def test_muted_source_of_a_required_socket_is_an_error(mappings):
    problems = _problems(constant_add_record(add_mode=2), mappings)
    assert problems == ["node 3 'Record' needs input 'value', but it comes from node 2 'Add', which is muted: "
                        "reconnect it or re-enable that node"]


def test_muted_source_of_a_widget_input_falls_back_to_the_saved_value(mappings):
    graph = load_workflow(constant_add_record(constant_mode=2), mappings)
    assert graph["2"].inputs["a"] == 0 and "1" not in graph


def test_bypassed_node_without_a_matching_input_disconnects(mappings):
    workflow = constant_add_record(add_mode=4)  # Add's only input is `a` (INT) -> Record gets Constant's INT
    assert load_workflow(workflow, mappings)["3"].inputs["value"] == Link("1", 0)
    workflow["nodes"][1]["inputs"] = []
    assert "bypassed and has no input of type INT" in _problems(workflow, mappings)[0]


def test_subgraph_nodes_are_rejected_with_the_unpack_fix(mappings):
    workflow = ui_workflow([ui_node(5, "0e2a-uuid", [], outputs=[])])
    workflow["definitions"] = {"subgraphs": [{"id": "0e2a-uuid", "name": "Trainer"}]}
    assert "Unpack Subgraph" in _problems(workflow, mappings)[0]


# --- unknown node types -------------------------------------------------------------------------------------

def test_core_node_type_names_the_comfyui_option(mappings):
    workflow = ui_workflow([ui_node(7, "KSampler", [1, "fixed", 20, 8, "euler", "normal", 1.0])])
    assert _problems(workflow, mappings) == [
        "node 7 'KSampler' is a ComfyUI core node, not a Tightrope node: run it with ComfyUI's nodes: pass --comfyui "
        "DIR (or set COMFYUI_DIR) to your ComfyUI folder, in the python ComfyUI runs in; or run this workflow inside "
        "ComfyUI (load it in the UI, or POST it to /prompt)"]
    api = {"7": {"class_type": "KSampler", "inputs": {}}}
    assert _problems(api, mappings)[0].startswith("node 7 'KSampler' is a ComfyUI core node")


def test_other_pack_and_typo_messages(mappings):
    workflow = ui_workflow([ui_node(3, "VHS_LoadVideo", [], properties={"cnr_id": "comfyui-videohelpersuite"})])
    assert _problems(workflow, mappings) == [  # the fix names --custom-node, which loads a pack headless
        "node 3 'VHS_LoadVideo' comes from the 'comfyui-videohelpersuite' node pack: load that pack too, with "
        "--comfyui DIR --custom-node PACK_DIR (its folder under ComfyUI/custom_nodes; repeat it for each pack), or run "
        "this workflow inside ComfyUI (load it in the UI, or POST it to /prompt) with that pack installed"]
    with_core = {**mappings, "KSampler": object}  # --comfyui given: only --custom-node is missing
    assert "load that pack too, with --custom-node PACK_DIR" in _problems(workflow, with_core)[0]
    unknown = _problems({"3": {"class_type": "VHS_LoadVideo", "inputs": {}}}, mappings)[0]
    assert "load it with --comfyui DIR (and --custom-node PACK_DIR for another pack's node)" in unknown
    assert "did you mean 'Record'?" in _problems({"3": {"class_type": "Recrd", "inputs": {}}}, mappings)[0]


def test_a_tightrope_node_this_version_lacks_is_named_as_ours(mappings):
    """Saved by another Tightrope version (cnr_id 'tightrope'): not "from the 'tightrope' pack, not Tightrope"."""
    workflow = ui_workflow([ui_node(4, "Recorder", [], properties={"cnr_id": "tightrope"})])
    assert _problems(workflow, mappings) == [
        "node 4 'Recorder' is a Tightrope node this version of Tightrope does not have (the workflow was saved with "
        "another version; this one has 'Record'): update Tightrope, or replace the node in ComfyUI and save the "
        "workflow again"]


# --- API-format specifics -------------------------------------------------------------------------------------

RECORD_1 = {"class_type": "Record", "inputs": {"value": ["1", 0]}}  # an output node: node 1 runs, so it is checked


def test_api_missing_required_and_unknown_inputs(mappings):
    api = {"1": {"class_type": "Add", "inputs": {"a": 1, "b": 2, "mode": "add", "sed": 3}}, "2": RECORD_1}
    problems = _problems(api, mappings)
    assert "node 1 'Add' has no input 'sed' (did you mean 'seed'?" in problems[0]
    assert "node 1 'Add' is missing required input 'seed' (a INT)" in problems[1]


def test_api_links_are_checked(mappings):
    api = {"1": {"class_type": "MakeModel", "inputs": {"size": 2}},
           "2": {"class_type": "Record", "inputs": {"value": ["1", 0]}},
           "3": {"class_type": "Record", "inputs": {"value": ["9", 0]}},
           "4": {"class_type": "Record", "inputs": {"value": ["1", 3]}},
           "5": {"class_type": "UseModel", "inputs": {"model": 5}},
           "6": {"class_type": "Record", "inputs": {"value": ["5", 0]}}}
    problems = _problems(api, mappings)
    assert "needs a INT but is linked to output 0 of node 1 'MakeModel', which gives FAKE_MODEL" in problems[0]
    assert "linked to node 9, which is not in the workflow" in problems[1]
    assert "output 3 of node 1 'MakeModel', which has 1 output(s)" in problems[2]
    assert "is the literal 5, but a FAKE_MODEL must come from another node" in problems[3]


def test_literals_are_converted_strictly(mappings):
    base = {"a": 1.0, "b": "2", "seed": 3, "mode": "add"}
    graph = load_workflow({"1": {"class_type": "Add", "inputs": base}, "2": RECORD_1}, mappings)
    assert graph["1"].inputs["a"] == 1 and graph["1"].inputs["b"] == 2 and graph["1"].inputs["bias"] == 0.0
    problems = _problems({"1": {"class_type": "Add", "inputs": dict(base, a=1.5)}, "2": RECORD_1}, mappings)
    assert "input 'a' is 1.5; it needs a whole number" in problems[0]


def test_unreadable_files_and_unknown_shapes(tmp_path, mappings):
    assert "does not exist" in _problems(str(tmp_path / "missing.json"), mappings)[0]
    broken = tmp_path / "broken.json"
    broken.write_text('{"1": {')
    assert "is not valid JSON (line 1" in _problems(str(broken), mappings)[0]
    assert "neither a UI-format workflow" in _problems({"hello": 1}, mappings)[0]
    assert "no nodes to run" in _problems(ui_workflow([ui_node(1, "Note", ["hi"])]), mappings)[0]
    api = {"1": {"inputs": {}}, "2": {"class_type": "Constant", "inputs": {"value": 1}}}
    assert _problems(api, mappings)[0].startswith("node 1 has no class_type")


def test_an_api_node_whose_meta_is_not_an_object_loads_without_its_title(api_workflow, mappings):
    """`_meta` is the frontend's (the node's title): a hand-edited file with another value crashed the loader with
    an AttributeError traceback; the graph does not depend on it."""
    import copy
    import dataclasses
    damaged = copy.deepcopy(api_workflow)
    first = next(iter(damaged))
    damaged[first]["_meta"] = "a title"
    loaded, intact = load_workflow(damaged, mappings), load_workflow(api_workflow, mappings)
    assert loaded[first] == dataclasses.replace(intact[first], title=None) and loaded.keys() == intact.keys()

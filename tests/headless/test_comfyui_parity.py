"""Which nodes a headless run checks and runs, and how, as ComfyUI 0.33 decides (execution.py: validate_prompt,
validate_inputs, ExecutionList, check_lazy_status): only the nodes feeding an output node, nothing without one, a lazy
input's source only once its node asks for it, a node's own VALIDATE_INPUTS called the way ComfyUI calls it.
(tests/integration/test_headless_comfyui_v3.py runs ComfyUI's own V3 nodes the same way.)"""
import asyncio

import pytest
from headless_ui_builder import constant_add_record, ui_node

from tightrope.headless.executor import NodeExecutionError, run_workflow
from tightrope.headless.graph import Link, NodeSpec, WorkflowError
from tightrope.headless.workflow_format import load_workflow

SIDE_BRANCH = {  # unfinished: missing inputs, a wrong choice; it feeds no output node
    "20": {"class_type": "Add", "inputs": {"a": 1, "mode": "times"}},
    "21": {"class_type": "Double", "inputs": {}},
    "22": {"class_type": "Explode", "inputs": {"value": ["20", 0]}},
}


def _problems(source, mappings):
    with pytest.raises(WorkflowError) as caught:
        load_workflow(source, mappings)
    return caught.value.problems


# --- only what feeds an output node ---------------------------------------------------------------------------

def test_an_unfinished_side_branch_is_neither_checked_nor_run(api_workflow, mappings, fake_nodes):
    graph = load_workflow({**api_workflow, **SIDE_BRANCH}, mappings)
    assert graph["20"].inputs == {"a": 1, "mode": "times"}  # kept as written: a node asking for PROMPT sees it
    results = run_workflow(graph, mappings)
    assert sorted(results, key=int) == ["1", "2", "3", "10", "11", "12"] and results["3"].ui == {"text": ["sum=12"]}
    assert "Explode" not in [name for name, _ in fake_nodes.EXECUTED]
    # linked into an output node, that part of the branch is checked (node 21 still feeds nothing)
    problems = _problems({**api_workflow, **SIDE_BRANCH, "23": {"class_type": "Record", "inputs": {
        "value": ["22", 0]}}}, mappings)
    assert len(problems) == 3 and problems[0].startswith("node 20 'Add' is missing required input 'b'")
    assert problems[1].startswith("node 20 'Add' is missing required input 'seed'")
    assert problems[2].startswith("node 20 'Add' input 'mode' is 'times', not one of its choices")
    # an unknown node type is refused wherever it is, as ComfyUI refuses it ("not found")
    assert _problems({**api_workflow, "30": {"class_type": "Recrd", "inputs": {}}}, mappings) == [
        "node 30 'Recrd' is not a Tightrope node type: did you mean 'Record'? Fix the type name in the workflow"]


def test_a_ui_side_branch_may_hold_stale_values_and_muted_sources(mappings, fake_nodes):
    workflow = constant_add_record()
    workflow["nodes"] += [ui_node(4, "Add", [1, 2], outputs=[("sum", "INT", [])]),  # saved by an older Add
                          ui_node(5, "Constant", [1], outputs=[("INT", "INT", [3])], mode=2),  # muted
                          ui_node(6, "Double", [], inputs=[("value", "INT", 3, False)])]
    workflow["links"].append([3, 5, 0, 6, 0, "INT"])
    assert run_workflow(load_workflow(workflow, mappings), mappings)["3"].ui == {"text": ["total=12"]}
    workflow["nodes"].append(ui_node(7, "Record", [], inputs=[("value", "INT", 4, False)]))
    workflow["links"].append([4, 4, 0, 7, 0, "INT"])  # now node 4 runs: its stale values are refused
    assert _problems(workflow, mappings)[0].startswith("node 4 'Add' has 2 widgets_values but its widgets need 6")


def test_a_workflow_without_an_output_node_is_refused(mappings, fake_nodes):
    prompt = {"1": {"class_type": "Constant", "inputs": {"value": 2}},
              "2": {"class_type": "Double", "inputs": {"value": ["1", 0]}}}
    assert _problems(prompt, mappings) == [
        "the workflow has no output node, so nothing in it would run (ComfyUI refuses it too: 'Prompt has no "
        "outputs'): add an output node (Record) and link what should run into it"]
    with pytest.raises(WorkflowError, match="^the workflow has no output node"):
        run_workflow({"1": NodeSpec("Constant", {"value": 2})}, mappings)
    assert fake_nodes.EXECUTED == []


# --- lazy inputs ----------------------------------------------------------------------------------------------

class Choose:
    """A V1 lazy If/Else, like ComfyUI's ComfySwitchNode (Soft Switch: either branch may be left unlinked)."""
    RETURN_TYPES, FUNCTION, CATEGORY = ("INT",), "run", "tests"
    asked: list = []

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"switch": ("BOOLEAN", {"default": True})},
                "optional": {"on_false": ("INT", {"forceInput": True, "lazy": True}),
                             "on_true": ("INT", {"forceInput": True, "lazy": True})}}

    def check_lazy_status(self, switch, on_false=None, on_true=None):
        Choose.asked.append((switch, on_false, on_true))
        if switch and on_true is None:
            return ["on_true"]
        if not switch and on_false is None:
            return ["on_false"]
        return []

    def run(self, switch, on_false=None, on_true=None):
        return (on_true if switch else on_false,)


class Unasked(Choose):
    """Lazy inputs but no check_lazy_status: ComfyUI never computes them (the node gets None)."""
    check_lazy_status = None

    def run(self, switch, on_false=None, on_true=None):
        return (-1 if on_true is None else on_true,)


def _switch_graph(switch: bool, kind: str = "Choose") -> dict:
    """Constant 3 -> Double -> on_true; Constant 3 -> Explode (raises if run) -> on_false; -> Record."""
    return {"1": NodeSpec("Constant", {"value": 3}), "2": NodeSpec("Double", {"value": Link("1", 0)}),
            "3": NodeSpec(kind, {"switch": switch, "on_true": Link("2", 0), "on_false": Link("4", 0)}),
            "4": NodeSpec("Explode", {"value": Link("1", 0)}), "5": NodeSpec("Record", {"value": Link("3", 0)})}


def test_only_the_lazy_branch_the_node_asks_for_runs(mappings, fake_nodes):
    nodes = dict(mappings, Choose=Choose, Unasked=Unasked)
    Choose.asked.clear()
    seen = []
    results = run_workflow(_switch_graph(True), nodes, on_node=lambda *event: seen.append(event))
    assert results["5"].ui == {"text": ["value=6"]} and "4" not in results  # Explode never ran
    assert Choose.asked == [(True, None, None), (True, None, 6)]  # asked again once on_true is there, as ComfyUI
    assert seen == [("1", "Constant", 1, 4), ("2", "Double", 2, 4), ("3", "Choose", 3, 4), ("5", "Record", 4, 4)]
    with pytest.raises(NodeExecutionError, match="^node 4 'Explode' failed: RuntimeError: boom$"):
        run_workflow(_switch_graph(False), nodes)  # the other branch is computed when chosen
    fake_nodes.EXECUTED.clear()
    assert run_workflow(_switch_graph(True, "Unasked"), nodes)["3"] == (-1,)
    assert fake_nodes.EXECUTED == [("Record", {"value": -1, "label": "value", "unique_id": "5"})]


def test_asking_for_an_unlinked_lazy_input_is_a_node_error(mappings, fake_nodes):
    graph = _switch_graph(True)
    del graph["3"].inputs["on_true"]
    with pytest.raises(NodeExecutionError, match=r"^node 3 'Choose' asks for input 'on_true' \(check_lazy_status\), "
                                                 r"which is not linked: link it in the workflow$"):
        run_workflow(graph, dict(mappings, Choose=Choose))


# --- the node's own VALIDATE_INPUTS -----------------------------------------------------------------------------

class SizeOf:
    """Takes an INT or a FAKE_MODEL: with `input_types` its VALIDATE_INPUTS checks the linked type, not ComfyUI."""
    RETURN_TYPES, FUNCTION, OUTPUT_NODE, CATEGORY = ("INT",), "run", True, "tests"
    seen: list = []

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": ("INT", {"forceInput": True})}, "hidden": {"unique_id": "UNIQUE_ID"}}

    @classmethod
    def VALIDATE_INPUTS(cls, input_types, value, unique_id):
        cls.seen.append((input_types, value, unique_id))
        return True if input_types["value"] in ("INT", "FAKE_MODEL") else f"cannot size a {input_types['value']}"

    def run(self, value, unique_id):
        return (value if isinstance(value, int) else value["size"],)


class Words:
    RETURN_TYPES, FUNCTION, CATEGORY = ("STRING",), "run", "tests"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {}}

    def run(self):
        return ("hi",)


class Below5:
    RETURN_TYPES, FUNCTION, OUTPUT_NODE, CATEGORY = ("INT",), "run", True, "tests"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"n": ("INT", {"min": 0, "max": 10})}}

    @classmethod
    async def VALIDATE_INPUTS(cls, n):
        await asyncio.sleep(0)
        if n == 9:
            raise KeyError("nine")
        return True if n < 5 else "n must be below 5"

    def run(self, n):
        return (n,)


def test_validate_inputs_with_input_types_owns_the_link_type_check(mappings, fake_nodes):
    nodes = dict(mappings, SizeOf=SizeOf)
    SizeOf.seen.clear()
    graph = {"1": NodeSpec("MakeModel", {"size": 6}), "2": NodeSpec("SizeOf", {"value": Link("1", 0)})}
    assert run_workflow(graph, nodes)["2"] == (6,)
    assert SizeOf.seen == [({"value": "FAKE_MODEL"}, None, "2")]  # linked value None, hidden UNIQUE_ID given
    graph["1"] = NodeSpec("Words")
    nodes["Words"] = Words
    with pytest.raises(WorkflowError, match="^node 2 'SizeOf' failed its own input check: cannot size a STRING$"):
        run_workflow(graph, nodes)


def test_async_and_raising_validate_inputs(mappings):
    nodes = dict(mappings, Below5=Below5)
    assert run_workflow({"1": NodeSpec("Below5", {"n": 3})}, nodes)["1"] == (3,)
    assert _problems({"1": {"class_type": "Below5", "inputs": {"n": 7}}}, nodes) == [
        "node 1 'Below5' failed its own input check: n must be below 5"]
    assert _problems({"1": {"class_type": "Below5", "inputs": {"n": 9}}}, nodes) == [
        "node 1 'Below5' failed its own input check: it raised KeyError: 'nine'; check the node's inputs (if they "
        "are right, this is a bug in the node)"]


# --- V3 dynamic inputs in a UI-format file --------------------------------------------------------------------

class Grows:
    """Declares a V3 Autogrow input, as ComfyUI's BatchImagesNode does (its INPUT_TYPES, as comfy_api writes it)."""
    RETURN_TYPES, FUNCTION, CATEGORY = ("INT",), "run", "tests"

    @classmethod
    def INPUT_TYPES(cls):
        template = {"input": {"required": {"value": ("INT", {"forceInput": True})}}, "prefix": "value", "min": 1}
        return {"required": {"scale": ("INT", {"default": 1}), "values": ("COMFY_AUTOGROW_V3", {"template": template})}}


def test_a_ui_node_with_v3_dynamic_inputs_is_refused_naming_the_api_export(mappings):
    workflow = constant_add_record()
    workflow["nodes"].append(ui_node(8, "Grows", [2], inputs=[("values.value0", "INT", 5, False)],
                                     outputs=[("INT", "INT", [6])]))
    workflow["nodes"].append(ui_node(9, "Record", ["g"], inputs=[("value", "INT", 6, False)]))
    workflow["links"] += [[5, 1, 0, 8, 0, "INT"], [6, 8, 0, 9, 0, "INT"]]
    assert _problems(workflow, dict(mappings, Grows=Grows)) == [
        "node 8 'Grows' has V3 dynamic inputs (Autogrow), which headless runs read only from API-format files: in "
        "ComfyUI use Workflow > Export (API) and run that file, or run this workflow inside ComfyUI"]

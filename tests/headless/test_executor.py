import asyncio

import pytest
import torch
from headless_ui_builder import ui_node, ui_workflow

from tightrope.headless.comfyui_library import with_core_primitives
from tightrope.headless.executor import NodeExecutionError, run_workflow
from tightrope.headless.graph import Link, NodeSpec, WorkflowError
from tightrope.headless.workflow_format import load_workflow


def _ran(fake_nodes):
    return [name for name, _ in fake_nodes.EXECUTED]


def test_ui_and_api_formats_run_identically(ui_workflow, api_workflow, mappings, fake_nodes):
    runs = []
    for workflow in (ui_workflow, api_workflow):
        fake_nodes.EXECUTED.clear()
        results = run_workflow(load_workflow(workflow, mappings), mappings)
        runs.append(({node_id: (tuple(out), out.ui) for node_id, out in results.items()}, list(fake_nodes.EXECUTED)))
    assert runs[0] == runs[1]
    outputs, executed = runs[0]
    assert outputs["3"] == ((), {"text": ["sum=12"]})  # a=7 (bypassed Double), b=5, bias 0.5, truncated
    assert outputs["12"] == ((), {"text": ["size=4"]})
    assert ("Add", {"a": 7, "b": 5, "seed": 42, "mode": "add", "bias": 0.5, "extra": 0}) in executed


def test_only_nodes_leading_to_an_output_node_run(api_workflow, mappings, fake_nodes):
    results = run_workflow(load_workflow(api_workflow, mappings), mappings)
    assert "9" not in results  # the leftover Constant feeds nothing
    assert sorted(_ran(fake_nodes)) == sorted(["Constant", "Add", "Record", "MakeModel", "UseModel", "Record"])


def test_nodes_run_in_dependency_order_ties_by_id(mappings, fake_nodes):
    graph = {"10": NodeSpec("Add", {"a": Link("2", 0), "b": 1, "seed": 0, "mode": "add", "extra": Link("3", 0)}),
             "2": NodeSpec("Constant", {"value": 4}),
             "3": NodeSpec("Constant", {"value": 5}),
             "11": NodeSpec("Record", {"value": Link("10", 0)})}
    seen = []
    results = run_workflow(graph, mappings, on_node=lambda *event: seen.append(event))
    assert seen == [("2", "Constant", 1, 4), ("3", "Constant", 2, 4), ("10", "Add", 3, 4), ("11", "Record", 4, 4)]
    assert results["10"] == (10,)


def test_optional_inputs_omitted_or_defaulted(mappings, fake_nodes):
    graph = {"1": NodeSpec("Constant", {"value": 2}),
             "2": NodeSpec("Add", {"a": Link("1", 0), "b": 1, "seed": 0, "mode": "sub"}),
             "3": NodeSpec("Record", {"value": Link("2", 0)})}
    run_workflow(graph, mappings)
    add_call = dict(fake_nodes.EXECUTED)["Add"]
    assert add_call["bias"] == 0.0  # optional widget absent from the prompt: its default is passed
    assert add_call["extra"] == 0  # optional socket not linked: not passed (the function's own default)
    record_call = fake_nodes.EXECUTED[-1][1]
    assert record_call == {"value": 1, "label": "value", "unique_id": "3"}  # hidden UNIQUE_ID supplied


def test_cycle_is_reported_with_its_path(mappings, fake_nodes):
    graph = {"1": NodeSpec("Double", {"value": Link("2", 0)}),
             "2": NodeSpec("Double", {"value": Link("1", 0)}),
             "3": NodeSpec("Record", {"value": Link("2", 0)})}
    with pytest.raises(WorkflowError, match=r"dependency cycle: node \d 'Double' -> node \d 'Double' -> node \d"):
        run_workflow(graph, mappings)
    assert fake_nodes.EXECUTED == []


def test_everything_is_validated_before_anything_runs(mappings, fake_nodes):
    graph = {"1": NodeSpec("Constant", {"value": 2}),
             "2": NodeSpec("Record", {"value": Link("1", 0)}),
             "3": NodeSpec("Add", {"a": 1, "b": 1, "seed": 0, "mode": "times"}),
             "4": NodeSpec("Record", {"value": Link("3", 0)})}
    with pytest.raises(WorkflowError, match="node 3 'Add' input 'mode' is 'times'"):
        run_workflow(graph, mappings)
    assert fake_nodes.EXECUTED == []


def test_node_failure_names_the_node_and_keeps_the_cause(mappings, fake_nodes):
    graph = {"1": NodeSpec("Constant", {"value": 2}), "2": NodeSpec("Explode", {"value": Link("1", 0)}),
             "3": NodeSpec("Record", {"value": Link("2", 0)})}
    with pytest.raises(NodeExecutionError, match="node 2 'Explode' failed: RuntimeError: boom") as caught:
        run_workflow(graph, mappings)
    assert isinstance(caught.value.__cause__, RuntimeError) and caught.value.node_id == "2"


def test_nodes_run_under_inference_mode_like_comfyui(mappings):
    class Probe:
        RETURN_TYPES, FUNCTION, OUTPUT_NODE = ("BOOLEAN",), "run", True

        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {}}

        def run(self):
            return (torch.is_inference_mode_enabled(),)
    nodes = dict(mappings, Probe=Probe)
    assert run_workflow({"1": NodeSpec("Probe")}, nodes)["1"] == (True,)
    assert run_workflow({"1": NodeSpec("Probe")}, nodes, inference_mode=False)["1"] == (False,)


def test_node_validator_async_function_and_bad_returns(mappings):
    class Even:
        RETURN_TYPES, FUNCTION, OUTPUT_NODE = ("INT",), "run", True

        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {"n": ("INT", {"min": 0, "max": 10})}}

        @classmethod
        def VALIDATE_INPUTS(cls, n):
            return True if n % 2 == 0 else f"{n} is odd"

        async def run(self, n):
            await asyncio.sleep(0)
            return {"result": (n,), "ui": {"text": [str(n)]}}
    nodes = dict(mappings, Even=Even)
    assert run_workflow({"1": NodeSpec("Even", {"n": 20})}, nodes)["1"].ui == {"text": ["20"]}  # validator owns range
    with pytest.raises(WorkflowError, match="node 1 'Even' failed its own input check: 3 is odd"):
        run_workflow({"1": NodeSpec("Even", {"n": 3})}, nodes)

    class Bare(Even):
        VALIDATE_INPUTS = None

        def run(self, n):
            return n
    with pytest.raises(NodeExecutionError, match="returned a 'int' value, not a tuple of outputs"):
        run_workflow({"1": NodeSpec("Bare", {"n": 2})}, dict(mappings, Bare=Bare))


def test_core_primitive_nodes_work_headless(mappings, fake_nodes):
    workflow = ui_workflow([
        ui_node(1, "PrimitiveInt", [41, "fixed"], outputs=[("INT", "INT", [1])]),
        ui_node(2, "Record", ["n"], inputs=[("value", "INT", 1, False)]),
    ], [(1, 1, 0, 2, 0, "INT")])
    nodes = with_core_primitives(mappings)
    assert run_workflow(load_workflow(workflow, nodes), nodes)["2"].ui == {"text": ["n=41"]}


def test_call_node_runs_every_node_and_its_errors_are_named(mappings, fake_nodes):
    """`call_node` (what `--comfyui` swaps in: ComfyUI's own calling helpers) runs each node; what it raises is
    reported against the node, a WorkflowError by its message alone (a ComfyUI node's failure, CoreNodeFailed)."""
    graph = {"1": NodeSpec("Constant", {"value": 2}), "2": NodeSpec("Record", {"value": Link("1", 0)})}
    calls = []

    def call_node(node_id, node, node_class, results, context):
        calls.append((node_id, node.class_type, dict(results)))
        return (40 + len(calls),) if node.class_type == "Constant" else {"ui": {"text": ["seen"]}, "result": ()}

    results = run_workflow(graph, mappings, call_node=call_node)
    assert [c[:2] for c in calls] == [("1", "Constant"), ("2", "Record")] and tuple(calls[1][2]["1"]) == (41,)
    assert results["2"].ui == {"text": ["seen"]} and fake_nodes.EXECUTED == []

    def failing(node_id, node, node_class, results, context):
        raise WorkflowError("SafetensorError: invalid header")

    with pytest.raises(NodeExecutionError, match=r"^node 1 'Constant' failed: SafetensorError: invalid header$"):
        run_workflow(graph, mappings, call_node=failing)

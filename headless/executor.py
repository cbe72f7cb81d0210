"""Running a graph through the node classes, the way ComfyUI's executor calls them, and the short report
`tightrope run` prints at the end (what each output node showed or wrote).

Each node class is instantiated (once per run) and its FUNCTION called with its literal and linked inputs (plus any
hidden inputs it declares); it returns a tuple of outputs or {"ui": ..., "result": tuple}. The graph is validated
first, so a typo fails before an hour of training. As in ComfyUI, only nodes that feed an output node run, and a node
with lazy inputs (`{"lazy": True}`, an If/Else switch) is first asked which of them it needs (check_lazy_status, called
with the inputs computed so far, None for the others, until it asks for none it lacks): only those sources run. A
node without check_lazy_status gets None for its lazy inputs, as in ComfyUI.
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
from typing import Callable

from ..training.held_stops import raise_swallowed
from .graph import (ExecutionList, Graph, Link, NodeSpec, WorkflowError, describe_node, needed_node_ids,
                    output_node_ids, raise_on_cycle)
from .input_spec import hidden_inputs, live_input_specs
from .validation import validate_graph
from .workflow_format import to_api_prompt


# on_node(node_id, class_type, position, total) is called just before each node runs (position from 1).
OnNode = Callable[[str, str, int, int], None]
# call_node(node_id, node, node_class, results, context) runs one node and returns what its FUNCTION returned (a
# tuple, or {"ui": ..., "result": tuple}); links in node.inputs point into `results`, which holds the outputs of the
# sources the node receives now (a lazy input's source not asked for is absent: the input is None). The default calls
# FUNCTION directly; with ComfyUI loaded (`--comfyui`), comfyui_library.ComfyUILibrary.call_node uses ComfyUI's own
# helpers. `context["objects"]` keeps each node's instance for the run.
CallNode = Callable[[str, NodeSpec, type, dict, dict], object]
# lazy_status(node_id, node, node_class, results, context) -> the names of lazy inputs the node asks for that it has
# not received: the default calls check_lazy_status directly; ComfyUILibrary.lazy_status through ComfyUI's helpers.
LazyStatus = Callable[[str, NodeSpec, type, dict, dict], list]


class NodeOutputs(tuple):
    """A node's outputs (index them like the tuple FUNCTION returned), plus the `ui` dict it returned."""

    def __new__(cls, values=(), ui: dict | None = None):
        outputs = super().__new__(cls, values)
        outputs.ui = ui or {}
        return outputs


class NodeExecutionError(RuntimeError):
    """A node failed while running; the original exception is `__cause__`."""

    def __init__(self, node_id: str, class_type: str, message: str):
        self.node_id, self.class_type = node_id, class_type
        super().__init__(f"{describe_node(node_id, class_type)} {message}")


def run_workflow(graph: Graph, node_mappings: dict, *, on_node: OnNode | None = None,
                 extra_pnginfo: dict | None = None, inference_mode: bool = True,
                 call_node: CallNode | None = None, lazy_status: LazyStatus | None = None) -> dict[str, NodeOutputs]:
    """Validate `graph`, then run the nodes that lead to an output node; returns {node_id: NodeOutputs}.

    `extra_pnginfo` is what nodes declaring the hidden EXTRA_PNGINFO input receive (ComfyUI passes
    {"workflow": <UI-format workflow>}). `inference_mode` runs the nodes under torch.inference_mode() as
    ComfyUI does, so a node that trains here also trains there (it must open inference_mode(False) itself).
    `call_node` runs one node (default: its FUNCTION, called directly; see CallNode); `lazy_status` asks a node with
    lazy inputs which it needs (default: its check_lazy_status, called directly; see LazyStatus).
    Raises WorkflowError before running anything if the graph is wrong.
    """
    graph = validate_graph(graph, node_mappings)
    needed = needed_node_ids(graph, node_mappings)
    raise_on_cycle(graph, needed)
    plan = ExecutionList(graph, output_node_ids(graph, node_mappings), _lazy_inputs(graph, needed, node_mappings))
    context = {"PROMPT": to_api_prompt(graph), "EXTRA_PNGINFO": extra_pnginfo, "objects": {}}
    results: dict[str, NodeOutputs] = {}
    call_node, lazy_status = call_node or call_function, lazy_status or call_lazy_status
    with _comfyui_grad_mode() if inference_mode else contextlib.nullcontext():
        while (node_id := plan.next_node()) is not None:
            raise_swallowed()  # a Ctrl-C or SIGTERM that a finalizer swallowed stops before the next node
            node, node_class = graph[node_id], node_mappings[graph[node_id].class_type]
            received = {source: results[source] for source in plan.sources(node_id)}
            if _lazy_sources_wanted(node_id, node, node_class, received, context, lazy_status, plan):
                continue  # it runs once the sources it asked for have run
            if on_node is not None:
                on_node(node_id, node.class_type, len(plan.done) + 1, plan.total)
            results[node_id] = _run_node(node_id, node, node_class, received, context, call_node)
            plan.finish(node_id)
    return results


def _lazy_inputs(graph: Graph, needed: set[str], node_mappings: dict) -> dict[str, set[str]]:
    """{node id: its linked inputs declared lazy}, for the nodes that have any."""
    lazy = {}
    for node_id in needed:
        node = graph[node_id]
        node_class = node_mappings[node.class_type]
        if not any(isinstance(value, Link) for value in node.inputs.values()):
            continue
        names = {name for name, spec in live_input_specs(node_class, node.inputs).items()
                 if spec.options.get("lazy") and isinstance(node.inputs.get(name), Link)}
        if names:
            lazy[node_id] = names
    return lazy


def _lazy_sources_wanted(node_id: str, node: NodeSpec, node_class, received: dict, context: dict,
                         lazy_status: LazyStatus, plan: ExecutionList) -> bool:
    """Ask a node with lazy inputs not yet received which it needs; schedule their sources; True if it asked."""
    if not any(isinstance(value, Link) and value.from_id not in received for value in node.inputs.values()):
        return False
    try:
        wanted = lazy_status(node_id, node, node_class, received, context)
    except Exception as exc:
        raise NodeExecutionError(node_id, node.class_type, f"failed in check_lazy_status: {type(exc).__name__}: "
                                                           f"{exc}") from exc
    for name in wanted:
        if not isinstance(node.inputs.get(name), Link):  # ComfyUI: NodeInputError
            raise NodeExecutionError(node_id, node.class_type, f"asks for input '{name}' (check_lazy_status), which "
                                                               f"is not linked: link it in the workflow")
    plan.require(node_id, wanted)
    return bool(wanted)


def _run_node(node_id: str, node: NodeSpec, node_class, results: dict, context: dict,
              call_node: CallNode) -> NodeOutputs:
    try:
        returned = call_node(node_id, node, node_class, results, context)
    except NodeExecutionError:
        raise
    except Exception as exc:
        detail = str(exc) if isinstance(exc, WorkflowError) else f"{type(exc).__name__}: {exc}"
        raise NodeExecutionError(node_id, node.class_type, f"failed: {detail}") from exc
    return _as_outputs(node_id, node.class_type, returned)


def call_function(node_id: str, node: NodeSpec, node_class, results: dict, context: dict):
    """The default CallNode: the node's FUNCTION with its literal and linked inputs plus its hidden inputs."""
    function_name = getattr(node_class, "FUNCTION", None)
    if not function_name or not callable(getattr(node_class, function_name, None)):
        raise NodeExecutionError(node_id, node.class_type,
                                 f"has no callable FUNCTION ({function_name!r}): a bug in the node class")
    returned = getattr(node_object(node_id, node_class, context), function_name)(
        **_arguments(node_id, node, node_class, results, context))
    return asyncio.run(_awaited(returned)) if inspect.isawaitable(returned) else returned


def call_lazy_status(node_id: str, node: NodeSpec, node_class, results: dict, context: dict) -> list:
    """The default LazyStatus: the node's check_lazy_status (none: nothing asked) with the arguments FUNCTION gets,
    None for the inputs not received; of the names it returns, those of linked inputs not received."""
    check = getattr(node_object(node_id, node_class, context), "check_lazy_status", None)
    if check is None:
        return []
    arguments = _arguments(node_id, node, node_class, results, context)
    returned = check(**arguments)
    returned = asyncio.run(_awaited(returned)) if inspect.isawaitable(returned) else returned
    names = set(returned) if isinstance(returned, list) else set()  # ComfyUI counts only a list
    return sorted(name for name in names if isinstance(name, str) and (
        name not in arguments or (isinstance(node.inputs[name], Link) and node.inputs[name].from_id not in results)))


def node_object(node_id: str, node_class, context: dict):
    """The node's instance for this run: ComfyUI makes one per node and calls check_lazy_status and FUNCTION on it."""
    objects = context.setdefault("objects", {})
    if node_id not in objects:
        objects[node_id] = node_class()
    return objects[node_id]


def _arguments(node_id: str, node: NodeSpec, node_class, results: dict, context: dict) -> dict:
    arguments = {name: _input_value(node_id, node, name, value, results) for name, value in node.inputs.items()}
    for name, kind in hidden_inputs(node_class).items():
        arguments[name] = node_id if kind == "UNIQUE_ID" else context.get(kind)
    return arguments


def _input_value(node_id: str, node: NodeSpec, name: str, value, results: dict):
    if not isinstance(value, Link):
        return value
    if value.from_id not in results:
        return None  # a lazy input not asked for (ComfyUI passes None too)
    produced = results[value.from_id]
    if value.output_index >= len(produced):
        raise NodeExecutionError(node_id, node.class_type,
                                 f"input '{name}' needs output {value.output_index} of node {value.from_id}, "
                                 f"which returned only {len(produced)} value(s): a bug in that node's FUNCTION")
    return produced[value.output_index]


def _as_outputs(node_id: str, class_type: str, returned) -> NodeOutputs:
    ui = None
    if isinstance(returned, dict):
        if "expand" in returned:
            raise NodeExecutionError(node_id, class_type, "returned a graph expansion ('expand'), which headless "
                                                          "runs don't support: run this workflow inside ComfyUI")
        ui, returned = returned.get("ui"), returned.get("result", ())
    if returned is None:
        returned = ()
    if not isinstance(returned, (tuple, list)):
        raise NodeExecutionError(node_id, class_type, f"returned a {type(returned).__name__!r} value, not a "
                                                      f"tuple of outputs: a bug in the node (return `(value,)`)")
    return NodeOutputs(returned, ui)


async def _awaited(awaitable):
    return await awaitable


def _comfyui_grad_mode():
    """ComfyUI runs every node under torch.inference_mode(); so do we, so a node that works here works there
    (training nodes must open `torch.inference_mode(False)` themselves in both)."""
    try:
        import torch
    except ImportError:
        return contextlib.nullcontext()
    return torch.inference_mode()


_MAX_TEXT = 300  # a loss curve dump or a long prompt should not flood the terminal


def summary_lines(results: dict[str, NodeOutputs], graph: Graph, node_mappings: dict, output_dir: str) -> list[str]:
    """One heading per output node, then its items."""
    reported = [node_id for node_id in results
                if getattr(node_mappings[graph[node_id].class_type], "OUTPUT_NODE", False) is True]
    lines = []
    for node_id in reported:
        node = graph[node_id]
        title = f" ({node.title})" if node.title and node.title != node.class_type else ""
        items = [line for key, values in results[node_id].ui.items() for line in _item_lines(key, values, output_dir)]
        lines.append(f"{describe_node(node_id, node.class_type)}{title}:" + ("" if items else " done"))
        lines.extend(f"  {item}" for item in items)
    return lines


def _item_lines(key: str, values, output_dir: str) -> list[str]:
    values = values if isinstance(values, (list, tuple)) else [values]
    return [f"{key}: {_describe(value, output_dir)}" for value in values]


def _describe(value, output_dir: str) -> str:
    if isinstance(value, dict) and "filename" in value:  # ComfyUI's file result: {filename, subfolder, type}
        relative = os.path.join(value.get("subfolder") or "", value["filename"])
        return os.path.join(output_dir, relative) if value.get("type", "output") == "output" else relative
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= _MAX_TEXT else text[:_MAX_TEXT] + f"... ({len(text)} characters)"

"""Loading a workflow file in either of ComfyUI's formats into one normalised, validated graph.

- UI format: what the frontend saves (Workflow > Save / Export) and loads by drag-and-drop (ui_format.py).
- API format: what "Export (API)" writes and the /prompt endpoint takes (read here):

    {"3": {"class_type": "KSampler", "inputs": {"seed": 5, "model": ["4", 0]}, "_meta": {"title": ...}}}

  An input that is a two-item list `[node_id, output_index]` is a link; a list *value* travels wrapped as
  `{"__value__": [...]}` (the frontend wraps it so it can't be mistaken for a link).
"""
from __future__ import annotations

import json
import os

from .graph import Graph, Link, NodeSpec, WorkflowError, sorted_node_ids
from .ui_format import looks_like_ui_workflow, parse_ui_workflow
from .validation import validate_graph


UI_FORMAT, API_FORMAT = "ui", "api"


def load_workflow(source, node_mappings: dict, *, path: str | None = None) -> Graph:
    """`source` is a path or already-parsed JSON (read from `path`, which messages about a damaged file then name);
    returns {node_id: NodeSpec}; raises WorkflowError."""
    if isinstance(source, (str, os.PathLike)):
        source, path = read_workflow_json(source), os.fspath(source)
    graph = parse_workflow(source, node_mappings, path=path)
    if not graph:
        raise WorkflowError("the workflow has no nodes to run (all muted, bypassed or notes): "
                            "enable at least one node")
    return validate_graph(graph, node_mappings)


def parse_workflow(data, node_mappings: dict, *, path: str | None = None) -> Graph:
    """The graph as written (not yet checked against the node classes' inputs); `path` as for load_workflow."""
    kind = workflow_format(data)
    return parse_ui_workflow(data, node_mappings, path) if kind == UI_FORMAT else parse_api_prompt(data)


def workflow_format(data) -> str:
    if looks_like_ui_workflow(data):
        return UI_FORMAT
    if looks_like_api_prompt(data) or (isinstance(data, dict) and looks_like_api_prompt(data.get("prompt"))):
        return API_FORMAT
    raise WorkflowError('this JSON is neither a UI-format workflow (an object with "nodes" and "links") nor an '
                        'API-format prompt ({"<id>": {"class_type": ..., "inputs": {...}}}): save the workflow '
                        'from ComfyUI with Workflow > Save, or Workflow > Export (API)')


def read_workflow_json(path) -> dict:
    path = os.fspath(path)
    try:
        # utf-8-sig: a file an editor saved with a UTF-8 byte order mark (Windows Notepad) loads, as in ComfyUI
        with open(path, encoding="utf-8-sig") as handle:
            return json.load(handle)
    except FileNotFoundError:
        raise WorkflowError(f"workflow file {path!r} does not exist: check the path") from None
    except IsADirectoryError:
        raise WorkflowError(f"{path!r} is a folder: pass the workflow's .json file") from None
    except UnicodeDecodeError as exc:
        # an image (with an embedded workflow?)
        if exc.object[:8].startswith((b"\x89PNG", b"\xff\xd8", b"RIFF", b"GIF8")):
            raise WorkflowError(f"{path!r} is not a text file: pass the workflow's .json file (a PNG with an "
                                f"embedded workflow must be loaded in ComfyUI and saved as JSON)") from None
        raise WorkflowError(f"{path!r} is not UTF-8 text (bad byte at offset {exc.start}): re-save it with UTF-8 "
                            f"encoding, or save it again from ComfyUI") from None
    except json.JSONDecodeError as exc:
        raise WorkflowError(f"{path!r} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}): "
                            f"fix the file or save it again from ComfyUI") from None
    except RecursionError:  # brackets nested thousands deep: no workflow has that
        raise WorkflowError(f"{path!r} is not a workflow: its JSON is nested too deeply to read; save the workflow "
                            f"again from ComfyUI") from None


def looks_like_api_prompt(data) -> bool:
    """Every value a node object, at least one with a class_type (the others get a message of their own)."""
    return isinstance(data, dict) and bool(data) and all(isinstance(node, dict) for node in data.values()) \
        and any("class_type" in node for node in data.values())


def parse_api_prompt(data: dict) -> Graph:
    if looks_like_api_prompt(data.get("prompt")):
        data = data["prompt"]  # the body POSTed to /prompt: {"prompt": {...}, "client_id": ...}
    problems: list[str] = []
    graph: Graph = {}
    for node_id in sorted_node_ids(data):
        node = data[node_id]
        node_id = str(node_id)
        if not isinstance(node, dict) or not isinstance(node.get("class_type"), str):
            problems.append(f"node {node_id} has no class_type: every API-format node needs "
                            f'{{"class_type": "<node type>", "inputs": {{...}}}}')
            continue
        raw_inputs = node.get("inputs", {})
        if not isinstance(raw_inputs, dict):
            problems.append(f"node {node_id} '{node['class_type']}' has inputs of type {type(raw_inputs).__name__}; "
                            f"expected an object {{name: value}}")
            continue
        inputs = {}
        for name, value in raw_inputs.items():
            try:
                inputs[name] = _parse_input_value(value)
            except ValueError as exc:
                problems.append(f"node {node_id} '{node['class_type']}' input '{name}': {exc}")
        meta = node.get("_meta")
        title = meta.get("title") if isinstance(meta, dict) and isinstance(meta.get("title"), str) else None
        graph[node_id] = NodeSpec(node["class_type"], inputs, title)
    if problems:
        raise WorkflowError(problems)
    return graph


def _parse_input_value(value):
    if isinstance(value, dict) and "__value__" in value:
        return value["__value__"]
    if isinstance(value, list):
        if len(value) == 2 and isinstance(value[0], (str, int)) and isinstance(value[1], int) \
                and not isinstance(value[1], bool):
            return Link(str(value[0]), value[1])
        raise ValueError(f"{value!r} is neither a link [node_id, output_index] nor a value; "
                         f'wrap a list value as {{"__value__": [...]}}')
    return value


def to_api_prompt(graph: Graph) -> dict:
    """The graph back in API format: what nodes asking for the hidden PROMPT input receive, as in ComfyUI."""
    prompt = {}
    for node_id, node in graph.items():
        inputs = {name: ([value.from_id, value.output_index] if isinstance(value, Link)
                         else {"__value__": value} if isinstance(value, list) else value)
                  for name, value in node.inputs.items()}
        prompt[node_id] = {"class_type": node.class_type, "inputs": inputs}
        if node.title:
            prompt[node_id]["_meta"] = {"title": node.title}
    return prompt

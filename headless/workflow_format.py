"""Loading a workflow file in either of ComfyUI's formats into one normalised, validated graph.

- UI format: what the frontend saves (Workflow > Save / Export) and loads by drag-and-drop.
- API format: what "Export (API)" writes and the /prompt endpoint takes.
"""
from __future__ import annotations

import json
import os

from .api_format import looks_like_api_prompt, parse_api_prompt
from .graph import Graph, WorkflowError
from .ui_format import looks_like_ui_workflow, parse_ui_workflow
from .validation import validate_graph

UI_FORMAT, API_FORMAT = "ui", "api"


def load_workflow(source, node_mappings: dict) -> Graph:
    """`source` is a path or already-parsed JSON; returns {node_id: NodeSpec}; raises WorkflowError."""
    data = read_workflow_json(source) if isinstance(source, (str, os.PathLike)) else source
    graph = parse_workflow(data, node_mappings)
    if not graph:
        raise WorkflowError("the workflow has no nodes to run (all muted, bypassed or notes): "
                            "enable at least one node")
    return validate_graph(graph, node_mappings)


def parse_workflow(data, node_mappings: dict) -> Graph:
    """The graph as written (not yet checked against the node classes' inputs)."""
    kind = workflow_format(data)
    return parse_ui_workflow(data, node_mappings) if kind == UI_FORMAT else parse_api_prompt(data)


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
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except FileNotFoundError:
        raise WorkflowError(f"workflow file {path!r} does not exist: check the path") from None
    except IsADirectoryError:
        raise WorkflowError(f"{path!r} is a folder: pass the workflow's .json file") from None
    except UnicodeDecodeError:
        raise WorkflowError(f"{path!r} is not a text file: pass the workflow's .json file (a PNG with an "
                            f"embedded workflow must be loaded in ComfyUI and saved as JSON)") from None
    except json.JSONDecodeError as exc:
        raise WorkflowError(f"{path!r} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}): "
                            f"fix the file or save it again from ComfyUI") from None

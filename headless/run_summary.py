"""The short report `tightrope run` prints at the end: what each output node showed or wrote."""
from __future__ import annotations

import os

from .graph import Graph, describe_node
from .executor import NodeOutputs

_MAX_TEXT = 300  # a loss curve dump or a long prompt should not flood the terminal


def summary_lines(results: dict[str, NodeOutputs], graph: Graph, node_mappings: dict, output_dir: str) -> list[str]:
    """One heading per output node (or, if none is declared, per node that returned `ui`), then its items."""
    reported = [node_id for node_id in results
                if getattr(node_mappings[graph[node_id].class_type], "OUTPUT_NODE", False) is True]
    if not reported:
        reported = [node_id for node_id, outputs in results.items() if outputs.ui]
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

"""Following a UI-format link back to the node output (or value) that really feeds an input.

Mirrors what the frontend does when it turns the canvas into an API prompt (graphToPrompt and
ExecutableNodeDTO.resolveOutput): a muted source feeds nothing; a bypassed node hands over the input
whose type matches the output; a Reroute passes its input through; a PrimitiveNode supplies its value.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .graph import Link, WorkflowError, describe_node

MODE_MUTED = 2  # LGraphEventMode.NEVER
MODE_BYPASSED = 4  # LGraphEventMode.BYPASS


@dataclass(frozen=True)
class UiLink:
    from_id: str
    from_slot: int
    to_id: str
    to_slot: int
    type: Any


@dataclass(frozen=True)
class Value:
    """A literal that arrives over a link (from a PrimitiveNode)."""
    value: Any


@dataclass(frozen=True)
class Disconnected:
    """Nothing arrives; `reason` says why, for the message if the input was required."""
    reason: str


def parse_links(raw_links) -> dict[int, UiLink]:
    """Links as saved: `[id, from_node, from_slot, to_node, to_slot, type]`, or objects (schema version 1)."""
    links = {}
    for raw in raw_links or []:
        if isinstance(raw, dict):
            link = UiLink(str(raw["origin_id"]), raw["origin_slot"], str(raw["target_id"]), raw["target_slot"],
                          raw.get("type"))
            links[raw["id"]] = link
        elif isinstance(raw, (list, tuple)) and len(raw) >= 6:
            links[raw[0]] = UiLink(str(raw[1]), raw[2], str(raw[3]), raw[4], raw[5])
        else:
            raise WorkflowError(f"link {raw!r} is not [id, from_node, from_slot, to_node, to_slot, type]: "
                                f"the file is damaged; re-save it from ComfyUI")
    return links


class LinkResolver:
    def __init__(self, nodes_by_id: dict[str, dict], links: dict[int, UiLink]):
        self.nodes_by_id = nodes_by_id
        self.links = links

    def resolve(self, link_id) -> Link | Value | Disconnected:
        return self._resolve(link_id, set())

    def _resolve(self, link_id, seen: set) -> Link | Value | Disconnected:
        if link_id in seen:
            raise WorkflowError(f"links {sorted(seen)} loop through Reroute or bypassed nodes: break the loop")
        seen.add(link_id)
        link = self.links.get(link_id)
        if link is None:
            raise WorkflowError(f"link {link_id} is used by a node but missing from the workflow's links: "
                                f"the file is damaged; re-save it from ComfyUI")
        source = self.nodes_by_id.get(link.from_id)
        if source is None:
            raise WorkflowError(f"link {link_id} comes from node {link.from_id}, which the workflow lacks: "
                                f"the file is damaged; re-save it from ComfyUI")
        label = describe_node(link.from_id, source.get("type", "?"))
        mode = source.get("mode", 0)
        if mode == MODE_MUTED:
            return Disconnected(f"it comes from {label}, which is muted")
        if mode == MODE_BYPASSED:
            slot = bypass_input_slot(source, link.from_slot, link.type)
            if slot < 0:
                return Disconnected(f"it comes from {label}, which is bypassed and has no input of type {link.type}")
            return self._follow_input(source, slot, label, seen)
        if source.get("type") == "Reroute":
            return self._follow_input(source, 0, label, seen)
        if source.get("type") == "PrimitiveNode":
            saved = source.get("widgets_values") or []
            return Value(saved[0]) if saved else Disconnected(f"{label} has no saved value")
        return Link(link.from_id, link.from_slot)

    def _follow_input(self, node: dict, slot: int, label: str, seen: set):
        inputs = node.get("inputs") or []
        upstream = inputs[slot].get("link") if slot < len(inputs) else None
        if upstream is None:
            return Disconnected(f"it passes through {label}, whose input is not connected")
        return self._resolve(upstream, seen)


def bypass_input_slot(node: dict, slot: int, target_type) -> int:
    """Which input a bypassed node forwards for output `slot`; -1 if none fits (the frontend's rule)."""
    inputs = node.get("inputs") or []
    if target_type in ("*", "", None, 0):
        return slot if slot < len(inputs) else (0 if inputs else -1)
    outputs = node.get("outputs") or []
    output_type = outputs[slot].get("type") if slot < len(outputs) else target_type
    if slot < len(inputs):
        same_slot = inputs[slot].get("type")
        if types_compatible(same_slot, output_type) and types_compatible(same_slot, target_type):
            return slot
    for index, entry in enumerate(inputs):
        if entry.get("type") == target_type:
            return index
    for index, entry in enumerate(inputs):
        if types_compatible(entry.get("type"), output_type) and types_compatible(entry.get("type"), target_type):
            return index
    return -1


def types_compatible(a, b) -> bool:
    """LiteGraph.isValidConnection: "*" / "" match anything; "A,B" unions match any member; case-insensitive."""
    if a in ("*", "", None, 0) or b in ("*", "", None, 0) or a == b:
        return True
    a_types = {t.strip().lower() for t in str(a).split(",")}
    b_types = {t.strip().lower() for t in str(b).split(",")}
    return bool(a_types & b_types) or "*" in a_types or "*" in b_types

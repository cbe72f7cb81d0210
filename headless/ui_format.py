"""Reading the UI format: what ComfyUI's frontend saves and loads by drag-and-drop (schema version 0.4).

    {"last_node_id", "last_link_id", "nodes": [{"id", "type", "mode", "inputs", "outputs", "widgets_values"}],
     "links": [[id, from_node, from_slot, to_node, to_slot, type]], "groups", "config", "extra", "version"}

Nodes are turned into the same graph the API format gives: widget values named by the node class's
INPUT_TYPES, links followed through Reroute/bypassed/Primitive nodes, muted nodes dropped.

Links: a link is followed back to the node output (or value) that really feeds the input, as the frontend does
when it turns the canvas into an API prompt (graphToPrompt and ExecutableNodeDTO.resolveOutput): a muted source
feeds nothing; a bypassed node hands over the input whose type matches the output; a Reroute passes its input
through; a PrimitiveNode supplies its value.

Widget values: the frontend saves them as a plain list in widget order: the class's widget inputs, required then
optional, in declaration order, each followed by the values of its control widgets (an INT seed's "randomize"; a
combo's control mode and filter text). Frontends since 1.4x also save `widgets_values_named` ({widget name:
value}); some node packs save `widgets_values` as a dict. All three are read here. A count mismatch means the file
was saved with a different version of the node. Like the frontend, a list that stops early is accepted when only
optional widgets are left without a value (a node that gained an optional input keeps loading old files; those
widgets take their defaults). Anything else would silently train with shifted settings, so it is an error.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .comfyui_v3 import dynamic_input_kinds
from .graph import Graph, Link, NodeSpec, WorkflowError, describe_node, needed_node_ids, sorted_node_ids
from .input_spec import CONTROL_MODE, CONTROL_MODES, InputSpec, declared_inputs, node_input_specs, widget_specs
from .ui_damage import FIX, damage_problems
from .validation import unknown_node_type_problem


COMMENT_NODE_TYPES = frozenset({"Note", "MarkdownNote"})  # frontend-only: no inputs, no outputs
PASS_THROUGH_NODE_TYPES = frozenset({"Reroute", "PrimitiveNode"})  # frontend-only: resolved by LinkResolver


def looks_like_ui_workflow(data) -> bool:
    return isinstance(data, dict) and isinstance(data.get("nodes"), list) and "links" in data


def parse_ui_workflow(data: dict, node_mappings: dict, path: str | None = None) -> Graph:
    """The graph `data` holds; raises WorkflowError, each problem starting with `path` (the file's), if given.

    As in ComfyUI, a problem in one node's own values or links refuses the workflow only if that node runs (feeds
    an output node); an unknown node type, a subgraph or group node, or a damaged file refuses it wherever it is."""
    where = f"{path}: " if path else ""
    damage = damage_problems(data)
    if damage:
        raise WorkflowError([f"{where}{problem}: {FIX}" for problem in damage])
    nodes_by_id = {str(node["id"]): node for node in data["nodes"]}
    resolver = LinkResolver(nodes_by_id, parse_links(data.get("links")))
    subgraph_names = {sub.get("id"): sub.get("name") for sub in (data.get("definitions") or {}).get("subgraphs", [])}
    group_node_names = set((data.get("extra") or {}).get("groupNodes") or {})
    problems: list[tuple[str | None, str]] = []  # (node id: only if that node runs | None: always, the problem)
    graph: Graph = {}
    for node_id in sorted_node_ids(nodes_by_id):
        node = nodes_by_id[node_id]
        class_type = node["type"]
        if node.get("mode", 0) in (MODE_MUTED, MODE_BYPASSED):
            continue  # never executed; links through bypassed nodes are rerouted by LinkResolver
        if class_type in COMMENT_NODE_TYPES or class_type in PASS_THROUGH_NODE_TYPES:
            continue
        if class_type in subgraph_names:
            problems.append((None, f"node {node_id} is a subgraph ('{subgraph_names[class_type]}'), which headless "
                                   f"runs don't expand: in ComfyUI right-click it, choose 'Unpack Subgraph', save, "
                                   f"and run again"))
            continue
        if _is_group_node(class_type, group_node_names):
            problems.append((None, f"{describe_node(node_id, class_type)} is a group node, which headless runs "
                                   f"don't expand: in ComfyUI right-click it, choose 'Convert to nodes', save, and "
                                   f"run again"))
            continue
        node_class = node_mappings.get(class_type)
        if node_class is None:
            properties = node.get("properties")
            package = properties.get("cnr_id") if isinstance(properties, dict) else None
            problems.append((None, unknown_node_type_problem(node_id, class_type, node_mappings, package=package)))
            continue
        node_problems: list[str] = []
        try:
            graph[node_id] = _node_spec(node, node_id, node_class, resolver, node_problems)
        except WorkflowError as exc:
            problems.extend((None, f"{describe_node(node_id, class_type)}: {p}") for p in exc.problems)
        problems.extend((node_id, problem) for problem in node_problems)
    runs = needed_node_ids(graph, node_mappings)
    shown = [where + problem for node_id, problem in problems if node_id is None or node_id in runs]
    if shown:
        raise WorkflowError(shown)
    return graph


def _node_spec(node: dict, node_id: str, node_class, resolver: LinkResolver, problems: list[str]) -> NodeSpec:
    class_type = node["type"]
    specs = node_input_specs(node_class)
    dynamic = dynamic_input_kinds(declared_inputs(node_class))
    if dynamic:  # where the frontend saves their values is not read here; the links are, to know if the node runs
        problems.append(f"{describe_node(node_id, class_type)} has V3 dynamic inputs ({', '.join(dynamic)}), which "
                        f"headless runs read only from API-format files: in ComfyUI use Workflow > Export (API) and "
                        f"run that file, or run this workflow inside ComfyUI")
        inputs = {}
    else:
        inputs = widget_values_by_name(node, node_class, node_id, problems)
    for entry in node.get("inputs") or []:
        # a widget converted to an input carries {"widget": {"name": ...}}; its name is the input's name
        name = (entry.get("widget") or {}).get("name") or entry.get("name")
        if entry.get("link") is None:
            continue
        source = resolver.resolve(entry["link"])
        if isinstance(source, Value):
            inputs[name] = source.value
        elif isinstance(source, Disconnected):
            spec = specs.get(name)
            if spec is not None and spec.is_widget:
                continue  # the frontend falls back to the widget's own saved value
            inputs.pop(name, None)
            if spec is not None and spec.required:
                problems.append(f"{describe_node(node_id, class_type)} needs input '{name}', but {source.reason}: "
                                f"reconnect it or re-enable that node")
        else:
            inputs[name] = source
    return NodeSpec(class_type, inputs, node.get("title"))


def _is_group_node(class_type, group_node_names: set) -> bool:
    if not isinstance(class_type, str):
        return False
    for separator in (">", "/"):  # legacy group nodes are typed "workflow>Name" (older: "workflow/Name")
        prefix, _, name = class_type.partition(separator)
        if prefix == "workflow" and name in group_node_names:
            return True
    return False


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
    """Links as saved: `[id, from_node, from_slot, to_node, to_slot, type]`, or objects (schema version 1). One that
    cannot be read is left out: ui_damage.py has reported it if an input uses it (the frontend ignores the others)."""
    links = {}
    for raw in raw_links or []:
        if isinstance(raw, dict) and all(key in raw for key in ("id", "origin_id", "origin_slot")):
            links[raw["id"]] = UiLink(str(raw["origin_id"]), raw["origin_slot"], str(raw.get("target_id")),
                                      raw.get("target_slot"), raw.get("type"))
        elif isinstance(raw, (list, tuple)) and len(raw) >= 6:
            links[raw[0]] = UiLink(str(raw[1]), raw[2], str(raw[3]), raw[4], raw[5])
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
            saved = source.get("widgets_values")
            return Value(saved[0]) if isinstance(saved, list) and saved else Disconnected(f"{label} has no saved value")
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


def widget_values_by_name(node: dict, node_class, node_id: str, problems: list[str]) -> dict:
    """`{input name: saved value}` for `node`'s widgets; appends what is wrong to `problems`."""
    specs = widget_specs(node_class)
    label = describe_node(node_id, node.get("type", "?"))
    saved = node.get("widgets_values")
    named = node.get("widgets_values_named")
    if isinstance(saved, dict):
        return _from_names(saved, specs, label, problems)
    if saved is None and isinstance(named, dict):
        return _from_names(named, specs, label, problems)
    saved = list(saved or [])
    expected = sum(1 + len(spec.saved_extras) for spec in specs)
    if len(saved) != expected and isinstance(named, dict):
        return _from_names(named, specs, label, problems)  # names survive a node gaining or losing a widget
    if len(saved) < expected and _only_optional_widgets_unsaved(saved, specs):
        return _from_list(saved, specs, label, problems)
    if len(saved) != expected:
        problems.append(f"{label} has {len(saved)} widgets_values but its widgets need {expected} "
                        f"({_layout(specs)}): the workflow was saved with a different version of this node; "
                        f"open it in ComfyUI, check the node's values, and save it again")
        return {}
    return _from_list(saved, specs, label, problems)


def _only_optional_widgets_unsaved(saved: list, specs: list[InputSpec]) -> bool:
    """True when `saved` ends exactly after some widget and every widget after that one is optional."""
    position = 0
    for index, spec in enumerate(specs):
        if position == len(saved):
            return all(not later.required for later in specs[index:])
        position += 1 + len(spec.saved_extras)
    return position == len(saved)


def _from_list(saved: list, specs: list[InputSpec], label: str, problems: list[str]) -> dict:
    values, position = {}, 0
    for spec in specs:
        if position >= len(saved):
            break  # the rest are optional widgets saved before the node had them: they take their defaults
        values[spec.name] = saved[position]
        if CONTROL_MODE in spec.saved_extras:
            mode = saved[position + 1 + spec.saved_extras.index(CONTROL_MODE)]
            if mode not in CONTROL_MODES:  # the cheapest sign that the list is shifted
                problems.append(f"{label} widgets_values[{position + 1}] should be the control_after_generate mode "
                                f"of '{spec.name}' (one of {', '.join(CONTROL_MODES)}) but is {mode!r}: the values "
                                f"are out of step with the node's widgets ({_layout(specs)}); re-save the workflow "
                                f"from ComfyUI")
                return {}
        position += 1 + len(spec.saved_extras)
    return values


def _from_names(saved: dict, specs: list[InputSpec], label: str, problems: list[str]) -> dict:
    names = {spec.name for spec in specs}
    # control widgets are named "control_after_generate"/"control_filter_list" (or a prefixed variant)
    unknown = sorted(k for k in saved if k not in names and "control_" not in k)
    if unknown:
        problems.append(f"{label} saves values for {', '.join(map(repr, unknown))}, which the node has no widget "
                        f"for (its widgets: {', '.join(sorted(names)) or 'none'}): remove them or fix the names")
    return {name: value for name, value in saved.items() if name in names}


def _layout(specs: list[InputSpec]) -> str:
    return ", ".join(" + ".join((spec.name,) + spec.saved_extras) for spec in specs) or "no widgets"

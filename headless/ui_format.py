"""Reading the UI format: what ComfyUI's frontend saves and loads by drag-and-drop (schema version 0.4).

    {"last_node_id", "last_link_id", "nodes": [{"id", "type", "mode", "inputs", "outputs", "widgets_values"}],
     "links": [[id, from_node, from_slot, to_node, to_slot, type]], "groups", "config", "extra", "version"}

Nodes are turned into the same graph the API format gives: widget values named by the node class's
INPUT_TYPES, links followed through Reroute/bypassed/Primitive nodes, muted nodes dropped.
"""
from __future__ import annotations

from .graph import Graph, NodeSpec, WorkflowError, describe_node, sorted_node_ids
from .input_spec import node_input_specs
from .node_type_lookup import unknown_node_type_problem
from .ui_links import MODE_BYPASSED, MODE_MUTED, Disconnected, LinkResolver, Value, parse_links
from .ui_widget_values import widget_values_by_name

COMMENT_NODE_TYPES = frozenset({"Note", "MarkdownNote"})  # frontend-only: no inputs, no outputs
PASS_THROUGH_NODE_TYPES = frozenset({"Reroute", "PrimitiveNode"})  # frontend-only: resolved by LinkResolver


def looks_like_ui_workflow(data) -> bool:
    return isinstance(data, dict) and isinstance(data.get("nodes"), list) and "links" in data


def parse_ui_workflow(data: dict, node_mappings: dict) -> Graph:
    nodes_by_id = {str(node["id"]): node for node in data["nodes"]}
    resolver = LinkResolver(nodes_by_id, parse_links(data.get("links")))
    subgraph_names = {sub.get("id"): sub.get("name") for sub in (data.get("definitions") or {}).get("subgraphs", [])}
    group_node_names = set((data.get("extra") or {}).get("groupNodes") or {})
    problems: list[str] = []
    graph: Graph = {}
    for node_id in sorted_node_ids(nodes_by_id):
        node = nodes_by_id[node_id]
        class_type = node.get("type")
        if node.get("mode", 0) in (MODE_MUTED, MODE_BYPASSED):
            continue  # never executed; links through bypassed nodes are rerouted by LinkResolver
        if class_type in COMMENT_NODE_TYPES or class_type in PASS_THROUGH_NODE_TYPES:
            continue
        if class_type in subgraph_names:
            problems.append(f"node {node_id} is a subgraph ('{subgraph_names[class_type]}'), which headless runs "
                            f"don't expand: in ComfyUI right-click it, choose 'Unpack Subgraph', save, and run again")
            continue
        if _is_group_node(class_type, group_node_names):
            problems.append(f"{describe_node(node_id, class_type)} is a group node, which headless runs don't "
                            f"expand: in ComfyUI right-click it, choose 'Convert to nodes', save, and run again")
            continue
        node_class = node_mappings.get(class_type)
        if node_class is None:
            package = (node.get("properties") or {}).get("cnr_id")
            problems.append(unknown_node_type_problem(node_id, class_type, node_mappings, package=package))
            continue
        try:
            graph[node_id] = _node_spec(node, node_id, node_class, resolver, problems)
        except WorkflowError as exc:
            problems.extend(f"{describe_node(node_id, class_type)}: {p}" for p in exc.problems)
    if problems:
        raise WorkflowError(problems)
    return graph


def _node_spec(node: dict, node_id: str, node_class, resolver: LinkResolver, problems: list[str]) -> NodeSpec:
    class_type = node["type"]
    specs = node_input_specs(node_class)
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

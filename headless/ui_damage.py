"""A UI-format file's shape, checked before it is read: what the frontend never saves (a hand edit, a truncated copy,
another tool's bug) is named by node or link with what is wrong, instead of a KeyError or TypeError deep in the reader.

Checked: every node an object with an "id" (unique), a "type" and a numeric "mode" (a hand-written "bypass" would
otherwise run the node); its "inputs"/"outputs" lists of objects, each input with a "name" and a "link" that is in the
workflow's links and comes from a node of the workflow; "widgets_values" a list or an object; every link
`[id, from_node, from_slot, to_node, to_slot, type]` (or, schema version 1, an object with "id", "origin_id",
"origin_slot", "target_id", "target_slot"), and a link an input uses with a node id and a whole-number slot of origin.
Not checked: what the frontend loads regardless (a link no input uses, a link's target, "properties").
"""
from __future__ import annotations

LINK_FIELDS = ("id", "origin_id", "origin_slot", "target_id", "target_slot")  # schema version 1's link objects
FIX = "the file is damaged: re-save it from ComfyUI, or fix it by hand"
UNREADABLE = object()  # a key of the link origins: some link's id could not be read


def damage_problems(data: dict) -> list[str]:
    """What is wrong with the shape of `data` (a dict with "nodes" a list), one message per problem; [] if nothing."""
    problems: list[str] = []
    origins = _link_origins(data.get("links"), problems)
    node_ids = set()
    checked = []
    for index, node in enumerate(data["nodes"]):
        node_id = node.get("id") if isinstance(node, dict) else None
        if not _is_id(node_id):
            if isinstance(node, dict):
                kind = f" ({node['type']!r})" if isinstance(node.get("type"), str) else ""
                problems.append(f'nodes[{index}]{kind} has ' + (f'"id" {_shown(node_id)}, not a node id'
                                                                if "id" in node else 'no "id"'))
            else:
                problems.append(f"nodes[{index}] is {_shown(node)}, not an object")
            node_ids = None  # links from it would be reported as from a missing node: the one problem is enough
            continue
        if node_ids is not None:
            if str(node_id) in node_ids:
                problems.append(f"node {node_id}: two nodes have this id")
            node_ids.add(str(node_id))
        checked.append(node)
    for node in checked:
        problems.extend(f"node {node['id']} {p}" for p in _node_problems(node, origins, node_ids))
    for kind, value in (("definitions", data.get("definitions")), ("extra", data.get("extra"))):
        if value is not None and not isinstance(value, dict):
            problems.append(f'"{kind}" is {_shown(value)}, not an object')
    subgraphs = (data.get("definitions") or {}).get("subgraphs") if isinstance(data.get("definitions"), dict) else []
    if not isinstance(subgraphs or [], list) or not all(isinstance(sub, dict) for sub in subgraphs or []):
        problems.append('"definitions.subgraphs" is not a list of subgraph objects')
    return problems


def _node_problems(node: dict, origins: dict | None, node_ids: set[str] | None) -> list[str]:
    problems = []
    kind = node.get("type")
    if kind is None:
        problems.append('has no "type" (the node\'s class name)')
    elif not isinstance(kind, str) or not kind:
        problems.append(f'has "type" {_shown(kind)}, not a node class name')
    if not isinstance(node.get("mode", 0), int):
        problems.append(f'has "mode" {_shown(node.get("mode"))}, not a number (0 runs, 2 muted, 4 bypassed)')
    for key, types, what in (("inputs", list, "a list"), ("outputs", list, "a list"),
                             ("widgets_values", (list, dict), "a list of values")):
        value = node.get(key)
        if value is not None and not isinstance(value, types):
            problems.append(f'has "{key}" {_shown(value)}, not {what}')
    for key in ("inputs", "outputs"):
        entries = node.get(key) if isinstance(node.get(key), list) else []
        for index, entry in enumerate(entries):
            if not isinstance(entry, dict) or not isinstance(entry.get("name", ""), str):
                problems.append(f'{key}[{index}] is {_shown(entry)}, not an {key[:-1]} object with a "name"')
            elif not isinstance(entry.get("widget") or {}, dict) \
                    or not isinstance((entry.get("widget") or {}).get("name", ""), str):
                problems.append(f'{key}[{index}] has "widget" {_shown(entry["widget"])}, not {{"name": ...}}')
            elif key == "inputs" and entry.get("link") is not None \
                    and "name" not in entry and not (entry.get("widget") or {}).get("name"):
                problems.append(f'inputs[{index}] has link {_shown(entry["link"])} but no "name" (the input it feeds)')
            elif key == "inputs":
                problems.extend(_input_link_problems(entry, origins, node_ids))
    return problems


def _input_link_problems(entry: dict, origins: dict | None, node_ids: set[str] | None) -> list[str]:
    """What is wrong with the link an input uses; `origins` None: the links are unreadable (reported once)."""
    link = entry.get("link")
    name = entry.get("name")
    if link is None or origins is None:
        return []
    if not _is_id(link):
        return [f"input '{name}' has link {_shown(link)}, not a link id"]
    if link not in origins:  # unless a link without a readable id (reported) may be this one
        lack = f"input '{name}' uses link {link}, which the workflow's \"links\" lack"
        return [] if UNREADABLE in origins else [lack]
    origin = origins[link]
    if isinstance(origin, LinkDamage):
        return [f"input '{name}' uses link {link}, which has {origin}"]
    if node_ids is not None and str(origin) not in node_ids:
        return [f"input '{name}' uses link {link}, which comes from node {origin}, which the workflow lacks"]
    return []


class LinkDamage(str):
    """What is wrong with a link's origin, reported if an input uses the link (the frontend ignores unused links)."""


def _link_origins(links, problems: list[str]) -> dict | None:
    """{link id: its origin node id, or its LinkDamage}; a link without a readable id is reported here; None if
    "links" is not a list."""
    if links is None:
        return {}
    if not isinstance(links, list):
        problems.append(f'"links" is {_shown(links)}, not a list')
        return None
    origins = {}
    for index, raw in enumerate(links):
        if isinstance(raw, dict):
            values = [raw.get(field) for field in LINK_FIELDS]
        elif isinstance(raw, list) and len(raw) >= 6:
            values = raw[:5]
        elif isinstance(raw, list) and raw and _is_id(raw[0]):  # reported if an input uses it
            origins[raw[0]] = LinkDamage(f"only {len(raw)} of its 6 fields [id, from_node, from_slot, to_node, "
                                         f"to_slot, type] ({_shown(raw)})")
            continue
        else:
            problems.append(f"links[{index}] is {_shown(raw)}, not [id, from_node, from_slot, to_node, to_slot, type]")
            origins[UNREADABLE] = True
            continue
        link_id, origin, origin_slot = values[:3]  # the target is the input that names the link
        if not _is_id(link_id):
            problems.append(f"links[{index}] has id {_shown(link_id)}, not a link id")
            origins[UNREADABLE] = True
            continue
        bad = [f"{what} {_shown(value)}, not {wanted}" for what, value, ok, wanted in (
            ("from_node", origin, _is_id, "a node id"), ("from_slot", origin_slot, _is_slot, "a slot number"))
            if not ok(value)]
        origins[link_id] = LinkDamage("; ".join(bad)) if bad else origin
    return origins


def _is_id(value) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, str) and value != "")


def _is_slot(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."

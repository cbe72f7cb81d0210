"""Build small UI-format (frontend save format, version 0.4) workflows in tests without hand-writing JSON."""


def ui_node(node_id, node_type, widgets_values=None, *, inputs=(), outputs=(), mode=0, **extra):
    """`inputs`: [(name, type, link_id, is_widget)]; `outputs`: [(name, type, [link ids])]."""
    node = {
        "id": node_id, "type": node_type, "pos": [0, 0], "size": [200, 60], "flags": {}, "order": 0, "mode": mode,
        "inputs": [dict({"name": name, "type": kind, "link": link}, **({"widget": {"name": name}} if is_widget else {}))
                   for name, kind, link, is_widget in inputs],
        "outputs": [{"name": name, "type": kind, "links": list(links)} for name, kind, links in outputs],
        "properties": {"Node name for S&R": node_type},
    }
    if widgets_values is not None:
        node["widgets_values"] = widgets_values
    node.update(extra)
    return node


def ui_workflow(nodes, links=()):
    """`links`: [(link_id, from_node, from_slot, to_node, to_slot, type)]."""
    return {
        "last_node_id": max((n["id"] for n in nodes), default=0),
        "last_link_id": max((link[0] for link in links), default=0),
        "nodes": list(nodes), "links": [list(link) for link in links],
        "groups": [], "config": {}, "extra": {"ds": {"scale": 1, "offset": [0, 0]}}, "version": 0.4,
    }


def constant_add_record(add_widgets=(0, 5, 42, "randomize", "add", 0.5), *, add_mode=0, constant_mode=0):
    """Constant(7) -> Add.a (a widget converted to an input) -> Record."""
    nodes = [
        ui_node(1, "Constant", [7], outputs=[("INT", "INT", [1])], mode=constant_mode),
        ui_node(2, "Add", list(add_widgets), inputs=[("a", "INT", 1, True)], outputs=[("sum", "INT", [2])],
                mode=add_mode),
        ui_node(3, "Record", ["total"], inputs=[("value", "INT", 2, False)]),
    ]
    return ui_workflow(nodes, [(1, 1, 0, 2, 0, "INT"), (2, 2, 0, 3, 0, "INT")])

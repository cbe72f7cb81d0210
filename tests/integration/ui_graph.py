"""An API-format prompt ({id: {"class_type", "inputs"}}) saved as the frontend saves it (UI format, version 0.4): widget
values in INPUT_TYPES order with their control slots, socket inputs and outputs with link ids, core nodes stamped
`cnr_id: comfy-core`. Reads the real node classes (ComfyUI's too, when loaded), so the file is what the UI would save."""
from __future__ import annotations

from tightrope.headless.input_spec import CONTROL_MODE, node_input_specs

EXTRA_VALUES = {CONTROL_MODE: "fixed", "control filter": ""}


def to_ui_workflow(prompt: dict, node_mappings: dict) -> dict:
    links, nodes = [], []
    outgoing: dict[tuple[str, int], list[int]] = {}
    for to_id, node in prompt.items():
        specs = node_input_specs(node_mappings[node["class_type"]])
        for slot, (name, value) in enumerate((n, node["inputs"][n]) for n in specs if n in node["inputs"]):
            if isinstance(value, list) and len(value) == 2 and isinstance(value[0], str):
                link_id = len(links) + 1
                links.append([link_id, int(value[0]), value[1], int(to_id), name, specs[name].type])
                outgoing.setdefault((value[0], value[1]), []).append(link_id)
    for node_id, node in prompt.items():
        cls = node_mappings[node["class_type"]]
        specs = node_input_specs(cls)
        linked = {link[4]: link[0] for link in links if str(link[3]) == node_id}
        inputs, widgets = [], []
        for name, spec in specs.items():
            if spec.is_widget:
                value = node["inputs"].get(name, spec.default)
                widgets.append(spec.default if name in linked else value)
                widgets.extend(EXTRA_VALUES.get(extra) for extra in spec.saved_extras)
                if name in linked:
                    inputs.append({"name": name, "type": spec.type, "link": linked[name], "widget": {"name": name}})
            else:
                inputs.append({"name": name, "type": spec.type, "link": linked.get(name)})
        names = getattr(cls, "RETURN_NAMES", None) or cls.RETURN_TYPES
        outputs = [{"name": name, "type": kind, "links": outgoing.get((node_id, index), [])}
                   for index, (name, kind) in enumerate(zip(names, cls.RETURN_TYPES))]
        core = not node["class_type"].startswith("Tightrope")
        nodes.append({"id": int(node_id), "type": node["class_type"], "pos": [0, 0], "size": [300, 100], "flags": {},
                      "order": len(nodes), "mode": 0, "inputs": inputs, "outputs": outputs, "widgets_values": widgets,
                      "properties": {"Node name for S&R": node["class_type"],
                                     **({"cnr_id": "comfy-core"} if core else {})}})
    for link in links:  # the UI format names the target slot by index
        target = next(n for n in nodes if n["id"] == link[3])
        link[4] = next(i for i, entry in enumerate(target["inputs"]) if entry["name"] == link[4])
    return {"last_node_id": max(n["id"] for n in nodes), "last_link_id": len(links), "nodes": nodes, "links": links,
            "groups": [], "config": {}, "extra": {}, "version": 0.4}

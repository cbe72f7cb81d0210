"""Naming the values in a UI-format node's `widgets_values`.

The frontend saves widget values as a plain list in widget order: the class's widget inputs, required
then optional, in declaration order, each followed by the values of its control widgets (an INT seed's
"randomize"; a combo's control mode and filter text). Frontends since 1.4x also save
`widgets_values_named` ({widget name: value}); some node packs save `widgets_values` as a dict. All three
are read here.

A count mismatch means the file was saved with a different version of the node. Like the frontend, a
list that stops early is accepted when only optional widgets are left without a value (a node that
gained an optional input keeps loading old files; those widgets take their defaults). Anything else
would silently train with shifted settings, so it is an error.
"""
from __future__ import annotations

from .graph import describe_node
from .input_spec import CONTROL_MODE, CONTROL_MODES, InputSpec, widget_specs


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

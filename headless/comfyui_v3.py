"""ComfyUI's V3 node API (comfy_api's `io.ComfyNode` classes) for the headless runner, through ComfyUI's own helpers
as execution.py uses them: dynamic inputs (Autogrow, DynamicCombo, DynamicSlot) expanded against a node's inputs, a
node's own validate_inputs / check_lazy_status found the way ComfyUI finds them, and validate_inputs called.

A V3 node class exists only where ComfyUI is loaded (comfyui_library.py), so ComfyUI's modules are imported here only
inside the functions, and those are only called for V3 classes: a run of V1 nodes (Tightrope's) never imports them.
"""
from __future__ import annotations

import asyncio
import inspect

from .graph import Link


# comfy_api/latest/_io.py: the input types whose real inputs depend on the node's other inputs (DYNAMIC_INPUT_LOOKUP)
DYNAMIC_INPUT_TYPES = {"COMFY_AUTOGROW_V3": "Autogrow", "COMFY_DYNAMICCOMBO_V3": "DynamicCombo",
                       "COMFY_DYNAMICSLOT_V3": "DynamicSlot"}
MATCH_TYPE = "COMFY_MATCHTYPE_V3"  # an input or output whose type the frontend matches; the backend accepts any


def is_v3_node(node_class) -> bool:
    """A comfy_api ComfyNode (ComfyUI checks issubclass(_ComfyNodeInternal); duck-typed here, nothing imported)."""
    return callable(getattr(node_class, "GET_BASE_CLASS", None)) and callable(getattr(node_class, "define_schema",
                                                                                      None))


def own_hook(node_class, name: str):
    """A V3 class's `name` (validate_inputs, check_lazy_status) where it defines one, else None: ComfyNode's own is a
    placeholder, which ComfyUI skips (comfy_api.internal.first_real_override)."""
    from comfy_api.internal import first_real_override
    return first_real_override(node_class, name)


def dynamic_input_kinds(declared: dict) -> list[str]:
    """The kinds of dynamic input in `declared` (an INPUT_TYPES() dict), e.g. ["Autogrow"]; empty for most nodes."""
    kinds = {DYNAMIC_INPUT_TYPES.get(_type_of(entry)) for category in ("required", "optional")
             for entry in (declared.get(category) or {}).values()}
    return sorted(kind for kind in kinds if kind)


def finalized_inputs(declared: dict, live_inputs: dict) -> dict:
    """`declared` with its dynamic inputs expanded for these inputs (ComfyUI's get_finalized_class_inputs): an
    Autogrow's `values` becomes `values.value0`, ...; a DynamicCombo adds the inputs of the option chosen. A
    DynamicCombo whose value is none of its options is kept as it is, so that value is reported as a bad choice."""
    from comfy_api.latest import _io
    prompt_inputs = {name: ([value.from_id, value.output_index] if isinstance(value, Link) else value)
                     for name, value in live_inputs.items()}
    finalized, _hidden, _v3_data = _io.get_finalized_class_inputs(declared, prompt_inputs)
    for category in ("required", "optional"):
        for name, entry in (declared.get(category) or {}).items():
            if _type_of(entry) == "COMFY_DYNAMICCOMBO_V3" and not any(name in finalized[c] for c in finalized):
                finalized[category][name] = entry
    return finalized


def call_validate_inputs(node_class, node_id: str, inputs: dict, received_types: dict) -> list:
    """What the node's validate_inputs returns, called as ComfyUI's validate_inputs (execution.py) calls it: its
    inputs from get_input_data (linked ones None: not computed yet), filtered to the names it takes."""
    import execution
    prompt_inputs = {name: ([value.from_id, value.output_index] if isinstance(value, Link) else value)
                     for name, value in inputs.items()}
    validator = own_hook(node_class, "validate_inputs")
    argspec = inspect.getfullargspec(validator)
    arguments, _missing, v3_data = execution.get_input_data(prompt_inputs, node_class, node_id)
    arguments = {name: value for name, value in arguments.items()
                 if argspec.varkw is not None or name in argspec.args}
    if "input_types" in argspec.args:
        arguments["input_types"] = [received_types]

    async def validated():
        returned = await execution._async_map_node_over_list("tightrope-validate", node_id, node_class, arguments,
                                                             "validate_inputs", v3_data=v3_data)
        return await execution.resolve_map_node_over_list_results(returned)
    return asyncio.run(validated())


def _type_of(entry) -> str | None:
    kind = entry[0] if isinstance(entry, (tuple, list)) and entry else entry
    return kind if isinstance(kind, str) else None  # a classic combo's type is its list of choices

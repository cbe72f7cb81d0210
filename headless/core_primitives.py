"""ComfyUI's Primitive* value nodes (Int, Float, Text, Boolean), re-declared so headless runs accept them.

They are core nodes, but trivial (value in, same value out), and workflows use them to share one seed or
prompt between nodes. Same type names and widgets as comfy_extras/nodes_primitive.py, so a saved
workflow's widgets_values line up.
"""
import sys


class _Primitive:
    CATEGORY = "utilities/primitive"
    FUNCTION = "execute"

    def execute(self, value):
        return (value,)


def _primitive(type_name: str, value_type: str, options: dict):
    return type(type_name, (_Primitive,), {
        "RETURN_TYPES": (value_type,),
        "INPUT_TYPES": classmethod(lambda cls: {"required": {"value": (value_type, dict(options))}}),
    })


CORE_PRIMITIVE_NODES = {
    "PrimitiveInt": _primitive("PrimitiveInt", "INT",
                               {"min": -sys.maxsize, "max": sys.maxsize, "control_after_generate": "fixed"}),
    "PrimitiveFloat": _primitive("PrimitiveFloat", "FLOAT", {"min": -sys.maxsize, "max": sys.maxsize, "step": 0.1}),
    "PrimitiveString": _primitive("PrimitiveString", "STRING", {}),
    "PrimitiveStringMultiline": _primitive("PrimitiveStringMultiline", "STRING", {"multiline": True}),
    "PrimitiveBoolean": _primitive("PrimitiveBoolean", "BOOLEAN", {}),
}


def with_core_primitives(node_mappings: dict) -> dict:
    """`node_mappings` plus the primitives (the pack's own classes win on a name clash)."""
    return {**CORE_PRIMITIVE_NODES, **node_mappings}

"""Every node follows the classic V1 API with a tooltip on every input, and its function takes those inputs."""
import inspect

import pytest

from tightrope import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS


@pytest.mark.parametrize("name", sorted(NODE_CLASS_MAPPINGS))
def test_v1_schema(name):
    cls = NODE_CLASS_MAPPINGS[name]
    assert name in NODE_DISPLAY_NAME_MAPPINGS and cls.CATEGORY.startswith("Tightrope/")
    assert isinstance(cls.RETURN_TYPES, tuple) and cls.DESCRIPTION
    spec = cls.INPUT_TYPES()
    inputs = {**spec.get("required", {}), **spec.get("optional", {})}
    for input_name, entry in inputs.items():
        assert len(entry) == 2 and entry[1].get("tooltip"), f"{name}.{input_name} has no tooltip"
    params = inspect.signature(getattr(cls, cls.FUNCTION)).parameters
    has_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
    assert has_kwargs or set(inputs) <= set(params), f"{name}.{cls.FUNCTION} does not take {set(inputs) - set(params)}"
    for required in spec.get("required", {}):
        assert required in params or has_kwargs

"""What the nodes' VALIDATE_INPUTS share: every widget's range and choices (NaN included), then the node's own checks.

ComfyUI calls a node's VALIDATE_INPUTS when a prompt is queued; because ours take **inputs, ComfyUI then skips its
own min/max/choice checks for every input (and those let NaN through: NaN compares false), so every widget is
checked here, with the headless runner's literal checks. The headless runner calls the same classmethod before the
first node runs. Linked inputs arrive as None (their values do not exist yet) and are checked when the node runs.
"""
from __future__ import annotations

from typing import Callable

from ..headless.input_spec import checked_value, node_input_specs


def validation_result(node_class, inputs: dict, *checks: Callable[[], object]) -> bool | str:
    """ComfyUI's VALIDATE_INPUTS answer: True, or one message listing every problem.

    `checks` run only when every widget is in range; each raises ValueError (the node's own error types are
    ValueErrors) naming the input and the fix, and must itself skip inputs that are None (linked)."""
    problems = []
    for name, spec in node_input_specs(node_class).items():
        value = inputs.get(name)
        if value is None or not spec.is_widget:
            continue
        try:
            checked_value(spec, value)
        except ValueError as e:
            problems.append(f"input '{name}' {e}")
    if not problems:
        for check in checks:
            try:
                check()
            except ValueError as e:
                problems.append(str(e))
    return "; ".join(problems) or True

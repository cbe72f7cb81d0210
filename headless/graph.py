"""The normalised graph both workflow formats load into, and the error every workflow problem raises.

A graph is `{node_id: NodeSpec}`; node ids are strings (the API format's keys; UI-format integer ids are
stringified). An input is either a literal value or a `Link` to another node's output slot.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple


class Link(NamedTuple):
    """The input takes output slot `output_index` of node `from_id`."""
    from_id: str
    output_index: int


@dataclass
class NodeSpec:
    class_type: str
    inputs: dict[str, Any] = field(default_factory=dict)  # name -> literal value | Link
    title: str | None = None  # the UI title, only to make messages recognisable


Graph = dict  # dict[str, NodeSpec]


class WorkflowError(ValueError):
    """Something in the workflow itself is wrong (not a bug, not a runtime failure).

    Holds every problem found, so one run reports all typos at once instead of one per attempt.
    """

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__(self._message())

    def _message(self) -> str:
        if len(self.problems) == 1:
            return self.problems[0]
        lines = "\n".join(f"  - {p}" for p in self.problems)
        return f"{len(self.problems)} problems in the workflow:\n{lines}"


def describe_node(node_id: str, class_type: str) -> str:
    """How every message names a node: `node 7 'KSampler'`."""
    return f"node {node_id} '{class_type}'"


def sorted_node_ids(ids) -> list[str]:
    """Numeric ids in numeric order ("2" before "10"), then any others; gives stable messages and run order."""
    return sorted(ids, key=lambda i: (0, int(i), "") if str(i).isdigit() else (1, 0, str(i)))

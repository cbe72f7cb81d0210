"""The normalised graph both workflow formats load into, the error every workflow problem raises, and which nodes
run in what order.

A graph is `{node_id: NodeSpec}`; node ids are strings (the API format's keys; UI-format integer ids are
stringified). An input is either a literal value or a `Link` to another node's output slot.

Like ComfyUI, only nodes that feed an output node (OUTPUT_NODE = True) run; a graph without any output
node runs every node (ComfyUI would refuse it, but a headless training graph may end in a node that
writes files without being declared an output). Order is dependency order, ties broken by node id.
"""
from __future__ import annotations

import heapq
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


def output_node_ids(graph: Graph, node_mappings: dict) -> list[str]:
    return [node_id for node_id in sorted_node_ids(graph)
            if getattr(node_mappings[graph[node_id].class_type], "OUTPUT_NODE", False) is True]


def execution_order(graph: Graph, node_mappings: dict) -> list[str]:
    targets = output_node_ids(graph, node_mappings) or sorted_node_ids(graph)
    needed = _ancestors_and_self(graph, targets)
    _raise_on_cycle(graph, needed)
    return _topological(graph, needed)


def upstream_ids(graph: Graph, node_id: str) -> list[str]:
    return [value.from_id for value in graph[node_id].inputs.values() if isinstance(value, Link)]


def _ancestors_and_self(graph: Graph, targets: list[str]) -> set[str]:
    needed, stack = set(), list(targets)
    while stack:
        node_id = stack.pop()
        if node_id not in needed:
            needed.add(node_id)
            stack.extend(upstream_ids(graph, node_id))
    return needed


def _topological(graph: Graph, needed: set[str]) -> list[str]:
    rank = {node_id: position for position, node_id in enumerate(sorted_node_ids(needed))}
    waiting_on = {node_id: set(upstream_ids(graph, node_id)) for node_id in needed}
    dependants: dict[str, list[str]] = {node_id: [] for node_id in needed}
    for node_id, sources in waiting_on.items():
        for source in sources:
            dependants[source].append(node_id)
    ready = [(rank[n], n) for n, sources in waiting_on.items() if not sources]
    heapq.heapify(ready)
    order = []
    while ready:
        _, node_id = heapq.heappop(ready)
        order.append(node_id)
        for dependant in dependants[node_id]:
            waiting_on[dependant].discard(node_id)
            if not waiting_on[dependant]:
                heapq.heappush(ready, (rank[dependant], dependant))
    return order


def _raise_on_cycle(graph: Graph, needed: set[str]) -> None:
    """Depth-first search; a back edge is a cycle, reported as the path that closes it."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" after
    path: list[str] = []

    def visit(node_id: str) -> None:
        state[node_id] = "open"
        path.append(node_id)
        for source in upstream_ids(graph, node_id):
            if state.get(source) == "open":
                loop = path[path.index(source):] + [source]
                # path runs consumer -> producer; show it in data-flow direction
                shown = " -> ".join(describe_node(n, graph[n].class_type) for n in reversed(loop))
                raise WorkflowError(f"dependency cycle: {shown}: a node cannot depend on its own output; "
                                    f"remove one of these links")
            if source not in state:
                visit(source)
        path.pop()
        state[node_id] = "done"

    for node_id in sorted_node_ids(needed):
        if node_id not in state:
            visit(node_id)

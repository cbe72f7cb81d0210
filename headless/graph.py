"""The normalised graph both workflow formats load into, the error every workflow problem raises, and which nodes
run in what order.

A graph is `{node_id: NodeSpec}`; node ids are strings (the API format's keys; UI-format integer ids are
stringified). An input is either a literal value or a `Link` to another node's output slot.

Like ComfyUI (execution.py: validate_prompt, ExecutionList), only the nodes that feed an output node (OUTPUT_NODE =
True) are checked and run: a disconnected or unfinished side branch is left alone, and a graph without any output node
is refused (validation.py). Order is dependency order, ties broken by node id. A lazy input (`{"lazy": True}`) is not
followed until its node asks for it (check_lazy_status, executor.py), so the branch an If/Else switch does not take
never runs.
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


def output_node_ids(graph: Graph, node_mappings: dict) -> list[str]:
    return [node_id for node_id in sorted_node_ids(graph)
            if getattr(node_mappings.get(graph[node_id].class_type), "OUTPUT_NODE", False) is True]


def needed_node_ids(graph: Graph, node_mappings: dict) -> set[str]:
    """The output nodes and every node they depend on through any link, lazy ones included (what ComfyUI
    validates); empty without an output node. Links to nodes the graph lacks are left to validation."""
    needed, stack = set(), output_node_ids(graph, node_mappings)
    while stack:
        node_id = stack.pop()
        if node_id not in needed and node_id in graph:
            needed.add(node_id)
            stack.extend(upstream_ids(graph, node_id))
    return needed


def upstream_ids(graph: Graph, node_id: str) -> list[str]:
    return [value.from_id for value in graph[node_id].inputs.values() if isinstance(value, Link)]


class ExecutionList:
    """What runs next, as ComfyUI's ExecutionList decides it, one node at a time: the targets and what they need
    through non-lazy links, each node after its sources, ties broken by node id. A lazy input's source joins only
    when require() is called for it (its node's check_lazy_status asked for it); until then the node does not see
    that input's value, even if the source ran for another node (ComfyUI passes None for it)."""

    def __init__(self, graph: Graph, targets, lazy_inputs: dict[str, set[str]]):
        self.graph = graph
        self._unrequested = {node_id: set(names) for node_id, names in lazy_inputs.items()}
        self._rank = {node_id: position for position, node_id in enumerate(sorted_node_ids(graph))}
        self.pending: set[str] = set()
        self.done: set[str] = set()
        for node_id in targets:
            self._add(node_id)

    def sources(self, node_id: str) -> set[str]:
        """The nodes whose outputs `node_id` receives now: its non-lazy links and the lazy ones it asked for."""
        lazy = self._unrequested.get(node_id, set())
        return {value.from_id for name, value in self.graph[node_id].inputs.items()
                if isinstance(value, Link) and name not in lazy}

    def next_node(self) -> str | None:
        ready = [node_id for node_id in self.pending if self.sources(node_id) <= self.done]
        return min(ready, key=self._rank.__getitem__) if ready else None

    def require(self, node_id: str, names) -> None:
        """`node_id`'s lazy inputs `names` are needed: their sources (and what those need) run before it."""
        self._unrequested.get(node_id, set()).difference_update(names)
        for name in names:
            self._add(self.graph[node_id].inputs[name].from_id)

    def finish(self, node_id: str) -> None:
        self.pending.discard(node_id)
        self.done.add(node_id)

    @property
    def total(self) -> int:
        return len(self.pending) + len(self.done)

    def _add(self, node_id: str) -> None:
        stack = [node_id]
        while stack:
            current = stack.pop()
            if current not in self.pending and current not in self.done:
                self.pending.add(current)
                stack.extend(self.sources(current))


def raise_on_cycle(graph: Graph, node_ids) -> None:
    """ComfyUI refuses a cycle at validation, lazy links included: so do we, before anything runs. Depth-first
    search; a back edge is a cycle, reported as the path that closes it."""
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
            if source not in state and source in graph:
                visit(source)
        path.pop()
        state[node_id] = "done"

    for node_id in sorted_node_ids(node_ids):
        if node_id not in state:
            visit(node_id)

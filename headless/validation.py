"""Checking a whole graph against its node classes before anything runs.

Everything that can be known without running a node is checked here, and all problems are reported
together, so a typo in the last node fails in a second instead of after an hour of training.
Mirrors ComfyUI's validate_inputs (execution.py): required inputs present, link targets and types,
literal conversion, min/max, combo choices, and the node's own VALIDATE_INPUTS.
"""
from __future__ import annotations

import difflib
import inspect

from .graph import Graph, Link, NodeSpec, WorkflowError, describe_node, sorted_node_ids
from .input_spec import WIDGET_TYPES, InputSpec, hidden_inputs, node_input_specs
from .literal_values import checked_value
from .node_type_lookup import unknown_node_type_problem


def validate_graph(graph: Graph, node_mappings: dict) -> Graph:
    """A copy of `graph` with literals converted and optional defaults filled; raises WorkflowError."""
    problems: list[str] = []
    validated: Graph = {}
    for node_id in sorted_node_ids(graph):
        node = graph[node_id]
        node_class = node_mappings.get(node.class_type)
        if node_class is None:
            problems.append(unknown_node_type_problem(node_id, node.class_type, node_mappings))
            continue
        node_problems: list[str] = []
        inputs = _validated_inputs(node, node_class, graph, node_mappings, node_problems)
        label = describe_node(node_id, node.class_type)
        problems.extend(f"{label} {p}" for p in node_problems)
        validated[node_id] = NodeSpec(node.class_type, inputs, node.title)
    if problems:
        raise WorkflowError(problems)
    return validated


def _validated_inputs(node: NodeSpec, node_class, graph: Graph, node_mappings: dict, problems: list[str]) -> dict:
    for flag in ("INPUT_IS_LIST", "OUTPUT_IS_LIST"):
        declared = getattr(node_class, flag, False)  # OUTPUT_IS_LIST is per output: (False, True, ...)
        if any(declared) if isinstance(declared, (list, tuple)) else declared:
            problems.append(f"uses {flag}, which the headless runner does not support: run it inside ComfyUI")
    specs = node_input_specs(node_class)
    hidden = hidden_inputs(node_class)
    self_checked = _self_validated_names(node_class)
    inputs = {}
    for name in node.inputs:
        if name not in specs and name not in hidden:
            close = difflib.get_close_matches(name, list(specs), n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            problems.append(f"has no input '{name}' ({hint}its inputs: {', '.join(specs) or 'none'}): "
                            f"fix or remove it")
    for name, spec in specs.items():
        if name not in node.inputs:
            if spec.required:
                problems.append(f"is missing required input '{name}' ({_type_text(spec)}): {_how_to_supply(spec)}")
            elif spec.is_widget and spec.has_default:
                inputs[name] = spec.default  # ComfyUI's frontend would have saved the default
            continue
        value = node.inputs[name]
        try:
            if isinstance(value, Link):
                _check_link(spec, value, graph, node_mappings)
                inputs[name] = value
            else:
                inputs[name] = _checked_literal(spec, value, check_limits=name not in self_checked)
        except ValueError as exc:
            problems.append(f"input '{name}' {exc}")
    if not problems:
        _run_node_validator(node_class, inputs, graph, node_mappings, problems)
    return inputs


def _checked_literal(spec: InputSpec, value, *, check_limits: bool):
    if spec.type not in WIDGET_TYPES and spec.type != "*":
        raise ValueError(f"is the literal {value!r}, but a {spec.type} must come from another node: "
                         f"link a node that outputs {spec.type}")
    return checked_value(spec, value, check_limits=check_limits)


def _check_link(spec: InputSpec, link: Link, graph: Graph, node_mappings: dict) -> None:
    source = graph.get(link.from_id)
    if source is None:
        raise ValueError(f"is linked to node {link.from_id}, which is not in the workflow (or is muted): "
                         f"link it to an existing node")
    source_class = node_mappings.get(source.class_type)
    if source_class is None:
        return  # reported against the source node itself
    outputs = tuple(getattr(source_class, "RETURN_TYPES", ()))
    source_label = describe_node(link.from_id, source.class_type)
    if not 0 <= link.output_index < len(outputs):
        raise ValueError(f"is linked to output {link.output_index} of {source_label}, which has "
                         f"{len(outputs)} output(s): link an existing output")
    received = outputs[link.output_index]
    if not output_feeds_input(received, spec.type):
        raise ValueError(f"needs {_type_text(spec)} but is linked to output {link.output_index} of {source_label}, "
                         f"which gives {received if isinstance(received, str) else 'COMBO'}: link a matching output")


def output_feeds_input(received, expected: str) -> bool:
    """ComfyUI's validate_node_input (non-strict): equal, "*" on either side, or overlapping "A,B" unions."""
    if isinstance(received, (list, tuple)):
        return expected in ("COMBO", "*")
    if received == expected or "*" in (received, expected):
        return True
    received_set = {t.strip() for t in str(received).split(",")}
    expected_set = {t.strip() for t in str(expected).split(",")}
    return "*" in received_set | expected_set or bool(received_set & expected_set)


def _self_validated_names(node_class) -> set[str]:
    """Inputs the node's VALIDATE_INPUTS takes over: ComfyUI skips its own range/choice checks for them."""
    validator = getattr(node_class, "VALIDATE_INPUTS", None)
    if validator is None:
        return set()
    argspec = inspect.getfullargspec(validator)
    if argspec.varkw is not None:
        return set(node_input_specs(node_class))
    return set(argspec.args) | set(argspec.kwonlyargs)


def _run_node_validator(node_class, inputs: dict, graph: Graph, node_mappings: dict, problems: list[str]) -> None:
    validator = getattr(node_class, "VALIDATE_INPUTS", None)
    if validator is None:
        return
    argspec = inspect.getfullargspec(validator)
    wanted = set(argspec.args) | set(argspec.kwonlyargs)
    # linked values don't exist yet: ComfyUI passes None for them at validation time, so do we
    arguments = {name: (None if isinstance(value, Link) else value) for name, value in inputs.items()
                 if argspec.varkw is not None or name in wanted}
    if "input_types" in wanted:
        arguments["input_types"] = {name: _received_type(value, graph, node_mappings)
                                    for name, value in inputs.items() if isinstance(value, Link)}
    verdict = validator(**arguments)
    if verdict is not True:
        problems.append(f"failed its own input check: {verdict if verdict is not False else 'invalid inputs'}")


def _received_type(link: Link, graph: Graph, node_mappings: dict):
    source_class = node_mappings.get(graph[link.from_id].class_type) if link.from_id in graph else None
    return getattr(source_class, "RETURN_TYPES", ())[link.output_index] if source_class else None


def _type_text(spec: InputSpec) -> str:
    return "a COMBO choice" if spec.type == "COMBO" else f"a {spec.type}"


def _how_to_supply(spec: InputSpec) -> str:
    if spec.is_widget:
        return "set it in the node (API format: add it to the node's inputs)"
    return f"link a node that outputs {spec.type}"

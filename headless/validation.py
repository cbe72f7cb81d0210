"""Checking a graph against its node classes before anything runs.

Everything that can be known without running a node is checked here, and all problems are reported together, so a
typo in the last node fails in a second instead of after an hour of training. Mirrors ComfyUI's validate_prompt and
validate_inputs (execution.py): every node's type must be known, the graph needs an output node, and the nodes that
feed an output node (only those: a disconnected side branch neither runs nor is checked) get their required inputs,
link targets and types, literal conversion, min/max and combo choices checked, then the node's own VALIDATE_INPUTS (a
V3 node's validate_inputs), which takes over the range and choice checks of the inputs it names, and the type check of
linked inputs when it takes `input_types`. A V3 node's dynamic inputs are expanded first, as ComfyUI does.

A node type the mappings lack gets an explanation: headless runs have Tightrope's nodes, plus ComfyUI's core and
comfy_extras nodes when ComfyUI is loaded as a library (`--comfyui DIR` / COMFYUI_DIR; comfyui_library.py). A
workflow using ComfyUI's own nodes (a loader, a sampler) without it gets a message naming that option instead of a
bare "unknown node"; nodes of other packs need ComfyUI.
"""
from __future__ import annotations

import asyncio
import difflib
import inspect

from .comfyui_v3 import MATCH_TYPE, call_validate_inputs, is_v3_node, own_hook
from .graph import (Graph, Link, NodeSpec, WorkflowError, describe_node, needed_node_ids, output_node_ids,
                    sorted_node_ids)
from .input_spec import WIDGET_TYPES, InputSpec, checked_value, hidden_inputs, live_input_specs


def validate_graph(graph: Graph, node_mappings: dict) -> Graph:
    """A copy of `graph` whose nodes that feed an output node are checked, their literals converted and optional
    defaults filled (the others are kept as written: like ComfyUI, they neither run nor are checked, but nodes asking
    for the hidden PROMPT see them); raises WorkflowError."""
    problems: list[str] = []
    needed = needed_node_ids(graph, node_mappings)
    validated: Graph = dict(graph)
    for node_id in sorted_node_ids(graph):
        node = graph[node_id]
        node_class = node_mappings.get(node.class_type)
        if node_class is None:
            problems.append(unknown_node_type_problem(node_id, node.class_type, node_mappings))
            continue
        if node_id not in needed:
            continue
        node_problems: list[str] = []
        inputs = _validated_inputs(node_id, node, node_class, graph, node_mappings, node_problems)
        label = describe_node(node_id, node.class_type)
        problems.extend(f"{label} {p}" for p in node_problems)
        validated[node_id] = NodeSpec(node.class_type, inputs, node.title)
    if not problems and not output_node_ids(graph, node_mappings):
        problems.append(no_output_problem(node_mappings))
    if problems:
        raise WorkflowError(problems)
    return validated


def no_output_problem(node_mappings: dict) -> str:
    """ComfyUI's "Prompt has no outputs", with the fix."""
    names = []
    for name, node_class in node_mappings.items():
        try:
            if getattr(node_class, "OUTPUT_NODE", False) is True:
                names.append(name)
        except Exception:  # a broken V3 schema: not ours to report here
            continue
    names.sort(key=lambda name: (not name.startswith("Tightrope"), name))
    shown = ", ".join(names[:6]) + (f", ... ({len(names)} in all)" if len(names) > 6 else "")
    return (f"the workflow has no output node, so nothing in it would run (ComfyUI refuses it too: 'Prompt has no "
            f"outputs'): add an output node ({shown or 'none is loaded'}) and link what should run into it")


def _validated_inputs(node_id: str, node: NodeSpec, node_class, graph: Graph, node_mappings: dict,
                      problems: list[str]) -> dict:
    for flag in ("INPUT_IS_LIST", "OUTPUT_IS_LIST"):
        declared = getattr(node_class, flag, False)  # OUTPUT_IS_LIST is per output: (False, True, ...)
        if any(declared) if isinstance(declared, (list, tuple)) else declared:
            problems.append(f"uses {flag}, which the headless runner does not support: run it inside ComfyUI")
    specs = live_input_specs(node_class, node.inputs)
    hidden = hidden_inputs(node_class)
    validator = node_validator(node_class)
    self_checked = _self_validated_names(node_class, validator, specs)
    takes_types = validator is not None and "input_types" in inspect.getfullargspec(validator).args
    accepts_all = is_v3_node(node_class) and node_class.ACCEPT_ALL_INPUTS is True
    inputs = {}
    for name in node.inputs:
        if accepts_all and name not in specs:
            inputs[name] = node.inputs[name]  # a V3 node taking any input (ACCEPT_ALL_INPUTS) gets it as it is
        elif name not in specs and name not in hidden:
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
                _check_link(spec, value, graph, node_mappings, check_type=not takes_types)
                inputs[name] = value
            else:
                inputs[name] = _checked_literal(spec, value, check_limits=name not in self_checked)
        except ValueError as exc:
            problems.append(f"input '{name}' {exc}")
    if not problems and validator is not None:
        _run_node_validator(node_id, node_class, validator, inputs, graph, node_mappings, problems)
    return inputs


def node_validator(node_class):
    """The node's own input check, as ComfyUI finds it: VALIDATE_INPUTS, or a V3 node's validate_inputs."""
    if is_v3_node(node_class):
        return own_hook(node_class, "validate_inputs")
    return getattr(node_class, "VALIDATE_INPUTS", None)


def _checked_literal(spec: InputSpec, value, *, check_limits: bool):
    if spec.type not in WIDGET_TYPES and spec.type != "*":
        raise ValueError(f"is the literal {value!r}, but a {spec.type} must come from another node: "
                         f"link a node that outputs {spec.type}")
    return checked_value(spec, value, check_limits=check_limits)


def _check_link(spec: InputSpec, link: Link, graph: Graph, node_mappings: dict, *, check_type: bool = True) -> None:
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
    if check_type and not output_feeds_input(received, spec.type):
        raise ValueError(f"needs {_type_text(spec)} but is linked to output {link.output_index} of {source_label}, "
                         f"which gives {received if isinstance(received, str) else 'COMBO'}: link a matching output")


def output_feeds_input(received, expected: str) -> bool:
    """ComfyUI's validate_node_input (non-strict): equal, "*" or a V3 MatchType on either side, or overlapping "A,B"
    unions."""
    if isinstance(received, (list, tuple)):
        return expected in ("COMBO", "*")
    if received == expected or "*" in (received, expected) or MATCH_TYPE in (received, expected):
        return True
    received_set = {t.strip() for t in str(received).split(",")}
    expected_set = {t.strip() for t in str(expected).split(",")}
    return "*" in received_set | expected_set or bool(received_set & expected_set)


def _self_validated_names(node_class, validator, specs: dict) -> set[str]:
    """Inputs the node's validator takes over: ComfyUI skips its own range/choice checks for them."""
    if validator is None:
        return set()
    argspec = inspect.getfullargspec(validator)
    if argspec.varkw is not None:
        return set(specs)
    return set(argspec.args) | set(argspec.kwonlyargs)


def _run_node_validator(node_id: str, node_class, validator, inputs: dict, graph: Graph, node_mappings: dict,
                        problems: list[str]) -> None:
    received = {name: _received_type(value, graph, node_mappings) for name, value in inputs.items()
                if isinstance(value, Link)}
    try:
        if is_v3_node(node_class):
            verdicts = call_validate_inputs(node_class, node_id, inputs, received)
        else:
            verdicts = [_call_v1_validator(node_id, node_class, validator, inputs, received)]
    except Exception as exc:  # ComfyUI reports it as the node's validation error too
        problems.append(f"failed its own input check: it raised {type(exc).__name__}: {exc}; check the node's inputs "
                        f"(if they are right, this is a bug in the node)")
        return
    for verdict in verdicts:
        if verdict is not True and type(verdict).__name__ != "ExecutionBlocker":
            problems.append(f"failed its own input check: {verdict if verdict is not False else 'invalid inputs'}")
            return


def _call_v1_validator(node_id: str, node_class, validator, inputs: dict, received: dict):
    """VALIDATE_INPUTS called as ComfyUI calls it: literal inputs, None for linked ones (not computed yet), the hidden
    inputs it names (UNIQUE_ID; PROMPT is {} at this point in ComfyUI), `input_types` {linked input: its type}."""
    argspec = inspect.getfullargspec(validator)
    wanted = set(argspec.args) | set(argspec.kwonlyargs)
    arguments = {name: (None if isinstance(value, Link) else value) for name, value in inputs.items()}
    for name, kind in hidden_inputs(node_class).items():
        arguments[name] = node_id if kind == "UNIQUE_ID" else {} if kind == "PROMPT" else None
    arguments = {name: value for name, value in arguments.items() if argspec.varkw is not None or name in wanted}
    if "input_types" in wanted:
        arguments["input_types"] = received
    verdict = validator(**arguments)
    return asyncio.run(_awaited(verdict)) if inspect.isawaitable(verdict) else verdict


async def _awaited(awaitable):
    return await awaitable


def _received_type(link: Link, graph: Graph, node_mappings: dict):
    source_class = node_mappings.get(graph[link.from_id].class_type) if link.from_id in graph else None
    return getattr(source_class, "RETURN_TYPES", ())[link.output_index] if source_class else None


def _type_text(spec: InputSpec) -> str:
    return "a COMBO choice" if spec.type == "COMBO" else f"a {spec.type}"


def _how_to_supply(spec: InputSpec) -> str:
    if spec.is_widget:
        return "set it in the node (API format: add it to the node's inputs)"
    return f"link a node that outputs {spec.type}"


# ComfyUI core node types people most often mix into a training workflow (nodes.py plus the training,
# sampling and primitive extras). Not exhaustive: UI-format files also say `cnr_id: "comfy-core"`.
KNOWN_CORE_NODE_TYPES = frozenset("""
KSampler KSamplerAdvanced CheckpointLoaderSimple CheckpointLoader CLIPTextEncode CLIPSetLastLayer VAEDecode VAEEncode
VAEEncodeForInpaint VAELoader EmptyLatentImage LatentUpscale LatentUpscaleBy LatentFromBatch RepeatLatentBatch SaveImage
PreviewImage LoadImage LoadImageMask LoadImageOutput ImageScale ImageScaleBy ImageInvert ImageBatch ImagePadForOutpaint
EmptyImage ConditioningAverage ConditioningCombine ConditioningConcat ConditioningMultiply ConditioningSetArea
ConditioningSetAreaPercentage ConditioningSetAreaStrength ConditioningSetMask SetLatentNoiseMask LatentComposite
LatentBlend LatentRotate LatentFlip LatentCrop LoraLoader LoraLoaderModelOnly CLIPLoader UNETLoader DualCLIPLoader
CLIPVisionEncode CLIPVisionLoader StyleModelApply StyleModelLoader unCLIPConditioning unCLIPCheckpointLoader
ControlNetApply ControlNetApplyAdvanced ControlNetLoader DiffControlNetLoader VAEDecodeTiled VAEEncodeTiled GLIGENLoader
GLIGENTextBoxApply InpaintModelConditioning DiffusersLoader LoadLatent SaveLatent ConditioningZeroOut
ConditioningSetTimestepRange TrainLoraNode LoraModelLoader SaveLoRA LossGraphNode LoadImageDataSetFromFolder
LoadImageTextDataSetFromFolder MakeTrainingDataset SaveTrainingDataset LoadTrainingDataset ResolutionBucket
SamplerCustom SamplerCustomAdvanced BasicScheduler BasicGuider CFGGuider KSamplerSelect RandomNoise DisableNoise
CLIPTextEncodeFlux FluxGuidance EmptySD3LatentImage ModelSamplingFlux ModelSamplingSD3 ModelSamplingAuraFlow
PrimitiveString PrimitiveStringMultiline PrimitiveInt PrimitiveFloat PrimitiveBoolean PreviewAny
""".split())
OWN_PACKAGE_ID = "tightrope"  # the `cnr_id` of Tightrope's own nodes (pyproject.toml's [project] name)
CORE_PACKAGE_ID = "comfy-core"  # the `properties.cnr_id` the frontend stamps on core nodes
CORE_MARKER_NODE = "KSampler"  # in the node mappings: ComfyUI's core nodes are loaded


def unknown_node_type_problem(node_id: str, class_type: str, node_mappings: dict, *, package: str | None = None) -> str:
    """The message for a node type that `node_mappings` lacks; `package` is the UI format's `cnr_id`, if any."""
    node = describe_node(node_id, class_type)
    inside_comfyui = "run this workflow inside ComfyUI (load it in the UI, or POST it to /prompt)"
    core_loaded = CORE_MARKER_NODE in node_mappings
    if not core_loaded and (package == CORE_PACKAGE_ID or (package is None and class_type in KNOWN_CORE_NODE_TYPES)):
        return (f"{node} is a ComfyUI core node, not a Tightrope node: run it with ComfyUI's nodes: pass --comfyui "
                f"DIR (or set COMFYUI_DIR) to your ComfyUI folder, in the python ComfyUI runs in; or {inside_comfyui}")
    if package == CORE_PACKAGE_ID:
        return (f"{node} is not among the core nodes of the loaded ComfyUI: update ComfyUI (the workflow was saved "
                f"by a newer one), or {inside_comfyui}")
    if package == OWN_PACKAGE_ID:
        close = difflib.get_close_matches(class_type, list(node_mappings), n=1, cutoff=0.6)
        return (f"{node} is a Tightrope node this version of Tightrope does not have (the workflow was saved with "
                f"another version{f'; this one has {close[0]!r}' if close else ''}): update Tightrope, or replace "
                "the node in ComfyUI and save the workflow again")
    if package:
        comfyui = "" if core_loaded else " --comfyui DIR"
        return (f"{node} comes from the '{package}' node pack: load that pack too, with{comfyui} --custom-node "
                f"PACK_DIR (its folder under ComfyUI/custom_nodes; repeat it for each pack), or {inside_comfyui} "
                "with that pack installed")
    close = difflib.get_close_matches(class_type, list(node_mappings), n=1, cutoff=0.8)
    if close:
        return f"{node} is not a Tightrope node type: did you mean '{close[0]}'? Fix the type name in the workflow"
    names = sorted(node_mappings)
    known = ", ".join(names[:30]) + (f", ... ({len(names)} in all)" if len(names) > 30 else "") or "none loaded"
    comfyui = ("--custom-node PACK_DIR (its folder under ComfyUI/custom_nodes)" if core_loaded else
               "--comfyui DIR (and --custom-node PACK_DIR for another pack's node)")
    return (f"{node} is not a Tightrope node type (Tightrope's: {known}): if it comes from ComfyUI or another "
            f"node pack, load it with {comfyui}, or {inside_comfyui}; otherwise fix the type name")

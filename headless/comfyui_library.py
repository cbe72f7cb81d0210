"""ComfyUI as a library, no server: its core and comfy_extras nodes for `tightrope run --comfyui DIR`.

With custom_nodes.py (`--custom-node`), the only module of the headless runner that imports ComfyUI, and only inside
load_comfyui() (lazily: `tightrope run` without ComfyUI never imports it). Loading does what ComfyUI's main.py does
before it serves, minus the server: ComfyUI's source dir goes first on sys.path, its arguments are parsed from an
empty command line (comfy.options keeps args parsing off for library use, so our sys.argv is never read) with `--cpu`
when torch has no CUDA, and nodes.init_extra_nodes() loads the comfy_extras nodes (not API nodes; custom nodes only
those named with `--custom-node`). A process loads one ComfyUI once: its modules stay imported, as in ComfyUI itself.

A run then happens inside run_folders(): ComfyUI's output and temp folders become the run's output folder (SaveImage
and PreviewImage write there), the LoRA folder the run writes into and `--models-dir` are added to its model folders,
and extra_model_paths.yaml is read the way main.py reads it; everything is put back on exit. Nodes (ComfyUI's and
Tightrope's alike) are called through ComfyUI's own execution helpers (get_input_data, _async_map_node_over_list,
get_output_from_returns), so V3 (comfy_api) nodes, hidden inputs and async nodes behave as in the server.

Without ComfyUI, its Primitive* value nodes (Int, Float, Text, Boolean) are re-declared here so headless runs accept
them: core nodes, but trivial (value in, same value out), and workflows use them to share one seed or prompt between
nodes. Same type names and widgets as comfy_extras/nodes_primitive.py, so a saved workflow's widgets_values line up.
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import inspect
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from .executor import node_object
from .graph import Link, NodeSpec, WorkflowError, describe_node
from .input_spec import node_input_specs
from .model_files import MODEL_INPUT_FOLDERS, missing_file_hint, model_file_failure


COMFYUI_DIR_ENV = "COMFYUI_DIR"
OLDEST_SUPPORTED = (0, 33)  # execution.get_input_data(..., extra_data) and the V3 node API; tested: 0.33.0
HOW_TO_POINT = f"pass --comfyui DIR (or set {COMFYUI_DIR_ENV}) to the folder holding ComfyUI's main.py and nodes.py"


class ComfyUIUnavailable(WorkflowError):
    """The ComfyUI dir is missing, is not a ComfyUI, is too old, or its nodes fail to import."""


class CoreNodeFailed(WorkflowError):
    """A ComfyUI node raised while running; the message is its exception's, the original is `__cause__`."""


@dataclass(frozen=True)
class ComfyUILibrary:
    directory: Path
    version: str
    node_mappings: dict  # ComfyUI's NODE_CLASS_MAPPINGS (core + comfy_extras), as loaded

    def call_node(self, node_id: str, node: NodeSpec, node_class, results: dict, context: dict):
        """Run one node the way ComfyUI's executor does; returns {"ui": ..., "result": tuple of outputs}."""
        try:
            return asyncio.run(_call_node(node_id, node, node_class, results, context))
        except Exception as exc:
            if self.node_mappings.get(node.class_type) is node_class:
                message = model_file_failure(node, exc, self.version) or f"{type(exc).__name__}: {exc}"
                raise CoreNodeFailed(message) from exc
            raise  # Tightrope's own nodes raise their own errors (user errors stay user errors)

    def lazy_status(self, node_id: str, node: NodeSpec, node_class, results: dict, context: dict) -> list[str]:
        """Which lazy inputs not yet received the node asks for, asked the way ComfyUI's executor asks (see LazyStatus
        in executor.py)."""
        return asyncio.run(_lazy_status(node_id, node, node_class, results, context))

    def explain_model_files(self, error: WorkflowError, graph: dict) -> WorkflowError:
        """`error` (from validating `graph`) with each problem about a model-file input (UNETLoader's unet_name, ...)
        whose file is in no model folder replaced by one naming the file and the folders searched."""
        missing = self._missing_model_files(graph)
        return WorkflowError([next((message for prefix, message in missing.items() if problem.startswith(prefix)),
                                   problem) for problem in error.problems])

    def _missing_model_files(self, graph: dict) -> dict[str, str]:
        """{the start of validation's problem for the input: the model-file message} per missing model file."""
        import folder_paths
        missing = {}
        for node_id, node in graph.items():
            node_class = self.node_mappings.get(node.class_type)
            if node_class is None:
                continue
            for name, spec in node_input_specs(node_class).items():
                value, choices = node.inputs.get(name), list(spec.choices or ())
                if spec.type != "COMBO" or isinstance(value, Link) or not isinstance(value, str) or value in choices:
                    continue
                folders = MODEL_INPUT_FOLDERS.get((node.class_type, name)) or _listing_folders(choices)
                if not folders:
                    continue
                searched = [p for folder in folders for p in folder_paths.get_folder_paths(folder)]
                prefix = f"{describe_node(node_id, node.class_type)} input '{name}'"
                missing[f"{prefix} "] = (
                    f"{prefix}: model file {value!r} not found in ComfyUI's {' or '.join(folders)} folders "
                    f"({', '.join(searched)}): " + missing_file_hint(folder_paths, value, folders, searched, choices))
        return missing

    @contextlib.contextmanager
    def run_folders(self, output_dir: str | os.PathLike, loras_dir: str | os.PathLike,
                    models_dir: str | os.PathLike | None = None) -> Iterator[None]:
        """ComfyUI's folders for one run (see the module docstring); restored on exit."""
        import folder_paths
        saved = (copy.deepcopy(folder_paths.folder_names_and_paths), folder_paths.get_output_directory(),
                 folder_paths.get_temp_directory())
        try:
            config = self.directory / "extra_model_paths.yaml"
            if config.is_file():
                from utils.extra_config import load_extra_path_config
                load_extra_path_config(str(config))
            if models_dir is not None:
                _add_models_dir(folder_paths, Path(models_dir))
            folder_paths.add_model_folder_path("loras", str(loras_dir))
            folder_paths.set_output_directory(str(output_dir))
            folder_paths.set_temp_directory(str(output_dir))
            folder_paths.filename_list_cache.clear()
            import nodes
            nodes.interrupt_processing(False)
            with _no_server():
                yield
        finally:
            folder_paths.folder_names_and_paths.clear()
            folder_paths.folder_names_and_paths.update(saved[0])
            folder_paths.set_output_directory(saved[1])
            folder_paths.set_temp_directory(saved[2])
            folder_paths.filename_list_cache.clear()


class _NodeReplacements:
    """Stands in for the server's node_replace_manager: the UI's list of renamed nodes, which headless (API and
    UI-format files as saved) needs none of."""

    def register(self, *args, **kwargs) -> None:
        pass


class _NoServer:
    """Stands in for PromptServer.instance while no server runs: nodes that report to the UI (GetImageSize's
    send_progress_text, say) raised AttributeError headless; their messages go nowhere, as with no browser open.
    Also while ComfyUI's nodes load: comfy_extras/nodes_replacements.py registers the UI's node replacements with
    the server, and without one it printed "IMPORT FAILED ... pip install -r requirements.txt" at every run."""
    client_id = None
    last_node_id = None
    node_replace_manager = _NodeReplacements()

    def send_sync(self, *args, **kwargs) -> None:
        pass

    def send_progress_text(self, *args, **kwargs) -> None:
        pass


@contextlib.contextmanager
def _no_server() -> Iterator[None]:
    """_NoServer as ComfyUI's PromptServer.instance for one run, if ComfyUI's server module is loaded and has none."""
    server = sys.modules.get("server")
    prompt_server = getattr(server, "PromptServer", None)
    if prompt_server is None or getattr(prompt_server, "instance", None) is not None:
        yield
        return
    prompt_server.instance = _NoServer()
    try:
        yield
    finally:
        del prompt_server.instance


async def _call_node(node_id: str, node: NodeSpec, node_class, results: dict, context: dict):
    import execution
    arguments, _missing, v3_data = _input_data(node_id, node, node_class, results, context)
    obj = node_object(node_id, node_class, context)
    returned = await execution._async_map_node_over_list(
        "tightrope-run", node_id, obj, arguments, obj.FUNCTION, allow_interrupt=True, v3_data=v3_data)
    returned = await execution.resolve_map_node_over_list_results(returned)
    outputs, ui, expanded = execution.get_output_from_returns(returned, obj)
    if expanded:
        return {"expand": True}  # the executor explains that graph expansion needs the server
    return {"ui": ui, "result": tuple(values[0] if values else None for values in outputs)}


async def _lazy_status(node_id: str, node: NodeSpec, node_class, results: dict, context: dict) -> list[str]:
    """execution.execute's check_lazy_status step: V3 nodes only if they define one, V1 nodes if their object has one;
    of the names returned, those of inputs missing or not computed."""
    import execution
    from comfy_api.internal import _ComfyNodeInternal, first_real_override
    arguments, missing, v3_data = _input_data(node_id, node, node_class, results, context)
    obj = node_object(node_id, node_class, context)
    if issubclass(node_class, _ComfyNodeInternal):
        present = first_real_override(node_class, "check_lazy_status") is not None
    else:
        present = getattr(obj, "check_lazy_status", None) is not None
    if not present:
        return []
    returned = await execution._async_map_node_over_list(
        "tightrope-run", node_id, obj, arguments, "check_lazy_status", allow_interrupt=True,
        v3_data={**v3_data, "create_dynamic_tuple": True})
    returned = await execution.resolve_map_node_over_list_results(returned)
    names = set(sum([r for r in returned if isinstance(r, list)], []))
    return sorted(x for x in names if isinstance(x, str) and (x not in arguments or x in missing))


def _input_data(node_id: str, node: NodeSpec, node_class, results: dict, context: dict):
    """execution.get_input_data for the node: its arguments (lists), the inputs not computed, its V3 data."""
    import execution
    from comfy_execution.graph import DynamicPrompt
    inputs = {name: ([value.from_id, value.output_index] if isinstance(value, Link) else value)
              for name, value in node.inputs.items()}
    extra_data = {"extra_pnginfo": context.get("EXTRA_PNGINFO")}
    return execution.get_input_data(inputs, node_class, node_id, _ComputedOutputs(results),
                                    DynamicPrompt(context.get("PROMPT") or {}), extra_data)


class _ComputedOutputs:
    """The slice of ComfyUI's ExecutionList that get_input_data reads: a finished node's outputs, one list each."""

    def __init__(self, results: dict):
        self.results = results

    def get_cache(self, from_id: str, _to_id: str):
        produced = self.results.get(from_id)
        return None if produced is None else _Cached([[value] for value in produced])


@dataclass(frozen=True)
class _Cached:
    outputs: list


def _listing_folders(choices: list) -> tuple[str, ...]:
    """The model folders whose file list is exactly `choices` (how an unknown loader's input is recognised)."""
    import folder_paths
    if not choices:
        return ()
    return tuple(name for name in folder_paths.folder_names_and_paths
                 if name != "custom_nodes" and folder_paths.get_filename_list(name) == list(choices))


def _add_models_dir(folder_paths, models_dir: Path) -> None:
    """`models_dir` laid out like ComfyUI's models/ folder, searched before it."""
    if not models_dir.is_dir():
        raise WorkflowError(f"--models-dir {str(models_dir)!r} is not a folder: pass the folder that holds "
                            f"diffusion_models/, text_encoders/, vae/, loras/ ...")
    base = os.path.abspath(folder_paths.models_dir)
    for name, (paths, _extensions) in list(folder_paths.folder_names_and_paths.items()):
        for path in list(paths):
            if os.path.dirname(os.path.abspath(path)) == base:
                folder_paths.add_model_folder_path(name, str(models_dir / os.path.basename(path)), is_default=True)


# ------------------------------------------------------------------------------------------------------ loading
_loaded: dict[Path, ComfyUILibrary] = {}


def comfyui_dir(option: str | None, workflow: dict, node_mappings: dict, environ=os.environ) -> str | None:
    """The ComfyUI dir a run loads: --comfyui; else $COMFYUI_DIR when the workflow has node types that
    `node_mappings` (Tightrope's) lacks; else None: a workflow of Tightrope's nodes runs as without ComfyUI."""
    if option:
        return option
    if environ.get(COMFYUI_DIR_ENV) and _node_types(workflow) - set(node_mappings):
        return environ[COMFYUI_DIR_ENV]
    return None


def _node_types(workflow: dict) -> set[str]:
    """The node types a workflow file runs (UI format: not muted, bypassed or frontend-only; API format: all)."""
    from .ui_format import COMMENT_NODE_TYPES, MODE_BYPASSED, MODE_MUTED, PASS_THROUGH_NODE_TYPES
    if isinstance(workflow, dict) and isinstance(workflow.get("nodes"), list):
        run = {str(node.get("type")) for node in workflow["nodes"] if isinstance(node, dict)
               and node.get("mode", 0) not in (MODE_MUTED, MODE_BYPASSED)}
        return run - COMMENT_NODE_TYPES - PASS_THROUGH_NODE_TYPES
    prompt = workflow.get("prompt", workflow) if isinstance(workflow, dict) else None
    if not isinstance(prompt, dict):
        return set()  # not a workflow: workflow_format() says so
    return {str(node.get("class_type")) for node in prompt.values() if isinstance(node, dict)}


def load_comfyui(directory: str | os.PathLike) -> ComfyUILibrary:
    """Import ComfyUI from `directory` and load its nodes (once per process); raises ComfyUIUnavailable."""
    path = Path(directory).expanduser().resolve()
    if path in _loaded:
        return _loaded[path]
    version = _checked_dir(path)
    if _loaded:
        other = next(iter(_loaded))
        raise ComfyUIUnavailable(f"this process already loaded the ComfyUI at {other}; one process can load one "
                                 f"ComfyUI: run {path} in a new process")
    shadowing = sys.modules.get("nodes")
    if shadowing is not None and Path(getattr(shadowing, "__file__", "") or "").resolve().parent != path:
        raise ComfyUIUnavailable(f"another module named 'nodes' ({getattr(shadowing, '__file__', '?')}) is already "
                                 f"imported, so ComfyUI's nodes.py cannot be: run from another folder")
    sys.path.insert(0, str(path))
    try:
        import comfy.options  # noqa: F401  (args parsing stays off: ComfyUI parses an empty command line)
        from comfy.cli_args import args
        import torch
        if not torch.cuda.is_available():
            args.cpu = True  # read by comfy.model_management at its import, below
        import execution
        import nodes
    except ImportError as e:  # ComfyUI's requirements are not installed in this python
        sys.path.remove(str(path))
        raise ComfyUIUnavailable(f"the ComfyUI at {path} cannot be imported in this python ({e}): run tightrope with "
                                 f"ComfyUI's python, or install ComfyUI's requirements into this one (pip install -r "
                                 f"{path}/requirements.txt)") from None
    missing = [name for name in ("get_input_data", "_async_map_node_over_list", "resolve_map_node_over_list_results",
                                 "get_output_from_returns") if not hasattr(execution, name)]
    if missing:
        raise ComfyUIUnavailable(f"the ComfyUI at {path} (version {version}) lacks execution.{missing[0]}, which "
                                 f"Tightrope calls nodes with: {_supported_text()}")
    try:
        import server  # noqa: F401  (its PromptServer class, which _no_server gives an instance while nodes load)
    except Exception:  # the nodes that need it fail to load, as before, and say so
        pass
    with _no_server():
        failed = nodes.init_extra_nodes(init_custom_nodes=False, init_api_nodes=False)
        if inspect.isawaitable(failed):
            failed = asyncio.run(failed)
    if "nodes_primitive.py" in (failed or []):
        raise ComfyUIUnavailable(f"ComfyUI's comfy_extras nodes failed to import (see the log above): install "
                                 f"ComfyUI's requirements into this python (pip install -r {path}/requirements.txt)")
    library = ComfyUILibrary(path, version, dict(nodes.NODE_CLASS_MAPPINGS))
    _loaded[path] = library
    return library


def _checked_dir(path: Path) -> str:
    if not path.exists():
        raise ComfyUIUnavailable(f"ComfyUI dir {str(path)!r} does not exist: {HOW_TO_POINT}")
    if not all((path / name).exists() for name in ("nodes.py", "folder_paths.py", "execution.py", "comfy")):
        raise ComfyUIUnavailable(f"{str(path)!r} is not a ComfyUI: it has no nodes.py, folder_paths.py, execution.py "
                                 f"and comfy/; {HOW_TO_POINT}")
    version = comfyui_version(path)
    if version is not None and _version_tuple(version) < OLDEST_SUPPORTED:
        raise ComfyUIUnavailable(f"the ComfyUI at {path} is version {version}: {_supported_text()}")
    return version or "unknown"


def comfyui_version(path: Path) -> str | None:
    """`__version__` from comfyui_version.py (ComfyUI writes it at each release), without importing it."""
    try:
        text = (path / "comfyui_version.py").read_text(encoding="utf-8")
    except OSError:
        return None
    found = re.search(r"""__version__\s*=\s*["']([^"']+)["']""", text)
    return found.group(1) if found else None


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def _supported_text() -> str:
    oldest = ".".join(map(str, OLDEST_SUPPORTED))
    return f"Tightrope's headless runner supports ComfyUI {oldest} and newer; update ComfyUI (git pull)"


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

"""ComfyUI custom node packs for `tightrope run --comfyui DIR --custom-node PACK`: a workflow that uses a pack's
nodes (ComfyUI-GGUF's Unet Loader (GGUF), say) runs headless as in the server. Loaded with ComfyUI's own loader
(nodes.load_custom_node), each pack once per process, as ComfyUI loads the packs in custom_nodes/ (only those named:
a pack can do anything at import, and most workflows need none).
"""
from __future__ import annotations

import asyncio
import inspect
from pathlib import Path

from .comfyui_library import ComfyUILibrary, ComfyUIUnavailable

_loaded: set[Path] = set()


def load_custom_nodes(library: ComfyUILibrary, packs: list[str]) -> None:
    """Load each pack (a folder with an __init__.py, or a .py file) into the loaded ComfyUI; their nodes join
    `library.node_mappings`. A pack that is not one, or fails to import, raises ComfyUIUnavailable naming it (its
    own error is in the log above)."""
    import nodes
    for given in packs:
        path = Path(given).expanduser().resolve()
        if path in _loaded:
            continue
        if path == Path(__file__).resolve().parents[1]:
            raise ComfyUIUnavailable(f"--custom-node {given!r} is Tightrope itself, whose nodes every run has: drop "
                                     "that --custom-node")
        if not ((path.is_file() and path.suffix == ".py") or (path / "__init__.py").is_file()):
            raise ComfyUIUnavailable(f"--custom-node {given!r} is not a custom node pack: pass its folder (the one "
                                     "under ComfyUI/custom_nodes, holding its __init__.py) or a .py node file")
        loaded = nodes.load_custom_node(str(path))
        if inspect.isawaitable(loaded):
            loaded = asyncio.run(loaded)
        if not loaded:
            raise ComfyUIUnavailable(f"the custom node pack {path} failed to load (its error is in the log above): "
                                     f"install its requirements into this python (pip install -r "
                                     f"{path / 'requirements.txt'})")
        _loaded.add(path)
    library.node_mappings.update(nodes.NODE_CLASS_MAPPINGS)

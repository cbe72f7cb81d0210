"""Building ComfyUI API-format prompts: {id: {"class_type", "inputs"}}, links as [node id, output index].

Tightrope nodes get every required widget's default from their INPUT_TYPES, so tests name only what they change."""
from __future__ import annotations

from tightrope import NODE_CLASS_MAPPINGS


def widget_defaults(class_type: str) -> dict:
    cls = NODE_CLASS_MAPPINGS.get(class_type)
    if cls is None:
        return {}
    out = {}
    for name, (kind, opts) in cls.INPUT_TYPES()["required"].items():
        if isinstance(kind, list):
            out[name] = opts.get("default", kind[0])
        elif "default" in opts:
            out[name] = opts["default"]
    return out


class Graph:
    def __init__(self):
        self.nodes: dict[str, dict] = {}

    def add(self, class_type: str, **inputs) -> str:
        node_id = str(len(self.nodes) + 1)
        self.nodes[node_id] = {"class_type": class_type, "inputs": {**widget_defaults(class_type), **inputs}}
        return node_id

    def sample(self, model: list, positive: str, latent: str, prefix: str, steps: int = 3, seed: int = 5) -> str:
        """KSampler (euler, cfg 1) -> SaveLatent under output/`prefix`; returns the SaveLatent node id."""
        ks = self.add("KSampler", model=model, seed=seed, steps=steps, cfg=1.0, sampler_name="euler",
                      scheduler="simple", positive=[positive, 0], negative=[positive, 0], latent_image=[latent, 0],
                      denoise=1.0)
        return self.add("SaveLatent", samples=[ks, 0], filename_prefix=prefix)


def saved_latent(server, entry: dict, node_id: str):
    """The tensor a SaveLatent node wrote (read from the server's output folder)."""
    from safetensors.torch import load_file
    info = entry["outputs"][node_id]["latents"][0]
    return load_file(str(server.base / info.get("type", "output") / info["subfolder"] / info["filename"]))[
        "latent_tensor"]

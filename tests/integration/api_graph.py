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

    def train_flux(self, checkpoint: tuple[str, str], *, prefix: str, images: str, steps: int, **train) -> dict:
        """UNETLoader -> Demo Images -> TAEF1 + demo text encoder -> Load Dataset -> LoRA Setup -> Train -> Save
        LoRA; returns the node ids by role ("unet", "train", "save")."""
        name, weight_dtype = checkpoint
        unet = self.add("UNETLoader", unet_name=name, weight_dtype=weight_dtype)
        folder = self.add("TightropeDemoImages", subfolder=images, count=4, size=64, seed=0)
        vae = self.add("VAELoader", vae_name="taef1")
        encoders = self.add("TightropeDemoEncoders", seed=0)
        dataset = self.add("TightropeLoadDataset", folder=[folder, 0], vae=[vae, 0], clip=[encoders, 1],
                           resolution=64)
        lora = self.add("TightropeLoraSetup", rank=4, alpha=4.0)
        node = self.add("TightropeTrain", steps=steps, device="cpu", filename_prefix=prefix, model=[unet, 0],
                        dataset=[dataset, 0], lora=[lora, 0], **train)
        save = self.add("TightropeSaveLora", session=[node, 0], filename_prefix=f"{prefix}_final")
        return {"unet": unet, "train": node, "save": save}

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

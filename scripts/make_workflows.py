"""Regenerate workflows/*.json (ComfyUI's UI format, drag-and-drop loadable) from compact graph descriptions.

Widget order comes from each node class's INPUT_TYPES, so a saved workflow cannot drift from the nodes' schema.
Run after changing a node's inputs: `python scripts/make_workflows.py`; tests/workflows checks the files.
"""
from __future__ import annotations

import json
from pathlib import Path

from tightrope import NODE_CLASS_MAPPINGS

WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN"}

# ComfyUI core nodes used by the Flux-dev and Wan workflows (ComfyUI 0.33): widgets in order, connection inputs, outputs
CORE = {
    "UNETLoader": (["unet_name", "weight_dtype"], [], ["MODEL"]),
    "DualCLIPLoader": (["clip_name1", "clip_name2", "type", "device"], [], ["CLIP"]),
    "CLIPLoader": (["clip_name", "type", "device"], [], ["CLIP"]),
    "VAELoader": (["vae_name"], [], ["VAE"]),
    "CLIPTextEncode": (["text"], [("clip", "CLIP")], ["CONDITIONING"]),
    "FluxGuidance": (["guidance"], [("conditioning", "CONDITIONING")], ["CONDITIONING"]),
    "EmptySD3LatentImage": (["width", "height", "batch_size"], [], ["LATENT"]),
    "KSampler": (["seed", "control_after_generate", "steps", "cfg", "sampler_name", "scheduler", "denoise"],
                 [("model", "MODEL"), ("positive", "CONDITIONING"), ("negative", "CONDITIONING"),
                  ("latent_image", "LATENT")], ["LATENT"]),
    "VAEDecode": ([], [("samples", "LATENT"), ("vae", "VAE")], ["IMAGE"]),
    "PreviewImage": ([], [("images", "IMAGE")], []),
}


def _schema(node_type: str):
    """(widget names incl. control slots, [(connection input, type)], [(output name, type)])."""
    if node_type in CORE:
        widgets, conns, outs = CORE[node_type]
        return widgets, conns, [(t, t) for t in outs]
    cls = NODE_CLASS_MAPPINGS[node_type]
    spec = cls.INPUT_TYPES()
    widgets, conns = [], []
    for section in ("required", "optional"):
        for name, (kind, *opts) in spec.get(section, {}).items():
            opts = opts[0] if opts else {}
            if isinstance(kind, list) or (kind in WIDGET_TYPES and not opts.get("forceInput")):
                widgets.append(name)
                if kind == "INT" and opts.get("control_after_generate", name in ("seed", "noise_seed")):
                    widgets.append("control_after_generate")
            else:
                conns.append((name, kind))
    names = getattr(cls, "RETURN_NAMES", None) or cls.RETURN_TYPES
    return widgets, conns, list(zip(names, cls.RETURN_TYPES))


TITLE_H, SLOT_H, WIDGET_H, MULTILINE_H, COL_W, NODE_W, GAP = 30, 22, 26, 100, 360, 320, 40


def _size(n: dict) -> list[int]:
    """A body size (title bar excluded, as LiteGraph's `size`) that holds the node's slots and widgets."""
    widgets, conns, outs = _schema(n["type"])
    if n["type"] in CORE:
        multiline = int(n["type"] == "CLIPTextEncode")
    else:
        spec = NODE_CLASS_MAPPINGS[n["type"]].INPUT_TYPES()
        multiline = sum(1 for section in spec.values() for _, (*_, opts) in section.items()
                        if isinstance(opts, dict) and opts.get("multiline"))
    return [NODE_W, 10 + SLOT_H * max(len(conns), len(outs)) + WIDGET_H * len(widgets) + MULTILINE_H * multiline]


def _layout(nodes: list[dict]) -> None:
    """Columns left to right; in each column the nodes stack by row, each below the previous one's full height
    (a fixed row pitch let tall nodes such as Train hide the nodes under them in the real frontend)."""
    for col in sorted({n["col"] for n in nodes}):
        y = 40
        for n in sorted((n for n in nodes if n["col"] == col), key=lambda n: n["row"]):
            n["_size"] = _size(n)
            n["_pos"] = [40 + COL_W * col, y + TITLE_H]
            y += TITLE_H + n["_size"][1] + GAP


def build(nodes: list[dict]) -> dict:
    """nodes: {"id", "type", "col", "row", "widgets": {name: value}, "links": {input: (from_id, from_slot)}}."""
    by_id = {n["id"]: n for n in nodes}
    links, out_nodes = [], []
    link_id = 0
    for n in nodes:
        widgets, conns, _ = _schema(n["type"])
        n["_inputs"] = []
        for name, kind in conns:
            src = n.get("links", {}).get(name)
            if src is None:
                n["_inputs"].append({"name": name, "type": kind, "link": None})
                continue
            link_id += 1
            src_type = _schema(by_id[src[0]]["type"])[2][src[1]][1]
            links.append([link_id, src[0], src[1], n["id"], len(n["_inputs"]), src_type])
            n["_inputs"].append({"name": name, "type": kind, "link": link_id})
        for name in widgets:  # a widget fed by a link (converted to an input)
            if name in n.get("links", {}):
                src = n["links"][name]
                link_id += 1
                src_type = _schema(by_id[src[0]]["type"])[2][src[1]][1]
                links.append([link_id, src[0], src[1], n["id"], len(n["_inputs"]), src_type])
                n["_inputs"].append({"name": name, "type": src_type, "link": link_id, "widget": {"name": name}})
    _layout(nodes)
    for n in nodes:
        widgets, _, outs = _schema(n["type"])
        values = [n.get("widgets", {}).get(w, "fixed" if w == "control_after_generate" else None) for w in widgets]
        missing = [w for w, v in zip(widgets, values) if v is None]
        if missing:
            raise ValueError(f"node {n['id']} {n['type']}: give widget values for {missing}")
        out_nodes.append({
            "id": n["id"], "type": n["type"], "pos": n["_pos"], "size": n["_size"], "flags": {}, "order": n["id"],
            "mode": 0,
            "inputs": n["_inputs"],
            "outputs": [{"name": name, "type": kind, "links": [lk[0] for lk in links
                                                              if lk[1] == n["id"] and lk[2] == slot] or None,
                         "slot_index": slot} for slot, (name, kind) in enumerate(outs)],
            "properties": {"Node name for S&R": n["type"], **({} if n["type"] in CORE else {"cnr_id": "tightrope"})},
            "widgets_values": values,
            **({"title": n["title"]} if "title" in n else {}),
        })
    return {"last_node_id": max(n["id"] for n in nodes), "last_link_id": link_id, "nodes": out_nodes,
            "links": links, "groups": [], "config": {}, "extra": {"ds": {"scale": 0.8, "offset": [0, 0]}},
            "version": 0.4}


LORA = {"rank": 8, "alpha": 8.0, "rslora": False, "dropout": 0.0, "targets": "attention_mlp", "init": "default",
        "target_regex": "", "existing_lora": "", "algorithm": "lora"}
DEMO_IMAGES = {"subfolder": "tightrope_demo_images", "count": 16, "size": 32, "seed": 0, "masks": False}
DATASET = {"folder": "", "resolution": 32, "caption_dropout": 0.0, "use_repeats": True, "strict": False,
           "mask": "none", "frames": 33, "fps": 16.0}
TRAIN = {"learning_rate": 1e-3, "optimizer": "adamw", "schedule": "constant", "warmup_steps": 10, "batch_size": 4,
         "grad_accumulation": 1, "seed": 0, "timestep_sampling": "logit_normal", "timestep_shift": 1.0,
         "guidance": 1.0, "save_every": 50, "filename_prefix": "tightrope/demo_checkpoint", "device": "auto",
         "on_nonfinite": "stop"}
TRAIN.update(ema_decay=0.0, loss="mse", huber_delta=1.0, validation_fraction=0.0, validation_every=100,
             log_dir="", resume=True, timestep_min=0.0, timestep_max=1.0)  # added inputs (optional widgets, after
# the required ones), at their defaults
STRATEGY = {"mode": "manual", "vram_budget_gb": 0.0, "offload_fraction": 0.5, "offload_policy": "spread",
            "prefetch_depth": 1, "activation_offload": False, "checkpoint": "every_n", "checkpoint_every": 2,
            "compile": "off", "activation_memory_budget": 1.0, "compile_mode": "default", "compute_dtype": "fp32",
            "weight_dtype": "auto", "pin_memory": True, "host_ram_budget_gb": 0.0, "token_chunks": 1,
            "optimizer_offload": False}


def demo() -> dict:
    return build([
        {"id": 1, "type": "TightropeDemoModel", "col": 0, "row": 0, "widgets": {"seed": 0}},
        {"id": 2, "type": "TightropeDemoEncoders", "col": 0, "row": 1, "widgets": {"seed": 0}},
        {"id": 3, "type": "TightropeDemoImages", "col": 0, "row": 2, "widgets": DEMO_IMAGES},
        {"id": 4, "type": "TightropeLoadDataset", "col": 1, "row": 1, "widgets": DATASET,
         "links": {"folder": (3, 0), "vae": (2, 0), "clip": (2, 1)}},
        {"id": 5, "type": "TightropeLoraSetup", "col": 1, "row": 2, "widgets": LORA},
        {"id": 6, "type": "TightropeMemoryStrategy", "col": 1, "row": 0, "widgets": STRATEGY},
        {"id": 7, "type": "TightropeTrain", "col": 2, "row": 0, "title": "Train (first 100 steps)",
         "widgets": {**TRAIN, "steps": 100},
         "links": {"model": (1, 0), "dataset": (4, 0), "lora": (5, 0), "strategy": (6, 0)}},
        {"id": 8, "type": "TightropeTrain", "col": 3, "row": 0, "title": "Train on (50 more steps)",
         "widgets": {**TRAIN, "steps": 50, "warmup_steps": 0, "schedule": "cosine"}, "links": {"session": (7, 0)}},
        {"id": 9, "type": "TightropeSaveLora", "col": 4, "row": 0,
         "widgets": {"filename_prefix": "tightrope/demo_lora", "save_ema": True, "dora_for": "comfyui"}, "links": {"session": (8, 0)}},
        {"id": 10, "type": "TightropePlots", "col": 4, "row": 1,
         "widgets": {"filename_prefix": "tightrope/demo"}, "links": {"session": (8, 0)}},
    ])


def demo_features() -> dict:
    """The demo with the training features on: LoKr, masked loss (each image's shape), a held-out validation quarter
    scored every 10 steps, an EMA saved as a second file; half the blocks streamed and all checkpointed."""
    return build([
        {"id": 1, "type": "TightropeDemoModel", "col": 0, "row": 0, "widgets": {"seed": 0}},
        {"id": 2, "type": "TightropeDemoEncoders", "col": 0, "row": 1, "widgets": {"seed": 0}},
        {"id": 3, "type": "TightropeDemoImages", "col": 0, "row": 2,
         "widgets": {**DEMO_IMAGES, "subfolder": "tightrope_demo_masked_images", "masks": True}},
        {"id": 4, "type": "TightropeLoadDataset", "col": 1, "row": 1, "title": "Load Dataset (masks: the shapes)",
         "widgets": {**DATASET, "mask": "mask_files"}, "links": {"folder": (3, 0), "vae": (2, 0), "clip": (2, 1)}},
        {"id": 5, "type": "TightropeLoraSetup", "col": 1, "row": 2, "title": "LoRA Setup (LoKr)",
         "widgets": {**LORA, "algorithm": "lokr"}},
        {"id": 6, "type": "TightropeMemoryStrategy", "col": 1, "row": 0,
         "widgets": {**STRATEGY, "offload_fraction": 0.5, "checkpoint": "all"}},
        {"id": 7, "type": "TightropeTrain", "col": 2, "row": 0, "title": "Train (validation, EMA)",
         "widgets": {**TRAIN, "steps": 40, "save_every": 0, "filename_prefix": "tightrope/demo_features_checkpoint",
                     "ema_decay": 0.9, "validation_fraction": 0.25, "validation_every": 10},
         "links": {"model": (1, 0), "dataset": (4, 0), "lora": (5, 0), "strategy": (6, 0)}},
        {"id": 8, "type": "TightropeSaveLora", "col": 3, "row": 0,
         "widgets": {"filename_prefix": "tightrope/demo_features_lokr", "save_ema": True, "dora_for": "comfyui"},
         "links": {"session": (7, 0)}},
        {"id": 9, "type": "TightropePlots", "col": 3, "row": 1,
         "widgets": {"filename_prefix": "tightrope/demo_features"}, "links": {"session": (7, 0)}},
    ])


def flux_dev(strategy: dict, batch_size: int, title: str) -> dict:
    train = {**TRAIN, "learning_rate": 1e-4, "batch_size": batch_size, "timestep_shift": 3.0, "save_every": 250,
             "filename_prefix": "tightrope/flux_dev_checkpoint", "warmup_steps": 50}
    return build([
        {"id": 1, "type": "UNETLoader", "col": 0, "row": 0,
         "widgets": {"unet_name": "flux1-dev.safetensors", "weight_dtype": "default"}},
        {"id": 2, "type": "DualCLIPLoader", "col": 0, "row": 1,
         "widgets": {"clip_name1": "clip_l.safetensors", "clip_name2": "t5xxl_fp16.safetensors", "type": "flux",
                     "device": "default"}},
        {"id": 3, "type": "VAELoader", "col": 0, "row": 2, "widgets": {"vae_name": "ae.safetensors"}},
        {"id": 4, "type": "TightropeLoadDataset", "col": 1, "row": 1,
         "widgets": {**DATASET, "folder": "my_dataset", "resolution": 1024, "caption_dropout": 0.05},
         "links": {"vae": (3, 0), "clip": (2, 0)}},
        {"id": 5, "type": "TightropeLoraSetup", "col": 1, "row": 2, "widgets": {**LORA, "rank": 16, "alpha": 16.0,
                                                                              "targets": "attention"}},
        {"id": 6, "type": "TightropeMemoryStrategy", "col": 1, "row": 0, "title": title, "widgets": strategy},
        {"id": 7, "type": "TightropeTrain", "col": 2, "row": 0, "title": "Train (first 500 steps)",
         "widgets": {**train, "steps": 500},
         "links": {"model": (1, 0), "dataset": (4, 0), "lora": (5, 0), "strategy": (6, 0)}},
        {"id": 8, "type": "CLIPTextEncode", "col": 2, "row": 2, "widgets": {"text": "a photo of sks"},
         "links": {"clip": (2, 0)}},
        {"id": 9, "type": "FluxGuidance", "col": 3, "row": 2, "widgets": {"guidance": 3.5},
         "links": {"conditioning": (8, 0)}},
        {"id": 10, "type": "EmptySD3LatentImage", "col": 2, "row": 3,
         "widgets": {"width": 1024, "height": 1024, "batch_size": 1}},
        {"id": 11, "type": "KSampler", "col": 3, "row": 1, "title": "Preview with the LoRA",
         "widgets": {"seed": 0, "steps": 20, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple",
                     "denoise": 1.0},
         "links": {"model": (7, 1), "positive": (9, 0), "negative": (9, 0), "latent_image": (10, 0)}},
        {"id": 12, "type": "VAEDecode", "col": 4, "row": 1, "links": {"samples": (11, 0), "vae": (3, 0)}},
        {"id": 13, "type": "PreviewImage", "col": 5, "row": 1, "links": {"images": (12, 0)}},
        {"id": 14, "type": "TightropeTrain", "col": 3, "row": 0, "title": "Train on (500 more steps)",
         "widgets": {**train, "steps": 500, "warmup_steps": 0, "schedule": "cosine"}, "links": {"session": (7, 0)}},
        {"id": 15, "type": "TightropeSaveLora", "col": 4, "row": 0,
         "widgets": {"filename_prefix": "tightrope/flux_dev_lora", "save_ema": True, "dora_for": "comfyui"}, "links": {"session": (14, 0)}},
        {"id": 16, "type": "TightropePlots", "col": 5, "row": 0, "widgets": {"filename_prefix": "tightrope/flux_dev"},
         "links": {"session": (14, 0)}},
    ])


def wan21_t2v_1_3b() -> dict:
    """Wan 2.1 text-to-video 1.3B on a folder of clips (Comfy-Org's repackaged files). The 1.3B model is the one for a
    12-16 GB GPU: its 2.8 GB of fp16 weights stay on the GPU beside 33-frame 480p activations, where Wan 2.2 TI2V
    5B's 10 GB would have to be streamed (and it wants 24 fps, 704p clips and its own 48-channel VAE)."""
    train = {**TRAIN, "learning_rate": 1e-4, "batch_size": 1, "timestep_shift": 0.0, "save_every": 250,
             "filename_prefix": "tightrope/wan21_t2v_checkpoint", "warmup_steps": 50}
    return build([
        {"id": 1, "type": "UNETLoader", "col": 0, "row": 0,
         "widgets": {"unet_name": "wan2.1_t2v_1.3B_fp16.safetensors", "weight_dtype": "default"}},
        {"id": 2, "type": "CLIPLoader", "col": 0, "row": 1,
         "widgets": {"clip_name": "umt5_xxl_fp8_e4m3fn_scaled.safetensors", "type": "wan", "device": "default"}},
        {"id": 3, "type": "VAELoader", "col": 0, "row": 2, "widgets": {"vae_name": "wan_2.1_vae.safetensors"}},
        # 33 frames (9 latent frames) at Wan's 16 fps: 2 s of each clip; a pixel budget of 640 x 640 holds Wan's
        # 480p sizes (832 x 480, 480 x 832, 624 x 624)
        {"id": 4, "type": "TightropeLoadDataset", "col": 1, "row": 1, "title": "Load Dataset (video clips)",
         "widgets": {**DATASET, "folder": "my_videos", "resolution": 640, "frames": 33, "fps": 16.0},
         "links": {"vae": (3, 0), "clip": (2, 0)}},
        {"id": 5, "type": "TightropeLoraSetup", "col": 1, "row": 2, "widgets": {**LORA, "rank": 32, "alpha": 32.0,
                                                                              "targets": "attention_mlp"}},
        {"id": 6, "type": "TightropeMemoryStrategy", "col": 1, "row": 0, "title": "Memory Strategy (auto, 12 GB)",
         "widgets": {**STRATEGY, "mode": "auto", "vram_budget_gb": 12.0, "compute_dtype": "bf16",
                     "weight_dtype": "bf16"}},
        {"id": 7, "type": "TightropeTrain", "col": 2, "row": 0, "title": "Train (1000 steps)",
         "widgets": {**train, "steps": 1000},
         "links": {"model": (1, 0), "dataset": (4, 0), "lora": (5, 0), "strategy": (6, 0)}},
        {"id": 8, "type": "TightropeSaveLora", "col": 3, "row": 0,
         "widgets": {"filename_prefix": "tightrope/wan21_t2v_lora", "save_ema": True, "dora_for": "comfyui"},
         "links": {"session": (7, 0)}},
        {"id": 9, "type": "TightropePlots", "col": 3, "row": 1, "widgets": {"filename_prefix": "tightrope/wan21_t2v"},
         "links": {"session": (7, 0)}},
    ])


WORKFLOWS = {
    "demo.json": demo,
    "demo_features.json": demo_features,
    # 24 GB: Flux-dev's 23.8 GB of bf16 weights do not fit beside activations; stream half of them and checkpoint
    # every second block.
    "flux_dev_lora_24gb.json": lambda: flux_dev(
        {**STRATEGY, "offload_fraction": 0.5, "prefetch_depth": 2, "checkpoint": "every_n", "checkpoint_every": 2,
         "compute_dtype": "bf16", "weight_dtype": "bf16"}, 1, "Memory Strategy (24 GB preset)"),
    # 8 GB: stream every block, checkpoint all of them and park their inputs in host memory.
    "flux_dev_lora_8gb.json": lambda: flux_dev(
        {**STRATEGY, "offload_fraction": 1.0, "prefetch_depth": 1, "activation_offload": True, "checkpoint": "all",
         "compute_dtype": "bf16", "weight_dtype": "bf16"}, 1, "Memory Strategy (8 GB preset)"),
    "wan21_t2v_1.3b_lora_12gb.json": wan21_t2v_1_3b,
}

if __name__ == "__main__":
    out = Path(__file__).resolve().parents[1] / "workflows"
    for name, make in WORKFLOWS.items():
        (out / name).write_text(json.dumps(make(), indent=1) + "\n")
        print("wrote", out / name)

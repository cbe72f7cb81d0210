"""Bad inputs of the training features: LoRA algorithms (adapters), masks, EMA and optimizers (feats), validation,
losses and TensorBoard (valid), the Save node's DoRA convention (dora). Each fails before any image is encoded or
any step runs (the Save node's after the one step that gives it a session). The shared helpers are in
bad_input_cases.py; bad_input_run_cases.py appends these CASES to the whole list."""
from __future__ import annotations

import sys

import torch
from bad_input_cases import DATA, LORA, SAVE, TRAIN, Case, dataset_inputs, png, train_with
from PIL import Image
from reliability_kit import load_dataset, train_node, world

from tightrope.nodes.dataset_nodes import TightropeDatasetFromLatents, TightropeLoadDataset
from tightrope.nodes.lora_node import TightropeLoraSetup
from tightrope.nodes.save_node import TightropeSaveLora

CASES: list[Case] = []


# --- adapters ---


def lora_setup(existing_lora="", **kw):
    """The LoRA Setup node with its default widgets changed by `kw` (algorithm included)."""
    values = dict(rank=4, alpha=4.0, rslora=False, dropout=0.0, targets="attention", init="default") | kw
    return TightropeLoraSetup().setup(**values, existing_lora=existing_lora)[0]


def saved_adapter(ctx, **kw):
    model, dataset, _, strat = world(ctx.out)
    session = train_node(model, dataset, lora_setup(**kw), strat, steps=1)[0]
    (saved,) = TightropeSaveLora().save(session, kw["algorithm"])["result"]
    return saved


def lokr_rank_mismatch(ctx):
    saved = saved_adapter(ctx, algorithm="lokr")
    model, dataset, _, strat = world(ctx.out)
    train_node(model, dataset, lora_setup(algorithm="lokr", rank=2, existing_lora=saved), strat)


CASES += [
    Case("lora_algorithm_mismatch", "existing LoRA of another algorithm (a LoHa file, algorithm lora)", LORA,
         "LoraError", ("existing_lora=", "is a LoHa file", "set algorithm='loha'"),
         lambda c: lora_setup(existing_lora=saved_adapter(c, algorithm="loha"))),
    Case("lokr_rank_mismatch", "existing LoKr file of another rank", TRAIN, "LoraError",
         ("lokr_00001_.safetensors", "(rank=2)", "set rank=4"), lokr_rank_mismatch),
    Case("loha_dropout", "LoHa with dropout", LORA, "LoraError", ("dropout=0.1", "algorithm='loha'", "set dropout=0"),
         lambda c: lora_setup(algorithm="loha", dropout=0.1)),
]


# --- feats ---
# Masks, EMA and optimizers: every one fails before any image is encoded or any step runs.


def mask_folder(ctx, mask: bytes | None = None, mask_mode="mask_files"):
    folder = ctx.folder(*([("good.mask.png", mask)] if mask is not None else []))
    TightropeLoadDataset().load(**dataset_inputs(folder), mask=mask_mode)


def without_package(ctx, name: str, package: str):
    real = sys.modules.get(package)
    sys.modules[package] = None  # `import package` now raises ImportError, as when it is not installed
    try:
        train_with(ctx, optimizer=name)
    finally:
        if real is None:
            del sys.modules[package]
        else:
            sys.modules[package] = real


CASES += [
    Case("ema_decay_1", "EMA decay 1 (would never move)", TRAIN, "ConfigError", ("ema_decay=1.0", "between 0 and 1"),
         lambda c: train_with(c, ema_decay=1.0)),
    Case("ema_decay_negative", "EMA decay < 0", TRAIN, "ConfigError", ("ema_decay=-0.5", "or 0 to train without"),
         lambda c: train_with(c, ema_decay=-0.5)),
    Case("optimizer_unknown", "optimizer that does not exist", TRAIN, "ConfigError",
         ("optimizer='lion'", "choose one of adamw"), lambda c: train_with(c, optimizer="lion")),
    Case("optimizer_prodigy_missing", "optimizer prodigy without prodigyopt installed", TRAIN, "ConfigError",
         ("optimizer='prodigy'", "`pip install prodigyopt`"), lambda c: without_package(c, "prodigy", "prodigyopt")),
    Case("optimizer_schedulefree_missing", "optimizer adamw_schedulefree without schedulefree installed", TRAIN,
         "ConfigError", ("optimizer='adamw_schedulefree'", "`pip install schedulefree`"),
         lambda c: without_package(c, "adamw_schedulefree", "schedulefree")),
    Case("schedulefree_with_cosine", "adamw_schedulefree with a cosine schedule", TRAIN, "ConfigError",
         ("schedule='cosine'", "set schedule='constant'"),
         lambda c: train_with(c, optimizer="adamw_schedulefree", schedule="cosine")),
    Case("mask_file_missing", "mask=mask_files, an image without name.mask.png", DATA, "DatasetError",
         ("good.mask.png", "or choose mask='none'"), lambda c: mask_folder(c)),
    Case("mask_file_wrong_size", "mask file of another size than its image", DATA, "DatasetError",
         ("good.mask.png' is 16x16 but its image", "save the mask at the image's size"),
         lambda c: mask_folder(c, png(Image.new("L", (16, 16), 255)))),
    Case("mask_file_black", "mask file that is black everywhere", DATA, "DatasetError",
         ("good.mask.png' is black everywhere", "whiten the part to train on"),
         lambda c: mask_folder(c, png(Image.new("L", (32, 32), 0)))),
    Case("mask_alpha_missing", "mask=alpha, an image without transparency", DATA, "DatasetError",
         ("good.png", "save them as PNG with transparency"), lambda c: mask_folder(c, mask_mode="alpha")),
    Case("image_conditioning", "an image-to-video conditioning (WanImageToVideo's)", "Dataset from Latents + "
         "Conditioning", "DatasetError", ("concat_latent_image", "connect a plain CLIP Text Encode conditioning"),
         lambda c: image_conditioning()),
]


def image_conditioning():
    cond = [[torch.zeros(1, 4, 32), {"pooled_output": None, "concat_latent_image": torch.zeros(1, 16, 1, 8, 8)}]]
    TightropeDatasetFromLatents().load({"samples": torch.zeros(1, 16, 8, 8)}, cond, 0.0)


# --- valid ---
def tensorboard_missing(ctx):
    saved = sys.modules.get("torch.utils.tensorboard")
    sys.modules["torch.utils.tensorboard"] = None  # `import torch.utils.tensorboard` fails, as without the package
    try:
        train_with(ctx, log_dir="tb")
    finally:
        if saved is None:
            del sys.modules["torch.utils.tensorboard"]
        else:
            sys.modules["torch.utils.tensorboard"] = saved


CASES += [
    Case("validation_fraction_1", "validation fraction 1", TRAIN, "ConfigError",
         ("validation_fraction=1.0", "above 0 and below 1"), lambda c: train_with(c, validation_fraction=1.0)),
    Case("validation_fraction_negative", "validation fraction < 0", TRAIN, "ConfigError",
         ("validation_fraction=-0.2", "above 0 and below 1"), lambda c: train_with(c, validation_fraction=-0.2)),
    Case("validation_holds_out_nothing", "validation fraction that holds out no image", TRAIN, "DatasetError",
         ("validation_fraction=0.1 of 4 images holds out 0 images", "raise it to at least 0.25"),
         lambda c: train_with(c, validation_fraction=0.1)),
    Case("validation_every_0", "validation every 0 steps", TRAIN, "ConfigError",
         ("validation_every=0", ">= 1"), lambda c: train_with(c, validation_every=0)),
    Case("validation_fraction_and_dataset", "validation fraction and a validation dataset", TRAIN, "ConfigError",
         ("validation_fraction=0.5 and a validation_dataset", "set validation_fraction to 0"),
         lambda c: train_with(c, validation_fraction=0.5, validation_dataset=load_dataset())),
    Case("huber_delta_0", "Huber delta 0", TRAIN, "ConfigError", ("huber_delta=0.0", "greater than 0"),
         lambda c: train_with(c, loss="huber", huber_delta=0.0)),
    Case("huber_delta_negative", "Huber delta < 0", TRAIN, "ConfigError", ("huber_delta=-1.0", "greater than 0"),
         lambda c: train_with(c, loss="huber", huber_delta=-1.0)),
    Case("timestep_range_empty", "timestep range with min above max (Wan 2.2 experts)", TRAIN, "ConfigError",
         ("timestep_max=0.875 is not above timestep_min=0.9", "set timestep_min below timestep_max"),
         lambda c: train_with(c, timestep_min=0.9, timestep_max=0.875)),
    Case("timestep_max_above_1", "timestep_max > 1", TRAIN, "ConfigError",
         ("timestep_max=1.5 is out of range", "from 0.0 to 1.0"), lambda c: train_with(c, timestep_max=1.5)),
    Case("timestep_range_at_an_end", "timestep range at an end (timestep_min 0.999999)", TRAIN, "ConfigError",
         ("timestep_min=0.999999 leaves no timesteps to train on", "set timestep_min below 0.99999"),
         lambda c: train_with(c, timestep_min=0.999999)),
    Case("tensorboard_missing", "log_dir without tensorboard installed", TRAIN, "ConfigError",
         ("log_dir='<output>/tb'", "pip install tensorboard", "leave log_dir empty"), tensorboard_missing),
]


# --- dora ---
def dora_for_unknown(ctx):
    model, dataset, _, strat = world(ctx.out)
    session = train_node(model, dataset, lora_setup(algorithm="dora"), strat, steps=1)[0]
    TightropeSaveLora().save(session, "dora", dora_for="lycoris")


CASES += [
    Case("dora_for_unknown", "Save LoRA dora_for that is not a choice", SAVE, "LoraError",
         ("dora_for='lycoris'", "choose 'comfyui'", "'standard'"), dora_for_unknown),
]

"""Checks of node inputs that need no training: output file names and folders, a LoRA to continue from.

Each raises the error the node would raise when it runs, naming the input and the fix. The nodes' VALIDATE_INPUTS
call them before anything runs (at queue time in ComfyUI, before the first node headless), and the nodes call them
again when they run, so a problem in the last node of a chain is found before the first training step.
"""
from __future__ import annotations

import hashlib
import os
import re
import warnings
from pathlib import Path
from typing import Any

from safetensors import safe_open

from . import distributed
from .data.image_folder import DatasetError
from .lora.layers import resolve_existing_lora
from .lora.files import LORA_SUFFIXES, TEXT_ENCODER_KEY
from .lora.lycoris import check_file_algorithm
from .lora.targets import LoraError
from .models import adapter_for
from .host_optimizer import check_offloadable
from .optimizer import optimizer_class
from .state.atomic_write import OutputPathError, user_output_path
from .train_config import ConfigError
from .validation import split_for_validation


def check_output_target(folder: str | os.PathLike, filename_prefix: str) -> Path:
    """`folder`/`filename_prefix` (see user_output_path), once its folder is known to be creatable and writable."""
    try:
        target = user_output_path(folder, filename_prefix)
    except ValueError as e:
        raise OutputPathError(str(e)) from None
    check_writable_folder(target.parent, f"filename_prefix={filename_prefix!r}")
    return target


_SAVE_ELSEWHERE = ("save elsewhere (tightrope run --output-dir DIR; in ComfyUI, a writable loras folder in "
                   "extra_model_paths.yaml)")


def check_writable_folder(folder: str | os.PathLike, what: str, *, other: str = "choose another filename_prefix",
                          elsewhere: str = _SAVE_ELSEWHERE) -> None:
    """`folder` exists and is writable, or its nearest existing parent is a folder this user may create it in.
    `what` names the setting that needs it; `other` and `elsewhere` are the fixes offered (another name; another
    place)."""
    folder = Path(folder)
    existing = folder
    while not os.path.exists(existing) and existing.parent != existing:  # os.path: False, not raising, if unsearchable
        existing = existing.parent
    if not existing.is_dir():
        raise OutputPathError(f"{what} needs the folder '{folder}', but '{existing}' is a file: move or rename that "
                              f"file, or {other}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OutputPathError(f"{what} needs to write into '{existing}', which this user may not write to: make it "
                              f"writable (chmod u+w), or {elsewhere}")


def check_existing_lora(name: str, loras_dir: str | os.PathLike, algorithm: str | None = None,
                        rank: int | None = None) -> str:
    """The full path of a LoRA to continue from (a path, or a name in the loras folder), once its safetensors header
    has been read: it exists, is .safetensors, is readable and holds adapter weights (of `algorithm`'s keys, when
    given: 'lora', 'dora', 'loha' or 'lokr'; of rank `rank`, when given, for LoRA and DoRA). Raises LoraError."""
    path = resolve_existing_lora(name, loras_dir)
    what = f"existing_lora={name!r}" + ("" if path == name else f" ({path})")
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            keys = list(f.keys())
            # the diffusion model's layers' ranks (a text encoder's part, which training drops, may have another)
            ranks = {f.get_slice(k).get_shape()[0] for k in keys
                     if k.endswith(_RANK_KEYS) and not TEXT_ENCODER_KEY.match(k)}
    except Exception as e:  # safetensors raises several types for a damaged header; PermissionError for mode 000
        raise LoraError(f"{what} could not be read as safetensors ({e}): it is damaged, incomplete or unreadable; "
                        "save or download it again, or leave existing_lora empty") from None
    if not keys:
        raise LoraError(f"{what} holds no tensors: pick a LoRA file, or leave existing_lora empty to start a new LoRA")
    if not any(_ADAPTER_MARK.search(k) for k in keys):
        raise LoraError(f"{what} is not a LoRA file: none of its {len(keys)} tensors is an adapter weight (e.g. "
                        f"{', '.join(keys[:2])}: a model's weights?); pick a LoRA file (Save LoRA's, or another "
                        "trainer's), or leave existing_lora empty to start a new LoRA")
    if algorithm is not None:
        check_file_algorithm(keys, algorithm, what)
    if rank is not None and algorithm in ("lora", "dora") and ranks and rank not in ranks:
        shown = " or ".join(map(str, sorted(ranks)))
        raise LoraError(f"{what} was trained with rank {shown} but this LoRA setup has rank={rank}: set rank="
                        f"{min(ranks)} to continue from it")
    return path


_RANK_KEYS = tuple(suffix for suffix, part in LORA_SUFFIXES.items() if part == "A")  # (rank, in)
_ADAPTER_MARK = re.compile(r"lora_|\.lora\.|hada_|lokr_|dora_scale", re.IGNORECASE)  # a key of any adapter format


def check_run_inputs(session: Any, steps: Any, device: Any) -> tuple[Any, Any]:
    """The checks of a training run's inputs that need no model (the run calls them first, and the Train node before
    an `auto` strategy's probe, which loads and runs the model): steps, the validation split, batch_size against the
    dataset and the world, the optimizer's package. Returns (the images to train on, the validation set or None).
    steps 0: a finished run's unscored last validation (training_run); the Train node's widget takes 1 or more."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ConfigError(f"steps={steps!r} is invalid: train at least 1 step")
    check_same_data_on_every_rank(session.dataset)  # first: a check below could fail on one rank's data only
    cfg = session.config
    data, validation_set = split_for_validation(session)  # names the input on a bad validation set
    if cfg.validation_fraction > 0 and cfg.batch_size > len(data):
        raise DatasetError(f"batch_size={cfg.batch_size} is larger than the {len(data)} items (after repeats) left to "
                           f"train on once validation_fraction={cfg.validation_fraction} held out "
                           f"{validation_set.num_images} of {session.dataset.num_images} images: lower "
                           "validation_fraction or batch_size, or add images")
    thin = data.thin_batches(cfg.batch_size)  # names batch_size if it exceeds the dataset
    if thin:
        warnings.warn(thin, stacklevel=1)  # one place: the node and the trainer both check, it is said once
    distributed.check_batch_size(cfg.batch_size)  # under torchrun batch_size is the global batch
    check_dataset_fits_model(session)
    if session.strategy.optimizer.enabled:
        check_offloadable(cfg.optimizer)  # one that cannot step on the host
    optimizer_class(cfg.optimizer, device)  # a missing optimizer package
    return data, validation_set


def check_dataset_fits_model(session: Any) -> None:
    """The datasets' latents have the channels of the model's VAE, and their caption encodings the widths of its text
    encoders: a dataset encoded for another model (an SDXL VAE's 4-channel latents, another model's text encoder)
    would otherwise fail inside the first forward with a matrix-shape error. Read from shapes: nothing is loaded."""
    adapter = adapter_for(session.model)
    channels = adapter.latent_channels()
    context_width, pooled_width = adapter.conditioning_dims()
    model = f"this {adapter.family} model ({adapter.base_name})"
    for what, dataset in (("dataset", session.dataset), ("validation_dataset", session.validation_dataset)):
        widths = getattr(dataset, "encoded_widths", None)
        if widths is None:  # none connected, or a dataset type without shapes to read
            continue
        latent_channels, contexts, pooled = widths()
        clips = getattr(dataset, "clip_count", lambda: 0)()
        if clips and not getattr(adapter, "takes_video", lambda: False)():
            raise DatasetError(f"the {what} holds {clips} video clip(s) (multi-frame latents), but {model} takes "
                               "image latents: train a video model (Wan) on them, or give this model images only "
                               "(remove the videos from the folder, or encode single images)")
        if channels and latent_channels != {channels}:
            raise DatasetError(f"the {what}'s latents have {_listed(latent_channels)} channels, but {model} takes "
                               f"{channels}-channel latents: encode the images with this model's VAE (the one that "
                               "goes with it in ComfyUI's Load VAE), not another model's")
        if context_width and contexts != {context_width}:
            raise DatasetError(f"the {what}'s caption encodings have width {_listed(contexts)}, but {model} takes "
                               f"text of width {context_width}: encode the captions with this model's text "
                               "encoder(s) (the ones that go with it in ComfyUI's Load CLIP), not another model's")
        if pooled_width and pooled != {pooled_width}:
            raise DatasetError(f"the {what}'s pooled text embeddings have width {_listed(pooled)}, but {model} takes "
                               f"width {pooled_width}: encode the captions with this model's text encoders (the "
                               "ones that go with it in ComfyUI's Load CLIP)")


def _listed(values: set[int]) -> str:
    return " and ".join(str(v) for v in sorted(values))


def check_same_data_on_every_rank(dataset: Any) -> None:
    """Under torchrun each rank loads its part of one plan of global batches from its own copy of the dataset: a
    rank whose copy differs (another machine's folder out of sync) would train on a silent mix. Every rank compares
    the images' count, buckets and captions with rank 0's and every rank stops on a difference."""
    if not distributed.current().distributed:
        return
    try:
        h = hashlib.sha256(repr((len(dataset), dataset.num_images, sorted(dataset.bucket_counts.items()))).encode())
        for i in range(dataset.num_images):
            h.update(dataset.caption(i).encode() + b"\0")
        mine = (dataset.num_images, h.hexdigest())
    except (AttributeError, TypeError):  # a dataset type without these views: not checked
        mine = None
    keys = distributed.from_every_rank(mine)
    other = [rank for rank, key in enumerate(keys) if key != keys[0]]
    if other:
        rank = other[0]
        raise DatasetError(f"rank {rank}'s dataset ({keys[rank][0] if keys[rank] else '?'} images) differs from rank "
                           f"0's ({keys[0][0] if keys[0] else '?'} images; images, captions or buckets): every rank "
                           "must read the same dataset: put its folder on a file system every machine shares, or "
                           "copy it identically to every machine")

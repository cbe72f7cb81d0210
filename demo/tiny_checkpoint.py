"""Tiny random Flux checkpoints in the original BFL key layout, for tests and CPU smoke runs.

The file looks like a real ``flux1-dev.safetensors`` (same keys, no prefix), only small, so it loads both in our
reference model and through ComfyUI's own UNETLoader.
"""
from __future__ import annotations

import dataclasses
import json
import os
import tempfile

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ..training.models.reference_flux import Flux, FluxParams

PARAMS_METADATA_KEY = "tightrope.flux_params"


def init_tiny_weights_(model: Flux, seed: int = 0) -> Flux:
    """Deterministic init from `seed`, independent of torch's global RNG and of module construction order.

    Linear weights ~ N(0, 1/fan_in) keep activations at unit scale; biases ~ N(0, 0.02) and RMSNorm scales
    ~ 1 + N(0, 0.1) are deliberately not 0 / 1, so a loader that drops or misnames them gives a visibly different
    output instead of an accidentally identical one."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith(".scale"):
                t = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
            elif name.endswith(".bias"):
                t = 0.02 * torch.randn(p.shape, generator=gen)
            else:  # Linear weight (out, in)
                t = torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5
            p.copy_(t.to(p.dtype))
    return model


def make_tiny_checkpoint(path: str | os.PathLike, params: FluxParams | None = None, seed: int = 0,
                         dtype: torch.dtype = torch.float32) -> str:
    """Write a randomly initialised Flux (default `FluxParams.tiny()`) to `path` as safetensors; return the path.

    Written to a temp file in the same directory and renamed into place, so a reader never sees a half file."""
    params = params or FluxParams.tiny()
    path = os.fspath(path)
    model = init_tiny_weights_(Flux(params), seed)
    sd = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}
    # a single metadata entry: safetensors writes metadata from a hash map, so several keys come out in a random
    # order and the same seed would not give byte-identical files
    meta = {PARAMS_METADATA_KEY: json.dumps(dataclasses.asdict(params))}

    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".safetensors", dir=directory)
    os.close(fd)
    try:
        save_file(sd, tmp, metadata=meta)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def read_params(path: str | os.PathLike) -> FluxParams | None:
    """The FluxParams recorded by make_tiny_checkpoint, or None for a file without them (e.g. a real checkpoint)."""
    with safe_open(os.fspath(path), framework="pt") as f:
        raw = (f.metadata() or {}).get(PARAMS_METADATA_KEY)
    return FluxParams(**json.loads(raw)) if raw else None


def load_reference_flux(path: str | os.PathLike, params: FluxParams | None = None,
                        device: str | torch.device = "cpu") -> Flux:
    """Load a BFL-layout safetensors file into our reference Flux (strict: every key, every shape).

    `params` defaults to those recorded in the file's metadata. Weights keep the file's dtype. Only safetensors is
    read (never pickle)."""
    path = os.fspath(path)
    params = params or read_params(path)
    if params is None:
        raise ValueError(f"{path}: no FluxParams recorded in the file; pass params= (e.g. FluxParams.dev())")
    sd = load_file(path, device=str(device))
    with torch.device("meta"):  # no throwaway init: load_state_dict(assign=True) adopts the file's tensors
        model = Flux(params)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(set(expected) - set(sd))
    unexpected = sorted(set(sd) - set(expected))
    wrong = sorted(f"{k}: file {tuple(sd[k].shape)} vs model {expected[k]}"
                   for k in set(expected) & set(sd) if tuple(sd[k].shape) != expected[k])
    if missing or unexpected or wrong:
        def head(xs):
            return ", ".join(xs[:5]) + (f" ... (+{len(xs) - 5})" if len(xs) > 5 else "")
        raise ValueError(f"{path} does not match the reference Flux for {params}: "
                         f"missing {len(missing)} [{head(missing)}]; unexpected {len(unexpected)} "
                         f"[{head(unexpected)}]; wrong shape {len(wrong)} [{head(wrong)}]")
    model.load_state_dict(sd, strict=True, assign=True)
    return model

"""What a training state file records of a run's inputs, to tell on resume whether they are the same: the model
(family, parameter names and shapes, a sample of base-weight values compared by similarity, and an exact digest of a
few bytes of every weight), the dataset (every latent, mask and text encoding, exactly) and the existing_lora file."""
from __future__ import annotations

import hashlib
from typing import Any

import torch

from ...memory.tensor_kinds import keeps_bytes, plain_view

_SAMPLE = 64            # base-weight values sampled per tensor for the model fingerprint
_SAME_WEIGHTS = 0.98    # cosine similarity of the samples above which weights count as the same (fp8 vs bf16 is)
_EXACT = 16             # elements per parameter whose bytes the exact model digest hashes


def model_fingerprint(module: torch.nn.Module, family: str) -> dict:
    """Family, a hash of parameter names + shapes, a few base-weight values (compared by cosine similarity, so the
    same model loaded in another dtype still counts as that model), and `exact`: the weights as trained (a resume
    of "the same run" needs it equal)."""
    params = list(module.named_parameters())
    h = hashlib.sha256()
    for name, p in params:
        h.update(f"{name}:{tuple(p.shape)};".encode())
    weights = [p for _, p in params if p.ndim >= 2 and not p.is_meta]
    picks = weights[:2] + weights[len(weights) // 2:len(weights) // 2 + 1] + weights[-1:] if weights else []
    try:
        sample = [v for p in picks for v in p.detach().reshape(-1)[:_SAMPLE].float().cpu().tolist()]
    except (RuntimeError, TypeError, NotImplementedError):  # a weight type that cannot be read that way: names only
        sample = []
    return {"family": family, "structure": h.hexdigest(), "tensors": len(params), "sample": sample,
            "exact": _exact_weights_digest(params)}


def _exact_weights_digest(params: list[tuple[str, torch.Tensor]]) -> str:
    """A hash of every parameter's dtype and the bytes of _EXACT evenly spaced elements of it: another dtype (fp8),
    another file, or weights a LoRA on the MODEL patched (dense changes) give another digest; milliseconds for a
    12B model. Weights without bytes of their own (wrapper subclasses) or on meta count by dtype only."""
    h = hashlib.sha256()
    for name, p in params:
        data = p.detach()
        h.update(f"{name}:{data.dtype};".encode())
        if not keeps_bytes(data) or data.is_meta or data.numel() == 0:
            continue
        plain = plain_view(data)
        at = torch.linspace(0, plain.numel() - 1, min(_EXACT, plain.numel()), dtype=torch.float64).round().long()
        picked = plain.reshape(1)[at] if plain.ndim == 0 else plain[torch.unravel_index(at.to(plain.device),
                                                                                        plain.shape)]
        h.update(picked.cpu().contiguous().view(torch.uint8).numpy().tobytes())
        if getattr(p, "patches", None):  # a GGUF weight: its layer applies the MODEL's LoRA patches in forward
            _add_patches(h, p.patches)
    return h.hexdigest()


def _add_patches(h, value: Any) -> None:
    """Hash the patches of a weight whose layer applies them (ComfyUI-GGUF): tensors whole (LoRA factors are
    small), strengths and names by value, ComfyUI's weight adapters by their `weights`."""
    if isinstance(value, torch.Tensor):
        t = plain_view(value.detach()).to("cpu").contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)};".encode() + t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, (list, tuple)):
        h.update(f"[{len(value)};".encode())
        for v in value:
            _add_patches(h, v)
    elif value is None or isinstance(value, (bool, int, float, str)):
        h.update(f"{value!r};".encode())
    elif hasattr(value, "weights"):
        h.update(f"{type(value).__name__};".encode())
        _add_patches(h, value.weights)
    else:
        h.update(f"{type(value).__name__};".encode())


def dataset_fingerprint(dataset: Any) -> str:
    """Size, buckets and the dataset's content_digest (every latent, mask and text encoding, exactly); for a dataset
    type without one, the captions and the first and last latent (and mask)."""
    try:
        n = dataset.num_images
        h = hashlib.sha256(repr((len(dataset), n, sorted(dataset.bucket_counts.items()))).encode())
        if hasattr(dataset, "content_digest"):
            h.update(dataset.content_digest().encode())
            return h.hexdigest()
        for i in range(n):
            h.update(dataset.caption(i).encode() + b"\0")
        for i in sorted({0, n - 1}):
            h.update(dataset.latent(i).detach().float().cpu().numpy().tobytes())
            mask = dataset.mask(i) if hasattr(dataset, "mask") else None  # loss masks (training/masks.py)
            if mask is not None:
                h.update(mask.numpy().tobytes())
        return h.hexdigest()
    except (AttributeError, TypeError):  # a dataset type without these views: not checked
        return "unknown"


def model_mismatch(saved: dict, now: dict) -> str | None:
    if saved["family"] != now["family"]:
        return f"it was trained on a {saved['family']} model, this is a {now['family']} model"
    if saved["structure"] != now["structure"]:
        return (f"its model has other layers ({saved['tensors']} parameter tensors, this one {now['tensors']}, or "
                "other names/shapes)")
    a, b = torch.tensor(saved["sample"], dtype=torch.float64), torch.tensor(now["sample"], dtype=torch.float64)
    if a.numel() and a.shape == b.shape and a.norm() * b.norm() > 0 \
            and float(a @ b / (a.norm() * b.norm())) < _SAME_WEIGHTS:
        return "same architecture, different base weights"
    return None


def fingerprints(module: torch.nn.Module, family: str, dataset: Any, lora: Any = None) -> dict:
    """What a state file records of a run's inputs (`lora`: its LoraSpec, for the existing_lora file's bytes)."""
    return {"model": model_fingerprint(module, family), "dataset": dataset_fingerprint(dataset),
            "lora_file": lora_file_digest(lora)}


def lora_file_digest(lora: Any) -> str | None:
    """sha256 of the existing_lora file a LoRA Setup continues from (None: it starts anew): the name can stay while
    the file is replaced."""
    path = getattr(lora, "existing_lora", None)
    if not path:
        return None
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                h.update(chunk)
    except OSError:
        return "unreadable"  # inject_lora_continuing names the problem when it loads the file
    return h.hexdigest()

"""The oldest Python, torch and peft Tightrope runs on, checked when the package is imported (ComfyUI loading the
node pack, the `tightrope` command, a script), before anything imports peft: an older one is refused in one line
naming what is installed and what is needed, instead of an AttributeError deep in a run or, worse, a run that
goes through and is wrong. torch is never installed by Tightrope (the user's ComfyUI owns it), so pip cannot
enforce its floor; peft's is in pyproject.toml too, but a ComfyUI custom_nodes checkout is not pip-installed.

Why these floors (found by running the test suite on each; tests/test_versions.py):
  - peft 0.18: peft 0.13 never applies a LoKr's alpha / rank (trained at scale 1, saved with an alpha ComfyUI
    applies); before 0.15 every LoRA input is upcast to fp32 under autocast (a full copy of each layer's input);
    before 0.16 the token-chunked blocks compute each LoRA Linear whole per chunk (no `lora_variant`); 0.16 and 0.17
    do not import at all with transformers 5 (`HybridCache`).
  - torch 2.7: per-block compile patches dynamo's `recompile_limit` (2.6 calls it `cache_size_limit`), and FSDP
    sharding leaves the LoRA out with `fully_shard(ignored_params=...)` (2.7 on).
"""
from __future__ import annotations

import re
import sys
from importlib import metadata

MIN_PYTHON = (3, 10)
MIN_TORCH = (2, 7)
MIN_PEFT = (0, 18)


class UnsupportedVersionError(ImportError):
    """Python, torch or peft older than Tightrope supports (the message says which, and what is needed)."""


def version_tuple(version: str) -> tuple[int, ...]:
    """'2.6.0+cu124' -> (2, 6, 0); '0.18.0.dev0' -> (0, 18, 0)."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def problems(python: tuple[int, ...], torch_version: str | None, peft_version: str | None) -> list[str]:
    """What is too old (or missing), one phrase each; empty when everything is supported."""
    found = []
    if python[:2] < MIN_PYTHON:
        found.append(f"Python {'.'.join(map(str, python[:3]))} (needs {'.'.join(map(str, MIN_PYTHON))} or newer)")
    floor = ".".join(map(str, MIN_TORCH))
    if torch_version is None:
        found.append(f"no torch (needs torch {floor} or newer: ComfyUI's own, or `pip install torch`)")
    elif version_tuple(torch_version) < MIN_TORCH:
        found.append(f"torch {torch_version} (needs {floor} or newer: update ComfyUI's torch)")
    floor = ".".join(map(str, MIN_PEFT))
    if peft_version is None:
        found.append(f"no peft (needs peft {floor} or newer: pip install 'peft>={floor}')")
    elif version_tuple(peft_version) < MIN_PEFT:
        found.append(f"peft {peft_version} (needs {floor} or newer: pip install -U 'peft>={floor}')")
    return found


def installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def require_supported() -> None:
    """Raise UnsupportedVersionError (one line) if this Python, torch or peft is older than supported. peft is read
    from its metadata, not imported: an old peft may not import at all."""
    try:
        import torch
        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    found = problems(sys.version_info, torch_version, installed("peft"))
    if found:
        raise UnsupportedVersionError(f"Tightrope cannot run with {'; '.join(found)}")

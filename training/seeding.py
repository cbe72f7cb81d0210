"""Seeding the global random generators for one part of a run, and nothing beyond it.

`torch.manual_seed` seeds the CPU generator and every CUDA device's, and `fork_rng` restores only the devices it is
given: in a long-running ComfyUI process, a run would leave every GPU's generator at a fixed seed. Here the CPU
generator and the run's own device are seeded, inside a fork of exactly those two, so every generator is as it was
afterwards (docs/architecture.md: no global RNG state is changed by a run).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def forked(device: torch.device | str) -> Iterator[None]:
    """The CPU generator and `device`'s (when it is a CUDA device) as they are now, again on exit."""
    device = torch.device(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        yield


def seed(value: int, device: torch.device | str) -> None:
    """Seed the CPU generator and `device`'s CUDA generator (only that device) with `value`; call inside `forked`."""
    torch.default_generator.manual_seed(value)
    if torch.device(device).type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(value)

"""Counting the host memory Python-visible tensors hold, for tests that assert copies and leaks."""
from __future__ import annotations

import gc

import torch


def live_cpu_storages() -> dict[int, int]:
    """nbytes of every distinct CPU storage a Python-visible tensor or parameter holds, by data pointer. Plain tensors
    only: fake tensors left over by compile tests have no data."""
    gc.collect()
    spans = {}
    for o in gc.get_objects():
        if type(o) in (torch.Tensor, torch.nn.Parameter) and o.device.type == "cpu":
            s = o.untyped_storage()
            spans[s.data_ptr()] = s.nbytes()
    return spans

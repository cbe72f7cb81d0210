"""Per-step memory and transfer statistics."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class StepStats:
    step_time_s: float
    peak_allocated_bytes: int   # CUDA only (0 elsewhere)
    peak_reserved_bytes: int    # CUDA only (0 elsewhere)
    h2d_bytes: int              # offloaded weights streamed in
    d2h_bytes: int              # activations sent to host
    transfer_wait_s: float      # compute-stream time stalled on copies (CUDA)
    recompiles: int             # graphs compiled during this step

    def to_dict(self) -> dict:
        return asdict(self)


class StepTimer:
    """Brackets one training step; reads the runtime's counters as deltas."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"

    def start(self, counters: dict[str, int]) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self._before = dict(counters)
        self._t0 = time.perf_counter()

    def stop(self, counters: dict[str, int], wait_s: float) -> StepStats:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - self._t0
        delta = {k: counters[k] - self._before[k] for k in counters}
        return StepStats(
            step_time_s=elapsed,
            peak_allocated_bytes=torch.cuda.max_memory_allocated(self.device) if self.cuda else 0,
            peak_reserved_bytes=torch.cuda.max_memory_reserved(self.device) if self.cuda else 0,
            h2d_bytes=delta["h2d_bytes"], d2h_bytes=delta["d2h_bytes"],
            transfer_wait_s=wait_s, recompiles=delta["graphs"])

"""Per-step memory and transfer statistics.

Three memory figures, because a GPU runs out of the last one, not the first:
  - allocated: the peak of live tensors (torch.cuda.max_memory_allocated);
  - reserved: the peak the caching allocator held (live tensors + cached blocks + fragmentation);
  - device used: device total minus free at the end of the step (torch.cuda.mem_get_info), minus the same reading
    taken when the timer was made (before the runtime placed the model). The allocator keeps its peak reservation
    until emptied, so this is the reserved peak plus what the allocator cannot see: CUDA context growth,
    cuBLAS/cuDNN workspaces outside it, and other processes on the device.
Off CUDA there is no allocator to ask: all three are 0, meaning "not measured" (the report says so).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class StepStats:
    step_time_s: float
    peak_allocated_bytes: int   # CUDA only (0 elsewhere: not measured)
    peak_reserved_bytes: int    # CUDA only (0 elsewhere: not measured)
    device_used_bytes: int      # CUDA only: total - free at the step's end, minus the reading before the model
    h2d_bytes: int              # offloaded weights streamed in
    d2h_bytes: int              # activations sent to host
    transfer_wait_s: float      # compute-stream time stalled on copies (CUDA)
    recompiles: int             # graphs compiled during this step

    def to_dict(self) -> dict:
        return asdict(self)


def device_used_bytes(device: torch.device) -> int:
    """Bytes of the device in use by anyone (total - free); 0 off CUDA."""
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    return int(total - free)


class StepTimer:
    """Brackets one training step (forward, backward and the optimizer step); reads the runtime's counters as
    deltas. Made before the model is placed, so its device-used baseline leaves the model out of nothing."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.baseline_used = device_used_bytes(device)

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
            device_used_bytes=max(0, device_used_bytes(self.device) - self.baseline_used) if self.cuda else 0,
            h2d_bytes=delta["h2d_bytes"], d2h_bytes=delta["d2h_bytes"],
            transfer_wait_s=wait_s, recompiles=delta["graphs"])

"""Exponential moving average of the trainable weights, kept in fp32 on the CPU so it costs no device memory.

After each optimizer step: shadow = d * shadow + (1 - d) * weight, with d = min(decay, (1 + n) / (10 + n)) at the
n-th update (diffusers' EMAModel warm-up): the average starts at the weights it is made from, and without the warm-up
a LoRA's untrained start (B = 0) would still weigh decay^n after n steps (0.74 after 300 steps at 0.999). The count
travels in the state as UPDATES_KEY, so a resumed or continued run goes on with the same decays. The weights are gathered into one flat
fp32 vector on their device and copied to the CPU at once: one device-to-host transfer (and one sync) per step,
not one per tensor.
"""
from __future__ import annotations

import torch
from torch import nn


UPDATES_KEY = "__updates__"  # the state's update count (a 0-d int64 tensor); not a weight
_WARM = 10 ** 9  # the count of a state saved before the count was kept: its average is taken as warmed up


def ema_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An EMA state's weights, without its update count (what a LoRA file of the EMA holds)."""
    return {k: v for k, v in state.items() if k != UPDATES_KEY}


class CpuEma:
    def __init__(self, params: dict[str, nn.Parameter], decay: float, state: dict[str, torch.Tensor] | None = None):
        """state: a `state_dict()` to go on from (a resumed or continued run); default the weights as they are."""
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 < decay < 1.0:
            raise ValueError(f"ema decay={decay!r} is out of range: use a number between 0 and 1, e.g. 0.999")
        self.decay = float(decay)
        self.updates = 0
        self.params = params
        self.shadow = {k: p.detach().to("cpu", torch.float32, copy=True) for k, p in params.items()}
        if state is not None:
            self.load_state_dict(state)

    @torch.no_grad()
    def update(self) -> None:
        if not self.shadow:
            return
        flat = torch.cat([p.detach().reshape(-1).float() for p in self.params.values()]).cpu()
        shadows = list(self.shadow.values())
        weights = [w.view_as(s) for w, s in zip(flat.split([s.numel() for s in shadows]), shadows)]
        decay = min(self.decay, (1 + self.updates) / (10 + self.updates))
        torch._foreach_lerp_(shadows, weights, 1.0 - decay)
        self.updates += 1

    def state_dict(self) -> dict[str, torch.Tensor]:
        """CPU fp32 copies (a later update does not change what was returned), and the update count."""
        return {k: v.clone() for k, v in self.shadow.items()} | {UPDATES_KEY: torch.tensor(self.updates)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.updates = int(state[UPDATES_KEY]) if UPDATES_KEY in state else _WARM
        state = ema_weights(state)
        if state.keys() != self.shadow.keys():
            missing, extra = sorted(self.shadow.keys() - state.keys()), sorted(state.keys() - self.shadow.keys())
            raise ValueError(f"the EMA state does not match the trained weights (missing {missing[:2]}, extra "
                             f"{extra[:2]}): it belongs to another LoRA setup")
        for k, v in state.items():
            if tuple(v.shape) != tuple(self.shadow[k].shape):
                raise ValueError(f"the EMA state of {k!r} has shape {tuple(v.shape)}, the weight "
                                 f"{tuple(self.shadow[k].shape)}: it belongs to another LoRA setup")
            self.shadow[k] = v.detach().to("cpu", torch.float32, copy=True)

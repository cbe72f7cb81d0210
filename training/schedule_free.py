"""Schedule-free optimizers' two sets of weights, kept apart exactly.

A schedule-free optimizer (`schedulefree.AdamWScheduleFree`) trains at interpolated weights y ("train mode") but
its result is the averaged weights x ("eval mode"); `optimizer.eval()` / `.train()` move the parameters between
the two with a lerp that is not bit-exact both ways. So:
- whatever leaves the step loop (a saved LoRA file, a session's LoRA for previews and the Save node, validation)
  reads x under `eval_weights`, which puts back the exact y afterwards, in `finally`;
- the y weights travel in the optimizer state (`TRAIN_WEIGHTS`, per parameter; the training state file stores it
  like any optimizer tensor), and `enter_train_mode` restores them after the state is loaded, so a resumed or
  continued run goes on from exactly the weights an uninterrupted one has.
Every other optimizer passes through these functions untouched. (trained_states also keeps an fp16 loss scaler's
state with the optimizer's, so a resumed run goes on at the scale an uninterrupted one has.)
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Mapping

import torch
from torch import nn

from .lora.layers import lora_state
from .session import clone_state

TRAIN_WEIGHTS = "tightrope_train_weights"
GRAD_SCALER = "grad_scaler"  # an optimizer state's fp16 loss scaler state (trained_states), beside "state"


def is_schedule_free(optimizer: torch.optim.Optimizer) -> bool:
    return callable(getattr(optimizer, "eval", None)) and "train_mode" in optimizer.param_groups[0]


def _params(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    return [p for group in optimizer.param_groups for p in group["params"]]


@torch.no_grad()
def enter_train_mode(optimizer: torch.optim.Optimizer) -> None:
    """Before the first step (after loading a state): train mode, with the exact y weights a saved state holds."""
    if not is_schedule_free(optimizer):
        return
    optimizer.train()  # sets the mode (and moves x towards y, approximately: overwritten below when y was kept)
    for p in _params(optimizer):
        y = optimizer.state.get(p, {}).pop(TRAIN_WEIGHTS, None)
        if y is not None:
            p.copy_(y)


@contextmanager
def eval_weights(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """The parameters hold the weights to save or evaluate (x) inside; the exact train weights again after."""
    if not is_schedule_free(optimizer):
        yield
        return
    params = _params(optimizer)
    with torch.no_grad():
        kept = [p.detach().clone() for p in params]
    try:
        optimizer.eval()  # inside: a stop half-way through its per-parameter loop still gets the kept weights back
        yield
    finally:
        for group in optimizer.param_groups:  # not optimizer.train(): it would move weights eval() may not have
            group["train_mode"] = True
        with torch.no_grad():
            for p, y in zip(params, kept):
                p.copy_(y)


def trained_states(module: nn.Module, optimizer: torch.optim.Optimizer, scaler: Any = None) -> tuple[dict, dict]:
    """(the LoRA to save and preview, the optimizer state to go on from), as CPU copies. An enabled fp16 loss scaler
    (torch.amp.GradScaler) goes on with the optimizer: its scale and growth count are kept under GRAD_SCALER."""
    optimizer_state = clone_state(optimizer.state_dict())
    if scaler is not None and scaler.is_enabled():
        optimizer_state[GRAD_SCALER] = scaler.state_dict()
    if not is_schedule_free(optimizer):
        return lora_state(module), optimizer_state
    for index, p in enumerate(_params(optimizer)):  # state_dict numbers the parameters in this order
        optimizer_state["state"].setdefault(index, {})[TRAIN_WEIGHTS] = p.detach().to("cpu", copy=True)
    with eval_weights(optimizer):
        return lora_state(module), optimizer_state


def ema_weights(params: dict, optimizer) -> Mapping:
    """The weights the EMA averages: those a save writes and validation scores. The parameters themselves, but a
    schedule-free optimizer trains at y and saves its eval weights x (schedule_free.eval_weights)."""
    return EvalWeights(params, optimizer) if is_schedule_free(optimizer) else params


class EvalWeights(Mapping):
    """A schedule-free optimizer's x by name, computed as its eval() does (x = lerp(y, z, 1 - 1/beta1), per parameter:
    bit for bit what eval_weights gives) into new tensors: the parameters keep y, nothing is swapped per step."""

    def __init__(self, params: dict, optimizer):
        self._params, self._optimizer = params, optimizer
        self._toward_z = {p: 1 - 1 / (group["betas"][0] if "betas" in group else group["momentum"])
                          for group in optimizer.param_groups for p in group["params"]}

    def __getitem__(self, name: str) -> torch.Tensor:
        p = self._params[name]
        z = self._optimizer.state.get(p, {}).get("z")  # none before the first step: x = y
        return p.detach() if z is None else torch.lerp(p.detach(), z.to(p.device), self._toward_z[p])

    def __iter__(self):
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)

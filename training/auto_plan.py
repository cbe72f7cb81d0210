"""The Memory Strategy node's `auto` mode: probe the session's model on its largest real batch, then plan.

The planner (memory/planner.py) picks the fastest strategy predicted to fit the VRAM budget; this module only
supplies what it measures: the model with its LoRA, and a batch shaped like training's.
"""
from __future__ import annotations

import gc

import torch
from torch import nn

from ..memory.host_memory import host_needs
from ..memory.planner import plan
from ..memory.probe import probe_model
from ..memory.strategy import Strategy
from . import distributed
from .flow_loss import flow_matching_loss, noised
from .lora.layers import inject_lora, remove_lora
from .models import adapter_for
from .optimizer import CHOICES
from .session import TrainingSession
from .strategy_choice import AutoStrategy


class _Predictor(nn.Module):
    """The adapter's prediction as a module, so the probe can call it with keyword inputs."""

    def __init__(self, adapter, module: nn.Module, guidance: float):
        super().__init__()
        self.adapter, self.module, self.guidance = adapter, module, guidance

    def forward(self, x_t, t, context, pooled):
        return self.adapter.predict(self.module, x_t, t, context, pooled, self.guidance)


def plan_for_session(session: TrainingSession, choice: AutoStrategy, device: torch.device) -> tuple[Strategy, str]:
    cfg = session.config
    adapter = adapter_for(session.model)
    batch = session.dataset.largest_batch(cfg.batch_size)  # not a random one: a plan must fit every batch
    latents, context, pooled = (batch[k].clone() for k in ("latents", "context", "pooled"))
    gen = torch.Generator().manual_seed(cfg.seed)
    noise = torch.randn(latents.shape, generator=gen)
    t = torch.full((latents.shape[0],), 0.5)
    # probe with the most frugal strategy on CUDA (every block streamed and checkpointed, boundary activations in
    # host memory), so that the probe fits whatever budget a plan could fit
    cuda = device.type == "cuda"
    base = Strategy.of(compute_dtype=session.strategy.precision.compute_dtype,
                       weight_dtype=session.strategy.precision.weight_dtype, offload_fraction=1.0 if cuda else 0.0,
                       activation_offload=cuda)

    def make_inputs():
        inputs = dict(x_t=noised(latents, noise, t).to(device), t=t.to(device), context=context.to(device),
                      pooled=pooled.to(device))
        target = latents.to(device), noise.to(device)  # before the forward: copied in the loss they stall the host
        return inputs, lambda out: flow_matching_loss(out, *target)

    with torch.inference_mode(False), torch.enable_grad(), adapter.training_module() as module:
        host = host_needs(module, session.strategy, choice.host_ram_budget_gb)
        inject_lora(module, session.lora, adapter.family)
        try:
            profile = probe_model(_Predictor(adapter, module, cfg.guidance), make_inputs, device, base,
                                  batch=latents.shape[0], repeats=1)
        finally:
            remove_lora(module)
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()  # the probe's cached blocks go back, so the free memory read next is real
    budget = "auto" if choice.vram_budget_gb == 0 else int(choice.vram_budget_gb * 2**30)
    chosen = plan(profile, budget, device=device, host=host, sharding=distributed.launch_sharding(),  # --fsdp
                  optimizer_bytes=CHOICES[cfg.optimizer].state_bytes)
    return chosen.strategy, chosen.explanation

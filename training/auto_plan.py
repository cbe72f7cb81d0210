"""The Memory Strategy node's `auto` mode: probe the session's model on its largest real batch, then plan.

The planner (memory/planner.py) picks the fastest strategy predicted to fit the VRAM budget; this module only
supplies what it measures: the model with its LoRA, and a batch shaped like training's, and what the session's
optimizer allows: its state's bytes, and optimizer offload only where it can step on the CPU
(host_optimizer.offloadable). Under torchrun every rank probes its own device, rank 0 plans for the smallest budget
among the ranks, and every rank trains that plan.
"""
from __future__ import annotations

import dataclasses
import gc
from typing import Callable

import torch
from torch import nn

from ..memory import planner
from ..memory.host_memory import HostNeeds, host_needs
from ..memory.plan_cost import predict
from ..memory.planner import format_bytes, plan
from ..memory.probe import probe_model
from ..memory.strategy import Strategy, StrategyError
from . import distributed, seeding
from .flow_loss import at_least_fp32, flow_matching_loss, noised
from .host_optimizer import offloadable
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


def plan_for_session(session: TrainingSession, choice: AutoStrategy, device: torch.device,
                     progress: Callable[[int, int], None] | None = None) -> tuple[Strategy, str]:
    """The strategy `choice` plans for this session on `device`, and its explanation. Under torchrun the ranks must
    train one plan: its FSDP wrapping and its compile, chunks and offload change numerics and collectives, and a
    plan's text is reported as the run's. Planning on every rank with the smallest budget would not do: the planner
    picks the fastest candidate by the probe's timings, which differ from rank to rank. So rank 0 plans, for the
    smallest VRAM and host-RAM budgets among the ranks, and sends the plan; each rank checks it on its own probe and
    budget (a GPU another program fills, or a larger probe there, stops every rank with one line). progress: told
    (blocks measured, of all) while the probe runs."""
    if choice.vram_budget_gb == 0 and not planner.reads_free_memory(device):  # before the probe: it takes a while
        raise StrategyError(f"vram_budget_gb=0 plans for the free GPU memory, but the device is '{device}', which "
                            "cannot say what is free: set vram_budget_gb to the memory to plan for, or set the "
                            "strategy yourself (mode manual)")
    cfg = session.config
    optimizer_bytes = CHOICES[cfg.optimizer].state_bytes
    profile, host, budget = distributed.on_every_rank(lambda: _measure(session, choice, device, progress))
    budgets = distributed.from_every_rank((budget, host.budget_bytes))
    smallest = min(vram for vram, _ in budgets), min(ram for _, ram in budgets)

    def planned() -> tuple[Strategy, str]:
        chosen = plan(profile, smallest[0], device=device, host=dataclasses.replace(host, budget_bytes=smallest[1]),
                      sharding=distributed.launch_sharding(), optimizer_bytes=optimizer_bytes,  # --fsdp
                      optimizer_offload=offloadable(cfg.optimizer), grad_accumulation=cfg.grad_accumulation)
        return chosen.strategy, chosen.explanation

    strategy, explanation = distributed.on_main_rank(planned)
    par = distributed.current()
    if not par.distributed:
        return strategy, explanation
    distributed.on_every_rank(lambda: _check_fits(strategy, profile, host, budget, device, optimizer_bytes,
                                                  cfg.grad_accumulation))
    return strategy, f"{explanation} Planned by rank 0 for all {par.world_size} ranks, for the smallest budget."


def _measure(session: TrainingSession, choice: AutoStrategy, device: torch.device,
             progress: Callable[[int, int], None] | None = None) -> tuple[object, HostNeeds, int]:
    """This rank's probe of the session on `device`, its host-RAM needs and budget, and its VRAM budget in bytes."""
    cfg = session.config
    adapter = adapter_for(session.model)
    batch = session.dataset.largest_batch(cfg.batch_size)  # not a random one: a plan must fit every batch
    latents, context, pooled = (batch[k].clone() for k in ("latents", "context", "pooled"))
    latents = adapter.process_latents(at_least_fp32(latents))  # as training's (micro_batches.prepare): Wan's time axis
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

    # the LoRA's random init and dropout draw from the global generators: the caller's stream is restored on exit
    with torch.inference_mode(False), torch.enable_grad(), seeding.forked(device), \
            adapter.training_module() as module:
        host = host_needs(module, session.strategy, choice.host_ram_budget_gb)
        inject_lora(module, session.lora, adapter.family)
        try:
            profile = probe_model(_Predictor(adapter, module, cfg.guidance), make_inputs, device, base,
                                  batch=latents.shape[0], repeats=1, progress=progress)
        finally:
            remove_lora(module)
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()  # the probe's cached blocks go back, so the free memory read next is real
    budget = planner.auto_budget(device) if choice.vram_budget_gb == 0 else int(choice.vram_budget_gb * 2**30)
    return profile, host, budget


def _check_fits(strategy: Strategy, profile, host: HostNeeds, budget: int, device: torch.device,
                optimizer_bytes: float, grad_accumulation: int) -> None:
    """The plan rank 0 chose, predicted on this rank's own probe, fits this rank's VRAM and host-RAM budgets."""
    need = predict(profile, strategy, timed=False, optimizer_bytes=optimizer_bytes, grad_accumulation=grad_accumulation)
    rank = distributed.current().rank
    if need.peak_bytes > budget:
        raise StrategyError(f"rank {rank}: the plan rank 0 chose for every rank needs {format_bytes(need.peak_bytes)} "
                            f"of {device} by this rank's probe, more than its budget of {format_bytes(budget)}: free "
                            "that GPU (another program uses it), or set the Memory Strategy's vram_budget_gb to what "
                            "every GPU has free")
    if host.need(need) > host.budget_bytes:
        raise StrategyError(f"rank {rank}: the plan rank 0 chose for every rank needs {format_bytes(host.need(need))} "
                            f"of host RAM by this rank's probe, more than its host-RAM budget of "
                            f"{format_bytes(host.budget_bytes)}: free host memory on that machine, or set the Memory "
                            "Strategy's host_ram_budget_gb to what every machine has free")

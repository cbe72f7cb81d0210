"""The step loop: N optimizer steps of a session, under the memory runtime, returning a new session.

Order of one run: inject LoRA (peft) into the model's transformer -> load the session's LoRA and optimizer state ->
apply the memory strategy -> steps -> undo the strategy -> read the LoRA state back -> remove the LoRA, so the base
model leaves exactly as it came (ComfyUI shares it between nodes). Randomness (data order, noise, timesteps,
dropout) is a pure function of (seed, step), so a continued or resumed run draws what an uninterrupted one would.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..memory.runtime import MemoryRuntime
from .flow_loss import flow_matching_loss, noised
from .lora import inject_lora, load_lora_state, lora_parameters, lora_state, remove_lora
from .lora_file import save_lora
from .model_adapter import adapter_for
from .optimizer import learning_rate_at, make_optimizer
from .session import TrainingSession, clone_state
from .timesteps import sample_timesteps
from .train_config import ConfigError

Progress = Callable[[int, int, float], None]  # (steps done in this run, steps of this run, last loss)


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite; the last good LoRA was kept."""


@dataclass
class SaveTarget:
    folder: Path
    filename_prefix: str
    every: int = 0   # save every N steps (0: only when the run stops early)


@dataclass
class _Run:
    step: int
    losses: list[float] = field(default_factory=list)
    stats: list[dict] = field(default_factory=list)
    saved: list[tuple[str, int]] = field(default_factory=list)  # (path, step it holds)


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device={name!r} but CUDA is not available: choose 'auto' or 'cpu'")
    return torch.device(name)


def train(session: TrainingSession, steps: int, *, device: torch.device, save: SaveTarget | None = None,
          progress: Progress | None = None, should_stop: Callable[[], bool] | None = None) -> TrainingSession:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"steps={steps!r} is invalid: train at least 1 step")
    cfg = session.config
    session.dataset.steps_per_epoch(cfg.batch_size)  # fails early, naming batch_size, if it exceeds the dataset
    adapter = adapter_for(session.model)
    run = _Run(step=session.step)
    # ComfyUI runs nodes under inference_mode; training needs autograd (restored when this block exits)
    with torch.inference_mode(False), torch.enable_grad(), adapter.training_module() as module:
        with torch.random.fork_rng(devices=[]):  # LoRA init is seeded by the run's seed, not the global RNG
            torch.manual_seed(_derive_seed(cfg.seed, "lora-init"))
            inject_lora(module, session.lora, adapter.family)
        try:
            if session.lora_state is not None:
                load_lora_state(module, session.lora_state)
            with MemoryRuntime(module, session.strategy, device) as runtime:
                params = lora_parameters(module)
                optimizer = make_optimizer(list(params.values()), cfg, device)
                if session.optimizer_state is not None:
                    optimizer.load_state_dict(clone_state(session.optimizer_state))
                try:
                    _loop(session, steps, run, adapter, module, runtime, optimizer, params, save, progress,
                          should_stop)
                except BaseException:
                    if save is not None and run.step > session.step:
                        _save(session, run, module, save)  # the last completed step: nothing computed is lost
                    raise
                optimizer_state = clone_state(optimizer.state_dict())
            stopped_early = run.step < session.step + steps
            if save is not None and (stopped_early or save.every) and run.step > session.step \
                    and (not run.saved or run.saved[-1][1] != run.step):
                _save(session, run, module, save)
            state = lora_state(module)
        finally:
            remove_lora(module)
    return session.advanced(step=run.step, lora_state=state, optimizer_state=optimizer_state,
                            losses=session.losses + tuple(run.losses), stats=session.stats + tuple(run.stats),
                            saved=session.saved + tuple(path for path, _ in run.saved),
                            interrupted=run.step < session.step + steps)


def _loop(session, steps, run, adapter, module, runtime, optimizer, params, save, progress, should_stop) -> None:
    cfg = session.config
    first = session.step
    batches = session.dataset.batches(cfg.batch_size, cfg.seed, start_step=first * cfg.grad_accumulation)
    while run.step < first + steps:
        if should_stop is not None and should_stop():
            return
        for group in optimizer.param_groups:
            group["lr"] = learning_rate_at(cfg, run.step, first, steps)
        runtime.start_step()
        with torch.random.fork_rng(devices=[runtime.device] if runtime.device.type == "cuda" else []):
            loss = sum(_micro_step(adapter, module, runtime, next(batches), cfg, run.step, k)
                       for k in range(cfg.grad_accumulation))
        stats = runtime.end_step()
        if not math.isfinite(loss):
            optimizer.zero_grad(set_to_none=True)
            if cfg.on_nonfinite == "stop":
                raise NonFiniteLossError(
                    f"the loss became {loss} at step {run.step + 1}: training stopped and the LoRA of step "
                    f"{run.step} was kept. Lower learning_rate, use compute_dtype bf16 rather than fp16, or set "
                    "on_nonfinite='skip'")
            run.losses.append(loss)
            continue
        if cfg.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(list(params.values()), cfg.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        run.step += 1
        run.losses.append(loss)
        run.stats.append(stats.to_dict())
        if progress is not None:
            progress(run.step - first, steps, loss)
        if save is not None and save.every and run.step % save.every == 0:
            _save(session, run, module, save)


def _micro_step(adapter, module, runtime, batch, cfg, step: int, micro: int) -> float:
    seed = _derive_seed(cfg.seed, step, micro)
    torch.manual_seed(seed)  # LoRA dropout; the global RNG is restored by fork_rng around the step
    gen = torch.Generator().manual_seed(seed)
    # tensors made by a node under inference_mode cannot be saved for backward: train on ordinary copies
    latents, context, pooled = (batch[k].clone() for k in ("latents", "context", "pooled"))
    noise = torch.randn(latents.shape, generator=gen)
    t = sample_timesteps(latents.shape[0], gen, kind=cfg.timestep_sampling, shift=cfg.timestep_shift)
    dev = runtime.device
    x_t = noised(latents, noise, t).to(dev)
    with runtime.autocast():
        pred = adapter.predict(module, x_t, t.to(dev), context.to(dev), pooled.to(dev), cfg.guidance)
        loss = flow_matching_loss(pred, latents.to(dev), noise.to(dev))
    (loss / cfg.grad_accumulation).backward()
    return loss.item() / cfg.grad_accumulation


def _save(session: TrainingSession, run: _Run, module, save: SaveTarget) -> None:
    path = save_lora(save.folder, save.filename_prefix, module, session.lora,
                     metadata=lora_metadata(session, run.step))
    run.saved.append((str(path), run.step))


def lora_metadata(session: TrainingSession, step: int) -> dict[str, str]:
    adapter = adapter_for(session.model)
    return {"tightrope.base_model": adapter.base_name, "tightrope.family": adapter.family,
            "tightrope.steps": str(step), "tightrope.strategy": session.strategy.to_json()}


def _derive_seed(*parts: int) -> int:
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)

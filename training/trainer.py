"""The step loop: N optimizer steps of a session, under the memory runtime, returning a new session.

Order of one run: inject LoRA (peft) into the model's transformer -> load the session's LoRA and optimizer state ->
apply the memory strategy -> steps -> undo the strategy -> read the LoRA state back -> remove the LoRA, so the base
model leaves exactly as it came (ComfyUI shares it between nodes). Randomness (data order, noise, timesteps,
dropout) is a pure function of (seed, step), so a continued or resumed run draws what an uninterrupted one would.
"""
from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..memory.ema import CpuEma
from ..memory.runtime import MemoryRuntime
from . import distributed, seeding
from .state.atomic_write import FileWriteError, remove_stale_temporaries, safe_output_path
from .finite_check import all_finite, check_finite, nonfinite_keys
from .flow_loss import exact_summable, flow_matching_loss
from .held_stops import held_stops, raise_swallowed
from .input_checks import check_run_inputs
from .lora.layers import load_lora_state, lora_parameters, lora_state, remove_lora
from .lora.dora_scale import base_weight_of
from .lora.files import inject_lora_continuing, save_lora_state
from .lora.rescue import rescue_lora
from .micro_batches import HostInputs, MicroBatches, prepare
from .data.masks import masked_flow_loss
from .models import ModelAdapter, adapter_for
from .host_optimizer import HostOptimizer, grad_scaler, gradient_holders, optimizer_for, updated_weights
from .optimizer import learning_rate_at, load_optimizer_state, make_optimizer
from .run_errors import (NonFiniteLossError, NonFiniteWeightsError, TrainingOutOfMemoryError,
                         nonfinite_loss_or_gradients, nonfinite_weights_message, oom_message)
from .run_monitor import RunMonitor
from .schedule_free import GRAD_SCALER, ema_weights, enter_train_mode, trained_states
from .state.resume import StateOwner, fingerprints, save_state, state_path
from .session import TrainingSession, clone_state

Progress = Callable[[int, int, float], None]  # (steps done in this run, steps of this run, last loss)


@dataclass
class SaveTarget:
    folder: Path
    filename_prefix: str
    every: int = 0   # save every N steps (0: only when the run stops early)
    state: Path | None = None  # the training state file (default: <folder>/<filename_prefix>.state.safetensors)
    owner: StateOwner | None = None  # the node and run the state belongs to, recorded in it

    @property
    def state_file(self) -> Path:
        return self.state if self.state is not None else state_path(self.folder, self.filename_prefix)


@dataclass
class _Run:
    step: int
    losses: list[float] = field(default_factory=list)
    stats: list[dict] = field(default_factory=list)
    saved: list[tuple[str, int]] = field(default_factory=list)  # (path, step it holds)
    start: int = 0   # the node run's first step (a resumed run keeps the interrupted one's): schedule, progress
    end: int = 0     # the step this run ends at
    fingerprints: dict | None = None  # model + dataset, for the training state file
    saved_step: int = -1  # the step of the last LoRA + state saved
    ema: CpuEma | None = None  # the EMA of the LoRA weights, when ema_decay > 0
    data: object = None   # the images trained on: the dataset less a held-out validation part
    monitor: RunMonitor | None = None  # validation loss, TensorBoard, log lines
    host_weight: Callable | None = None  # a frozen parameter -> its value (the runtime's host master while offloaded)
    updating: bool = False  # an update began, its step is not counted: the weights are of no step, never saved
    scaler: object = None  # the fp16 loss scaler (its state is saved with the optimizer's)
    stopped: bool = False  # the host interrupted the run (ComfyUI's interrupt: it may land in the last validation)


@dataclass(frozen=True)
class _RunParts:
    """What the step loop of a run works with and reports to, set up once by `train`."""
    adapter: ModelAdapter      # predict, process_latents
    model: torch.nn.Module     # the module trained (its FSDP copy when sharded), under the runtime
    module: torch.nn.Module    # the module as given: sharing the LoRA, unsharded, what saves read
    runtime: MemoryRuntime     # its device, autocast and per-step stats
    optimizer: torch.optim.Optimizer
    params: dict               # the LoRA's parameters by name, the ones the optimizer updates
    save: SaveTarget | None    # where save_every writes (None: nothing is saved)
    progress: Progress | None  # told (steps done, steps of this run, last loss) after each step
    should_stop: Callable[[], bool] | None  # asked before each step


def train(session: TrainingSession, steps: int, *, device: torch.device, save: SaveTarget | None = None,
          progress: Progress | None = None, should_stop: Callable[[], bool] | None = None,
          run_start: int | None = None, log_dir: str | Path | None = None,
          notify: Callable[[str], None] | None = None,
          interrupts: tuple[type[BaseException], ...] = ()) -> TrainingSession:
    """`steps` optimizer steps from `session` (0: none, the validation loss of the step it is at scored if due and
    the state saved: a stop had left it unscored). run_start: where the node run that this call resumes began (its LR
    schedule and progress count from there); default session.step. log_dir: TensorBoard scalars go there; notify:
    gets the run's log lines (validation losses). interrupts: the host's interrupt exceptions (ComfyUI's ops raise
    one mid-step): the step in flight is dropped and the run ends as interrupted, as `should_stop` ends it."""
    data, validation_set = check_run_inputs(session, steps, device)  # each names its input, before any setup
    session = session.with_model_shift()  # timestep_shift 0: the model's own
    cfg = session.config
    adapter = adapter_for(session.model)
    run = _Run(step=session.step, start=session.step if run_start is None else run_start, end=session.step + steps,
               data=data)
    run.monitor = RunMonitor(session, validation_set, run_start=run.start, run_end=run.end, log_dir=log_dir,
                             notify=notify)
    started = time.time()
    # ComfyUI runs nodes under inference_mode; training needs autograd (restored when this block exits)
    with torch.inference_mode(False), torch.enable_grad(), adapter.training_module() as module:
        if save is not None:
            run.fingerprints = fingerprints(module, adapter.family, session.dataset, session.lora)
            _remove_stale_temporaries(save, started)
        with seeding.forked(device):  # LoRA init is seeded by the run's seed, not the global RNG
            seeding.seed(_training_stream_seed(cfg.seed, "lora-init"), device)
            inject_lora_continuing(module, session.lora, adapter.family)
        try:
            if session.lora_state is not None:
                load_lora_state(module, session.lora_state)
            strategy, mesh = distributed.prepare_ranks(module, session.strategy, device)  # --fsdp: shard
            with contextlib.ExitStack() as ending, MemoryRuntime(module, strategy, device, mesh=mesh) as runtime:
                model = runtime.model  # module, or its sharded copy (the runtime's first step)
                run.host_weight = runtime.host_weight  # DoRA files read base weights (lora/dora_scale.py)
                params = lora_parameters(module)
                distributed.broadcast_parameters(params.values())  # every rank starts from rank 0's LoRA
                optimizer = optimizer_for(params, cfg, strategy, device, make_optimizer)  # host: optimizer offload
                if isinstance(optimizer, HostOptimizer):
                    ending.callback(optimizer.close)  # its hooks and page-locked buffers
                if session.optimizer_state is not None:
                    load_optimizer_state(optimizer, clone_state(session.optimizer_state), list(params),
                                         cfg.weight_decay)
                enter_train_mode(optimizer)  # schedule-free: its exact train weights (schedule_free.py)
                run.ema = CpuEma(ema_weights(updated_weights(optimizer, params), optimizer), cfg.ema_decay,
                                 session.ema_state, pin=strategy.offload.pin_memory) \
                    if cfg.ema_decay else None
                if run.ema is not None:
                    ending.callback(run.ema.close)  # its copy in flight and page-locked buffer
                oom = _run_loop(session, run, _RunParts(adapter, model, module, runtime, optimizer, params, save,
                                                        progress, should_stop), interrupts)
                if oom is not None:
                    _save_after_failure(session, run, module, save, optimizer)
                    raise TrainingOutOfMemoryError(oom_message(session, run, runtime.device, oom, save))
                ending.enter_context(held_stops())  # a stop from here on waits until the run is saved and undone
                state, optimizer_state = trained_states(module, optimizer, run.scaler)
                if run.step < session.step + steps or run.stopped or (steps and save is not None and save.every):
                    _save_last_step(session, run, module, save, optimizer)  # a failing save warns, keeps a copy
                elif save is not None and run.saved_step != run.step:  # finished: --resume returns it, no training
                    _save_final_state(session, run, save, state, optimizer_state)
        finally:
            remove_lora(module)
            run.monitor.close()
    return session.advanced(step=run.step, lora_state=state, optimizer_state=optimizer_state,
                            losses=session.losses + tuple(run.losses), stats=session.stats + tuple(run.stats),
                            saved=session.saved + tuple(path for path, _ in run.saved),
                            interrupted=run.step < session.step + steps or run.stopped,
                            ema_state=run.ema.state_dict() if run.ema is not None else None,
                            validation_losses=session.validation_losses + run.monitor.validation_losses)


def _run_loop(session: TrainingSession, run: _Run, parts: _RunParts, interrupts: tuple) -> str | None:
    """The step loop. A step in flight that runs out of memory, or that the host interrupts, is dropped: returns the
    out-of-memory message, or None. Any other error saves the last completed step (nothing computed is lost)."""
    try:
        _loop(session, run, parts)
        return None
    except torch.OutOfMemoryError as e:
        oom = str(e).strip().splitlines()[0] if str(e).strip() else "out of memory"
    except interrupts:  # ComfyUI clears its interrupt flag as it raises this: the node says interrupted itself
        oom, run.stopped = None, True
    except BaseException:
        _save_after_failure(session, run, parts.module, parts.save, parts.optimizer)
        raise
    parts.optimizer.zero_grad(set_to_none=True)  # out of the except block: the step's tensors are unreferenced now
    gc.collect()
    if parts.runtime.device.type == "cuda":
        torch.cuda.empty_cache()
    return oom


def _loop(session: TrainingSession, run: _Run, parts: _RunParts) -> None:
    cfg, adapter, runtime, optimizer = session.config, parts.adapter, parts.runtime, parts.optimizer
    # fp16 gradients underflow without loss scaling (bf16 and fp32 need none: the scaler then passes through)
    scaler = grad_scaler(optimizer, runtime.device.type, enabled=session.strategy.precision.compute_dtype == "fp16")
    if scaler.is_enabled() and GRAD_SCALER in (session.optimizer_state or {}):  # resumed or continued: its scale
        scaler.load_state_dict(session.optimizer_state[GRAD_SCALER])
    run.scaler = scaler
    batches = run.data.planned_batches(cfg.batch_size, cfg.seed, start_step=session.step * cfg.grad_accumulation,
                                       shard=distributed.current().shard)

    def make(batch: dict, step: int, micro: int, share: float) -> HostInputs:
        return prepare(batch, adapter.process_latents, _training_stream_seed(cfg.seed, step, micro), share,
                       timestep_sampling=cfg.timestep_sampling, timestep_shift=cfg.timestep_shift,
                       timestep_range=cfg.timestep_range)
    micro_batches = None
    try:
        # a stop landing while MicroBatches starts its worker thread (Thread.start waits for it: a signal can raise
        # there) left the thread running, registered nowhere: never closed, the process hung at exit. Held until
        # the object exists, so `finally` closes it
        with held_stops():
            micro_batches = MicroBatches(batches, cfg.grad_accumulation, run.step, run.end, make)  # read one ahead
        _steps(session, run, parts, micro_batches, scaler)
    finally:
        if micro_batches is not None:
            micro_batches.close()


def _steps(session: TrainingSession, run: _Run, parts: _RunParts, micro_batches: MicroBatches, scaler) -> None:
    cfg = session.config
    adapter, model, runtime, optimizer, save = parts.adapter, parts.model, parts.runtime, parts.optimizer, parts.save
    # the run's first step (or one a stop left unscored)
    run.monitor.validate(run.step, adapter, model, runtime, optimizer)
    while run.step < run.end:
        raise_swallowed()  # a stop a finalizer swallowed (held_stops.py) stops here, before the next step
        if parts.should_stop is not None and parts.should_stop():
            return
        for group in optimizer.param_groups:
            group["lr"] = learning_rate_at(cfg, run.step, run.start, run.end - run.start)
        runtime.start_step()
        with seeding.forked(runtime.device):  # the step's loss: the mean over its images (step_batches)
            # summed on the device and read once: a read per micro-batch made the host wait for each backward
            # (the next micro-batch is read and prepared meanwhile, on MicroBatches' worker)
            loss = float(sum(_micro_step(parts, micro_batches.take(run.step, k), cfg, scaler)
                             for k in range(cfg.grad_accumulation)))
        grads = gradient_holders(optimizer, parts.params)  # host copies under optimizer offload, once landed
        loss = distributed.all_reduce_gradients(grads.values(), loss)  # global-batch mean (no-op: 1 process)
        with held_stops():  # a stop waits until this step's update and its count are both done (exact resume)
            _update(cfg, run, optimizer, grads, scaler, loss)
            optimizer.zero_grad(set_to_none=True)
            if run.ema is not None:
                run.ema.update()
            stats = runtime.end_step()  # a step is the whole step: the planner's prediction includes the optimizer
            run.step += 1
            run.updating = False
            run.losses.append(loss)
            run.stats.append(stats.to_dict())
        if parts.progress is not None:
            parts.progress(run.step - run.start, run.end - run.start, loss)
        run.monitor.step_done(run.step, loss, optimizer.param_groups[0]["lr"], run.stats[-1])
        run.monitor.validate(run.step, adapter, model, runtime, optimizer)  # before the save: the state file holds it
        if save is not None and save.every and run.step % save.every == 0:
            _save(session, run, parts.module, save, optimizer)  # not the sharded copy: DoRA reads base weights


def _update(cfg, run: _Run, optimizer, params: dict, scaler, loss: float) -> None:
    """The optimizer step of a finished forward/backward, or its refusal when something went non-finite."""
    nonfinite = nonfinite_loss_or_gradients(loss, params, scaler)
    if nonfinite:
        if cfg.on_nonfinite == "stop":
            optimizer.zero_grad(set_to_none=True)
            kept = f"the LoRA of step {run.step} was kept" if run.step else "nothing had been trained yet"
            raise NonFiniteLossError(
                f"{nonfinite} at step {run.step + 1}: training stopped and {kept}. Lower "
                "learning_rate, use compute_dtype bf16 rather than fp16, or set on_nonfinite='skip'")
        # 'skip': the step counts but changes nothing, so later steps see the data an uninterrupted run would
        warnings.warn(f"{nonfinite} at step {run.step + 1}: step skipped (on_nonfinite='skip'), the LoRA is "
                      "unchanged", stacklevel=3)
        return
    if cfg.max_grad_norm > 0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(list(params.values()), cfg.max_grad_norm)
    run.updating = True  # from here until the step is counted, an error leaves weights of no step to save
    scaler.step(optimizer)  # skips the step if fp16 gradients overflowed, and lowers the scale
    scaler.update()
    if not all_finite(params.values()):  # one fused max-abs over the (small) LoRA weights per step
        raise NonFiniteWeightsError(nonfinite_weights_message(run, loss))


def _micro_step(parts: _RunParts, inputs: HostInputs, cfg, scaler) -> torch.Tensor:
    """Forward and backward of a micro-batch made ready on the host (micro_batches.prepare); returns its weighted
    loss unread (flow_loss.exact_summable)."""
    seed = inputs.seed
    par = distributed.current()
    # LoRA dropout (per rank: ranks' parts must not share masks); the global RNG is restored by seeding.forked
    seeding.seed(_training_stream_seed(seed, "rank", par.rank) if par.distributed else seed, parts.runtime.device)
    # every host->device copy is made before the forward is queued, on a stream of its own (the host does not wait
    # for the micro-batch before to finish, as a blocking copy on the compute stream would make it)
    x_t, t, context, pooled, latents, noise, mask = parts.runtime.inputs(
        inputs.x_t, inputs.t, inputs.context, inputs.pooled, inputs.latents, inputs.noise, inputs.mask)
    with parts.runtime.autocast():
        pred = parts.adapter.predict(parts.model, x_t, t, context, pooled, cfg.guidance, parts.runtime.inputs)
        loss = flow_matching_loss(pred, latents, noise, kind=cfg.loss, huber_delta=cfg.huber_delta) \
            if mask is None else masked_flow_loss(pred, latents, noise, mask, kind=cfg.loss,
                                                  huber_delta=cfg.huber_delta)
    weight = inputs.weight
    scaler.scale(loss if weight == 1.0 else loss * weight).backward()
    return exact_summable(loss.detach()) * weight


def _save(session: TrainingSession, run: _Run, module, save: SaveTarget, optimizer) -> None:
    """The LoRA file of this step (a new name), then the training state file (replaced), both atomically; never
    anything holding NaN/inf (NonFiniteDataError: the files of the last good step stay)."""
    if not distributed.current().is_main:
        return  # under torchrun only rank 0 writes
    lora, optimizer_state = trained_states(module, optimizer, run.scaler)
    check_finite(lora | _optimizer_tensors(optimizer_state), f"the training state of step {run.step}",
                 "it was not saved and the files of the last good step stay; lower learning_rate")
    # a stop waits for each write and its record: one landing between them wrote this step's LoRA again under the
    # next counter at the stop's save (found by a helper: two files of step 10, the later ones numbered one higher)
    if not run.saved or run.saved[-1][1] != run.step:  # else this step's LoRA is on disk, its state file failed
        with held_stops():
            path = save_lora_state(save.folder, save.filename_prefix, lora, session.lora,
                                   metadata=run_metadata(session, run.step),
                                   base_weight=base_weight_of(module, run.host_weight))
            run.saved.append((str(path), run.step))
    try:
        with held_stops():
            _save_state(session, run, save, lora, optimizer_state)
            run.saved_step = run.step
    except FileWriteError as e:  # say what is on disk: this step's LoRA, an earlier step's state
        raise FileWriteError(e.path, e.errno, e.strerror, fix=e.fix, kept=f"the LoRA of step {run.step} was saved "
                             f"({run.saved[-1][0]}), its training state was not") from e


def _save_state(session: TrainingSession, run: _Run, save: SaveTarget, lora: dict, optimizer_state: dict) -> None:
    save_state(save.state_file, session, step=run.step, run_start=run.start, run_end=run.end,
               lora_state=lora, optimizer_state=optimizer_state, losses=session.losses + tuple(run.losses),
               stats=session.stats + tuple(run.stats), saved=session.saved + tuple(p for p, _ in run.saved),
               fingerprints=run.fingerprints, owner=save.owner,
               ema_state=run.ema.state_dict() if run.ema is not None else None,
               validation=session.validation_losses + run.monitor.validation_losses)


def _save_final_state(session: TrainingSession, run: _Run, save: SaveTarget, lora: dict, optimizer_state: dict) -> None:
    """The state (the run's trained_states) of a run that ended without a save at its last step, so `--resume` returns
    it without training; the LoRA is in the session the run returns, so a failing write only warns."""
    if not distributed.current().is_main:
        return
    try:
        _save_state(session, run, save, lora, optimizer_state)
    except Exception as e:
        warnings.warn(f"could not write the training state file '{save.state_file}' at the end of the run "
                      f"({type(e).__name__}: {e}): the trained LoRA is not affected, but `--resume` will train this "
                      "node again", stacklevel=2)


def _save_after_failure(session: TrainingSession, run: _Run, module, save: SaveTarget | None, optimizer) -> None:
    """An error or a stop (Ctrl-C, a signal) ended the run: keep its last completed step (never raises)."""
    _save_last_step(session, run, module, save, optimizer)


def _save_last_step(session: TrainingSession, run: _Run, module, save: SaveTarget | None, optimizer) -> None:
    """Save the last completed step, if not saved yet. Never raises, so the original error (or the stop) goes on: a
    failing save warns, naming the file that could not be written and what was kept; a LoRA file that cannot be
    written is kept in a fallback file (lora_rescue)."""
    if save is None or run.step <= session.step or run.saved_step == run.step or run.updating \
            or nonfinite_keys(lora_state(module)):  # a failed update's weights: its error names what was kept
        return
    try:
        _save(session, run, module, save, optimizer)
    except Exception as e:
        warnings.warn(_unsaved_message(session, run, module, save, e), stacklevel=2)


def _unsaved_message(session: TrainingSession, run: _Run, module, save: SaveTarget, error: Exception) -> str:
    if isinstance(error, FileWriteError) and error.kept:
        return str(error)  # it says which file failed and that this step's LoRA was saved
    if run.saved and run.saved[-1][1] == run.step:
        return (f"the LoRA of step {run.step} was saved ({run.saved[-1][0]}), its training state was not: "
                f"{type(error).__name__}: {error}")
    if isinstance(error, OSError):
        return str(rescue_lora(error, lora_state(module), session.lora, folder=save.folder,
                               filename_prefix=save.filename_prefix, metadata=run_metadata(session, run.step),
                               step=run.step, base_weight=base_weight_of(module, run.host_weight)))
    return f"could not save the LoRA of step {run.step}: {type(error).__name__}: {error}"


def _optimizer_tensors(optimizer_state: dict) -> dict[str, torch.Tensor]:
    return {f"optimizer.{i}.{k}": v for i, entry in optimizer_state["state"].items() for k, v in entry.items()
            if isinstance(v, torch.Tensor)}


def _remove_stale_temporaries(save: SaveTarget, started: float) -> None:
    """Temp files a killed earlier run (kill -9) left in the folders this run writes to."""
    if distributed.current().is_main:
        for folder in {safe_output_path(save.folder, save.filename_prefix).parent,
                       save.state_file.parent}:
            remove_stale_temporaries(folder, older_than=started)


def run_metadata(session: TrainingSession, step: int) -> dict[str, str]:
    adapter = adapter_for(session.model)
    return {"tightrope.base_model": adapter.base_name, "tightrope.family": adapter.family,
            "tightrope.steps": str(step), "tightrope.strategy": session.strategy.to_json(),
            "tightrope.training": json.dumps(session.with_model_shift().config.to_dict(), sort_keys=True)}


def _training_stream_seed(*parts: int) -> int:
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)

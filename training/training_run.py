"""One training node's run, from its inputs to its outputs: the single call the Train node makes."""
from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from ..memory.host_memory import release_freed_host_memory
from ..memory.strategy import Strategy
from .state.atomic_write import user_output_path
from .models.model_with_lora import model_with_lora
from .state.resume import (NotThisRun, ResumeError, StateOwner, plan_changes, resume_agreed, session_digest,
                           state_path, unfinished_run)
from .session import TrainingSession
from .state.lock import state_lock
from .strategy_choice import AutoStrategy
from .train_config import ConfigError, TrainConfig
from .distributed import current, on_main_rank, resolve_device
from .input_checks import check_run_inputs
from .trainer import SaveTarget, train
from .validation import report_line as validation_report_line

RESUME_MODES = ("off", "unasked", "asked", "same run")


def run_training_node(config: TrainConfig, steps: int, *, session: TrainingSession | None, model: Any,
                      dataset: Any, lora: Any, strategy: Any, device: str, save_dir: Path, filename_prefix: str,
                      save_every: int, progress: Callable | None, should_stop: Callable[[], bool] | None,
                      resume: str = "off", state_dir: Path | None = None, node_id: str | None = None,
                      notify: Callable[[str], None] | None = None, validation_dataset: Any = None,
                      log_dir: str | Path | None = None,
                      probe_progress: Callable[[int, int], None] | None = None,
                      interrupts: tuple[type[BaseException], ...] = ()) -> tuple[TrainingSession, Any, str]:
    """One Train node. Its training state file is `state_dir` (default save_dir)/`filename_prefix`, keyed by
    `node_id`, locked against other runs while the node runs. resume: continue from that file if it is this node's,
    training only the steps this node has left; a node that had finished returns its saved outputs again, untrained
    (notify says so). "asked" (`tightrope run --resume`): if it is of this node's input session, warning about
    changed settings and refusing what cannot go on; "same run" (ComfyUI's `resume` widget): only if the inputs,
    settings and steps are the same as now (so the result is the uninterrupted run's), else notify why and train
    anew; "off": train anew. validation_dataset: scored for the validation loss
(a continued session keeps its own unless given one); log_dir: TensorBoard's folder (None: no TensorBoard);
probe_progress: told (blocks measured, of all) while an `auto` strategy's probe runs; interrupts: the host's interrupt
exceptions, which end the run as interrupted when raised inside a step (trainer.train)."""
    dev = resolve_device(device)
    user_output_path(save_dir, filename_prefix)  # a bad prefix ('..', absolute, too long) fails now, not after training
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"steps={steps!r} is invalid: train at least 1 step")
    if session is None:
        require_start_inputs(name for name, v in (("model", model), ("dataset", dataset), ("lora", lora))
                             if v is not None)
        session = TrainingSession(model=model, dataset=dataset, lora=lora, strategy=Strategy(), config=config,
                                  validation_dataset=validation_dataset)
    else:
        for name, given in (("model", model), ("lora", lora)):
            if given is not None and given is not getattr(session, name):
                raise ConfigError(f"the Train node got both a session and a different {name}: a continued session "
                                  f"keeps its {name}; disconnect the {name} input or start a new session")
        if session.optimizer_state is not None and config.optimizer != session.config.optimizer:
            raise ConfigError(f"the Train node sets optimizer={config.optimizer!r}, but its session was trained with "
                              f"{session.config.optimizer!r}, whose state cannot go on in another optimizer: set "
                              f"optimizer to {session.config.optimizer!r} to continue, or start a new session")
        session = session.advanced(config=config, dataset=dataset or session.dataset, interrupted=False,
                                   validation_dataset=validation_dataset or _inherited_validation(session, config))
    if resume not in RESUME_MODES:
        raise ValueError(f"resume={resume!r}: one of {RESUME_MODES}")
    # timestep_shift 0: the model's own, as a number before the resume check and the state file see the config
    session = session.with_model_shift()
    state_file = state_path(save_dir if state_dir is None else state_dir, filename_prefix, node_id)
    owner = StateOwner(node=node_id, input_step=session.step, input=session_digest(session))
    with state_lock(state_file):
        run_start, left, given = None, steps, session
        resumed = _resumed(state_file, session, owner, steps, resume, notify, strategy)  # rank 0's
        if resumed is not None:
            session, state = resumed
            run_start, left = state.run_start, state.run_start + steps - session.step  # what this node has left
            done = left < 1 and not _validation_unscored(session)
            if strategy is None or isinstance(strategy, Strategy):  # the memory settings now, not the state's: a
                # Memory Strategy edited to fit, on this node or (none here) on the node before it, is the one the
                # rest of the run trains with, and a finished run's result names it as a fresh run would; unless
                # it changes the numbers (headless --resume goes on anyway): the result names what it was trained with
                now = given.strategy if strategy is None else strategy
                if not (done and plan_changes(state.info, now)):
                    session = session.advanced(strategy=now)
            if done:
                return _finished(session, state, state_file, steps, progress, notify)
            if left < 1:  # a stop landed in the last step's validation: scored now (0 steps), then saved
                left = 0
                if notify is not None:
                    notify(f"Train node{_named(node_id)} had finished its steps (step {session.step} in "
                           f"'{state_file}'), but a stop left its validation loss unscored: scoring it")
            elif notify is not None:
                notify(f"Train node{_named(node_id)} goes on from step {session.step} of its run (steps "
                       f"{state.run_start}-{state.run_start + steps}), saved in '{state_file}'")
        explanation = ""
        check_run_inputs(session, left, dev)  # before an auto strategy's probe loads and runs the model
        plan = plan_key(strategy, dev) if isinstance(strategy, AutoStrategy) else ""
        # rank 0 decides (plan_key names its GPU; the ranks resumed the same state): one rank planning alone would hang
        if resumed is not None and plan and on_main_rank(lambda: resumed[1].info.get("owner", {}).get("plan") == plan):
            # the same request on the same device: the interrupted run's plan (a new probe could pick another, with
            # other rounding: token chunks, compile), so the resumed run equals an uninterrupted one
            explanation = resumed[1].info["owner"].get("note", "")
        elif strategy is not None:
            chosen, explanation = resolve_strategy(strategy, session, dev, probe_progress)
            session = session.advanced(strategy=chosen)
            changed = plan_changes(resumed[1].info, chosen) if resumed is not None else []
            if changed and resume == "same run":  # not the very same run: it trains anew (found by a helper)
                if notify is not None:
                    notify(f"Train node{_named(node_id)} trains from its input, not from its saved state: "
                           f"{'; '.join(changed)}; the file is replaced")
                session, run_start, left = given.advanced(strategy=chosen), None, steps
            elif changed and current().is_main:  # rank 0 says it, once
                warnings.warn(f"resuming '{state_file}' with changed training settings ({'; '.join(changed)}): the "
                              "run goes on, but will not match an uninterrupted run", stacklevel=2)
        save = SaveTarget(save_dir, filename_prefix, save_every, state=state_file,
                          owner=StateOwner(node_id, owner.input_step, owner.input, explanation, plan))
        result = train(session, left, device=dev, save=save, progress=progress, should_stop=should_stop,
                       run_start=run_start, log_dir=log_dir, notify=notify, interrupts=interrupts)
        if left == 0 and progress is not None and result.losses:
            progress(steps, steps, result.losses[-1])  # its progress bar shows it done
    release_freed_host_memory()  # train() has returned: its optimizer, LoRA layers and save buffers are freed now
    node_start = session.step if run_start is None else run_start  # the report covers the node's whole run
    return result, model_with_lora(result), report(result, result.step - node_start, explanation)


def require_start_inputs(connected: Iterable[str]) -> None:
    """A run without a session starts from a model, a dataset and a LoRA: ConfigError naming those not `connected`
    (the node's queue-time check passes the names of its inputs; the run, those it got)."""
    connected = set(connected)
    missing = [name for name in ("model", "dataset", "lora") if name not in connected]
    if missing:
        raise ConfigError(f"the Train node has no {', '.join(missing)} input: connect model, dataset and lora (to "
                          "start) or a session from another Train node (to continue)")


def _resumed(state_file: Path, session: TrainingSession, owner: StateOwner, steps: int, mode: str,
             notify: Callable[[str], None] | None, strategy: Any = None) -> tuple[TrainingSession, Any] | None:
    """The session and state to go on from, or None to train anew (see run_training_node's `resume`)."""
    if mode == "off":
        return None
    if mode == "unasked":  # headless without --resume: never train over an interrupted run's state unasked
        on_main_rank(lambda: refuse_unfinished(state_file, owner.node))
        return None
    if mode == "asked" and notify is not None and not on_main_rank(state_file.is_file):
        notify(f"Train node{_named(owner.node)}: --resume found no saved state in '{state_file}'; it trains from "
               "the start (check --output-dir if a run was interrupted)")
    try:
        return resume_agreed(state_file, session, owner=owner, steps=steps, same_run=mode == "same run",
                             strategy=strategy)
    except NotThisRun as e:
        if notify is not None:
            notify(f"Train node{_named(owner.node)} trains from its input, not from its saved state: {e}; the file "
                   "is replaced")
        return None


def refuse_unfinished(state_file: Path, node_id: str | None) -> None:
    """Headless without --resume: the state of an interrupted run of this node would be replaced by the new run's
    first save, losing its steps; refused before training (`tightrope run` asks it of every Train node before the
    first node runs), naming both ways on."""
    progress = unfinished_run(state_file)
    if progress is not None:
        step, end = progress
        raise ResumeError(f"Train node{_named(node_id)}'s run was interrupted at step {step} of {end} (saved in "
                          f"'{state_file}'): run again with --resume to go on from it, or delete that file to train "
                          "from the start")


def _named(node_id: str | None) -> str:
    return "" if node_id is None else f" {node_id}"


def _finished(session: TrainingSession, state: Any, state_file: Path, steps: int, progress: Callable | None,
              notify: Callable[[str], None] | None) -> tuple[TrainingSession, Any, str]:
    """A node that had finished, resumed: the outputs and report it returned then, untrained."""
    owner = state.info.get("owner") or {}
    if notify is not None:
        notify(f"Train node{_named(owner.get('node'))} had finished (step {session.step} in '{state_file}'): "
               "nothing to do, its saved outputs are used")
    if progress is not None and session.losses:
        progress(steps, steps, session.losses[-1])  # its progress bar shows it done
    return session, model_with_lora(session), report(session, session.step - state.run_start, owner.get("note", ""))


def _validation_unscored(session: TrainingSession) -> bool:
    """A finished run's state without its last step's validation loss (a stop landed while it was scored)."""
    validates = session.validation_dataset is not None or session.config.validation_fraction > 0
    return validates and not (session.validation_losses and session.validation_losses[-1][0] == session.step)


def _inherited_validation(session: TrainingSession, config: TrainConfig) -> Any:
    """A continued session validates on its validation_dataset, unless this node holds out a validation_fraction."""
    return session.validation_dataset if config.validation_fraction == 0 else None


def plan_key(choice: AutoStrategy, device) -> str:
    """What an auto strategy's plan depends on besides the model and data: the request and the device."""
    name = f"{torch.cuda.get_device_name(device)}, {torch.cuda.get_device_properties(device).total_memory} B" \
        if device.type == "cuda" else device.type
    return f"{json.dumps(dataclasses.asdict(choice), sort_keys=True)} on {name}"


def resolve_strategy(choice: Any, session: TrainingSession, device,
                     progress: Callable[[int, int], None] | None = None) -> tuple[Strategy, str]:
    if isinstance(choice, Strategy):
        return choice, ""
    if isinstance(choice, AutoStrategy):
        from .auto_plan import plan_for_session
        return plan_for_session(session, choice, device, progress)
    raise ConfigError(f"the strategy input is a {type(choice).__name__}: connect a Memory Strategy node")


def report(session: TrainingSession, steps: int, explanation: str = "") -> str:
    run_losses = session.losses[-steps:] if steps > 0 else ()
    head = sum(run_losses[:10]) / max(len(run_losses[:10]), 1)
    tail = sum(run_losses[-10:]) / max(len(run_losses[-10:]), 1)
    stats = session.stats[-1] if session.stats else {}
    lines = [f"step {session.step}" + (" (interrupted)" if session.interrupted else ""),
             f"loss: first-10 mean {head:.4f}, last-10 mean {tail:.4f}"]
    if stats:
        lines.append(f"last step: {stats['step_time_s']:.3f} s, {_memory(stats)}, streamed "
                     f"{stats['h2d_bytes'] / 2**20:.1f} MiB")
    cfg = session.config
    in_range = f", range {cfg.timestep_min:.4g} to {cfg.timestep_max:.4g}" if cfg.timestep_range != (0, 1) else ""
    lines.append(f"timesteps: {cfg.timestep_sampling}, shift {cfg.timestep_shift:.3g}{in_range}")
    validation = validation_report_line(session.validation_losses)
    if validation:
        lines.append(validation)
    if session.last_saved:
        lines.append(f"saved: {session.last_saved}")
    if explanation:
        lines.append(explanation)
    return "\n".join(lines)


def _memory(stats: dict) -> str:
    """Peak allocated / reserved / device used (CUDA); off CUDA the allocator figures are 0: not measured."""
    if not stats.get("peak_reserved_bytes"):
        return "peak memory not measured (CPU)"
    gib = [stats.get(k, 0) / 2**30 for k in ("peak_allocated_bytes", "peak_reserved_bytes", "device_used_bytes")]
    return "peak allocated {:.2f} GiB, reserved {:.2f} GiB, device used {:.2f} GiB".format(*gib)

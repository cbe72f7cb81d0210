"""The training state file: everything a run needs to go on exactly where it stopped, never pickled.

One file per Train node: `<state dir>/<filename_prefix>.node-<node id>.state.safetensors` (the state dir is
nodes/host.state_dir(), never under the loras folder, where ComfyUI would list it as a LoRA). The trainer replaces it
atomically whenever it saves a LoRA and when the node's run ends, so a finished node resumes to "nothing to do".
It holds tensors under `lora.<peft name>` and `optimizer.<index>.<key>`; everything else is JSON in the metadata key
`tightrope.resume_state`: step, the node run's start and end step, its owner (node id and a digest of the session the
node started from, see StateOwner), LoRA spec, TrainConfig, Strategy, the optimizer's param_groups and non-tensor
state and fingerprints of the model, the dataset and an existing_lora file (fingerprints.py). The history, which grows
with every step (losses, per-step stats, saved LoRA paths, validation losses: ~290 bytes a step), is JSON too, but in
the uint8 tensor `history.json`: safetensors refuses a header over 100 MB, which the metadata reached after ~350,000
steps of a session (chained nodes add up), and every save then failed (v1 files, with it in the metadata, still load).
No random state: every draw of a step (data order, noise, timesteps, dropout) is a
function of (seed, step), so resuming sets no global RNG (files of earlier versions hold `rng.*` tensors, ignored).
With an EMA (ema_decay > 0) the tensors include `ema.<peft name>`.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ...memory.strategy import Strategy
from .. import distributed
from .atomic_write import atomic_save_file, safe_output_path
from ..finite_check import check_finite
from ..lora.targets import LoraError
from .fingerprints import dataset_fingerprint, fingerprints, lora_file_digest, model_fingerprint, model_mismatch

STATE_SUFFIX = ".state.safetensors"
FORMAT = "tightrope-training-state-v2"  # v2: the history in the `history.json` tensor, not in the metadata
_READABLE = (FORMAT, "tightrope-training-state-v1")
_HISTORY = "history.json"  # the tensor holding the JSON of what grows with every step
_META = "tightrope.resume_state"
LORA_SHAPING = ("algorithm", "rank", "alpha", "rslora", "targets", "target_regex")  # must match to resume a LoRA
_LORA_BEFORE = {"algorithm": "lora"}  # what a state file written before a shaping field existed was trained with
_CONFIG_BEFORE = {"timestep_min": 0.0, "timestep_max": 1.0}  # and a setting: a range set now is a change


class ResumeError(ValueError):
    """A training state file cannot be resumed here; the message names the file and the fix."""


class NotThisRun(ResumeError):
    """resume_session(same_run=True): the state file is not of this very run; the message says what differs."""


@dataclass(frozen=True)
class TrainingState:
    step: int
    run_start: int   # the step the interrupted node run began at (its schedule and remaining steps count from it)
    run_end: int
    lora_state: dict[str, torch.Tensor]
    optimizer_state: dict
    info: dict       # the JSON part
    ema_state: dict[str, torch.Tensor] | None = None  # the EMA of the LoRA weights (`ema.<peft name>`), if kept


@dataclass(frozen=True)
class StateOwner:
    """Which node of which run a state file belongs to; a file of another node or run is never resumed from."""
    node: str | None  # the Train node's id in its workflow (ComfyUI's UNIQUE_ID); None when called directly
    input_step: int   # the step of the session the node started from
    input: str        # session_digest() of that session: another upstream run gives another digest
    note: str = ""    # the node's strategy explanation, repeated in the report when a finished node resumes
    plan: str = ""    # an auto strategy's request and device (training_run.plan_key): resuming it keeps the plan


def state_path(folder: str | os.PathLike, filename_prefix: str, node: str | None = None) -> Path:
    base = safe_output_path(folder, filename_prefix)
    tag = "" if node is None else ".node-" + re.sub(r"[^A-Za-z0-9_-]", "_", str(node))  # ComfyUI ids: "7", "12:3"
    return base.with_name(base.name + tag + STATE_SUFFIX)


def session_digest(session: Any) -> str:
    """A hash of a session's step and LoRA weights (bit for bit): what a downstream node's state was trained from."""
    h = hashlib.sha256(f"step {session.step};".encode())
    for name, t in sorted((session.lora_state or {}).items()):
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# ------------------------------------------------------------------------------------------------ save / load
def save_state(path: Path, session: Any, *, step: int, run_start: int, run_end: int,
               lora_state: dict[str, torch.Tensor], optimizer_state: dict, losses, stats, saved,
               fingerprints: dict, owner: StateOwner | None = None,
               ema_state: dict[str, torch.Tensor] | None = None, validation=()) -> Path:
    """Write the state of `session` at `step` atomically (a crash mid-write leaves the previous file)."""
    tensors = {f"lora.{k}": v for k, v in lora_state.items()} | {f"ema.{k}": v for k, v in (ema_state or {}).items()}
    scalars: dict[str, dict[str, Any]] = {}
    for index, entry in optimizer_state["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer.{index}.{key}"] = value.detach().cpu()
            else:
                scalars.setdefault(str(index), {})[key] = value
    info = {"step": step, "run_start": run_start, "run_end": run_end, "lora": session.lora.to_dict(),
            "config": session.config.to_dict(), "strategy": session.strategy.to_dict(),
            "optimizer": {"param_groups": optimizer_state["param_groups"], "scalars": scalars,
                          "grad_scaler": optimizer_state.get("grad_scaler")},
            **fingerprints, "owner": None if owner is None else asdict(owner),
            "layout": distributed.resume_fields(session.config.batch_size)}
    history = {"losses": list(losses), "stats": list(stats), "saved": list(saved),
               "validation": [list(p) for p in validation]}
    tensors[_HISTORY] = _padded_bytes(json.dumps(history).encode())
    return atomic_save_file(tensors, path, {"format": FORMAT, _META: json.dumps(info)})


def _padded_bytes(data: bytes) -> torch.Tensor:
    """`data` as a uint8 tensor padded with spaces (JSON ignores them) to one of 8 lengths per doubling (a multiple of
    4 KiB; at most 12.5% or 4 KiB more bytes): safetensors writes a tensor through a ctypes array type of its byte
    length, which ctypes caches for good (5.7 KB each), so a history of a new length at every save grew the process by
    one such type per save; this way a history of 100 MB has used at most ~120 lengths."""
    granule = 1 << max(12, len(data).bit_length() - 4)
    size = max(1 << 12, -(-len(data) // granule) * granule)
    return torch.frombuffer(bytearray(data + b" " * (size - len(data))), dtype=torch.uint8)


def load_state(path: str | os.PathLike) -> TrainingState:
    """The state in `path`. Errors name the file and say what to do."""
    path = Path(path)
    fix = "delete it (the LoRA files are intact) to start this run anew"
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            # copies: safetensors' tensors are views of a mapping of the whole file, which would stay mapped as long
            # as they live (the optimizer state and a finished run's LoRA do, for the run or in ComfyUI's cache), and
            # Windows refuses to replace a mapped file: the run's next save of this state failed (PermissionError)
            tensors = {k: f.get_tensor(k).clone() for k in f.keys()}
    except Exception as e:  # safetensors raises several types for a damaged or truncated file
        raise ResumeError(f"training state file '{path}' could not be read ({e}): it is damaged; {fix}") from None
    if meta.get("format") not in _READABLE or _META not in meta:
        raise ResumeError(f"'{path}' is not a Tightrope training state file ({FORMAT}): {fix}")
    history = tensors.pop(_HISTORY, None)  # v2; a v1 file holds it in the metadata
    check_finite(tensors, f"training state file '{path}'", f"it is damaged or was saved by a run that diverged; {fix}")
    info = json.loads(meta[_META])
    if history is not None:
        try:
            info.update(json.loads(history.numpy().tobytes().decode()))
        except ValueError:  # UnicodeDecodeError and JSONDecodeError
            raise ResumeError(f"training state file '{path}' could not be read (its history is not JSON): it is "
                              f"damaged; {fix}") from None
    state: dict[int, dict[str, Any]] = {}
    for key, t in tensors.items():
        if key.startswith("optimizer."):
            index, name = key[len("optimizer."):].split(".", 1)
            state.setdefault(int(index), {})[name] = t
    for index, entries in info["optimizer"]["scalars"].items():
        state.setdefault(int(index), {}).update(entries)
    groups = [{k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in g.items()}
              for g in info["optimizer"]["param_groups"]]
    lora = {k[len("lora."):]: t for k, t in tensors.items() if k.startswith("lora.")}
    ema = {k[len("ema."):]: t for k, t in tensors.items() if k.startswith("ema.")}
    optimizer_state = {"state": dict(sorted(state.items())), "param_groups": groups}
    if info["optimizer"].get("grad_scaler") is not None:  # fp16 (see schedule_free.trained_states)
        optimizer_state["grad_scaler"] = info["optimizer"]["grad_scaler"]
    result = TrainingState(step=info["step"], run_start=info["run_start"], run_end=info["run_end"], lora_state=lora,
                           optimizer_state=optimizer_state, info=info, ema_state=ema or None)
    return result


def unfinished_run(path: str | os.PathLike) -> tuple[int, int] | None:
    """(step, run end) of the node run saved in `path` if it stopped before its end; None if it finished, or there
    is no readable state there (a damaged file is resume's to report). Reads the header only."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
        info = json.loads(meta[_META]) if meta.get("format") in _READABLE else None
    except Exception:  # missing, damaged, not ours
        return None
    if not info or not isinstance(info.get("step"), int) or not isinstance(info.get("run_end"), int):
        return None
    return (info["step"], info["run_end"]) if info["step"] < info["run_end"] else None


# ------------------------------------------------------------------------------------------------ resume
def resume_session(path: Path, session: Any, *, owner: StateOwner | None = None, steps: int | None = None,
                   same_run: bool = False, strategy: Any = None) -> tuple[Any, TrainingState] | None:
    """`session` (built from the node's inputs) advanced to the state in `path`, checked against its owner, model
    and LoRA settings, and the state; restores the strategy the state was trained with.
    owner: this node (None: not checked); a state of another node is refused, one of another run of this node
    (another input session) ignored with a warning: None. steps: the node's steps now (warns if they changed).
    same_run (ComfyUI's `resume` widget): go on only from this very run, whose end equals an uninterrupted run's:
    another input, model, dataset, setting or step count raises NotThisRun naming it (the caller trains anew).
    strategy: the node's (a Strategy: its precision must be the state's to count as the same run; None, no strategy
    input: the session's, which the node then trains with)."""
    from ..models import adapter_for
    try:
        state = load_state(path)
    except ResumeError as e:
        if same_run:  # a damaged file: this run starts anew and replaces it
            raise NotThisRun(str(e)) from None
        raise
    info = state.info
    session = session.with_model_shift()  # the state recorded the number trained with
    if owner is not None and _other_run(path, info.get("owner"), owner, quiet=same_run):
        if same_run:
            raise NotThisRun(f"training state file '{path}' is of another run of this node (it went on from "
                             "another input session)")
        return None
    spec = _as_saved(session.lora.to_dict())
    saved = {**_LORA_BEFORE, **info["lora"]}
    optimizer = info["config"].get("optimizer", session.config.optimizer)
    now = _as_saved(session.config.to_dict())
    diff = [f"{k}: {v!r} -> {now.get(k)!r}" for k, v in (_CONFIG_BEFORE | info["config"]).items() if now.get(k) != v]
    diff += [f"LoRA {k}: {v!r} -> {spec.get(k)!r}" for k, v in info["lora"].items() if spec.get(k) != v]
    if steps is not None and steps != state.run_end - state.run_start:
        diff.append(f"steps: {state.run_end - state.run_start} -> {steps}")
    diff += _changed_inputs(info, session, strategy)
    world, now_world = info.get("layout", {}).get("world_size"), distributed.current().world_size
    if world is not None and int(world) != now_world:  # the same samples, summed over the ranks in another order
        diff.append(f"world size: {world} -> {now_world}")
    other_data = info.get("dataset") not in ("unknown", dataset_fingerprint(session.dataset))
    if same_run and (other_data or diff):  # before the model's fingerprint (a ComfyUI model is unloaded for it)
        raise NotThisRun(f"training state file '{path}' is of a run with "
                         f"{'; '.join(['another dataset'] * other_data + diff)}")
    adapter = adapter_for(session.model)
    with torch.inference_mode(False), adapter.training_module() as module:
        model_now = model_fingerprint(module, adapter.family)
    problem = model_mismatch(info["model"], model_now)
    if not problem and info["model"].get("exact", model_now["exact"]) != model_now["exact"]:
        if same_run:
            problem = ("other base weights: another file or weight dtype, or another LoRA or strength applied to the "
                       "MODEL")
        else:
            diff.append("the base weights (another weight dtype, or a LoRA applied to the MODEL)")
    if same_run and problem:
        raise NotThisRun(f"training state file '{path}' is of a run with another model ({problem})")
    if problem:
        raise ResumeError(f"training state file '{path}' belongs to another model ({problem}): connect the model it "
                          "was trained on, or use another filename_prefix (or delete the file) to train this model "
                          "from the start")
    distributed.check_resume(info.get("layout", {}), session.config.batch_size)  # world size may change
    changed = [f"{k}={saved[k]!r} (now {spec[k]!r})" for k in LORA_SHAPING if saved[k] != spec[k]]
    if changed:
        raise LoraError(f"training state file '{path}' was trained with LoRA {', '.join(changed)}: set the LoRA Setup "
                        "back to those values to resume, or use another filename_prefix to start a new LoRA")
    if optimizer != session.config.optimizer:
        raise ResumeError(f"training state file '{path}' was trained with optimizer={optimizer!r} (now "
                          f"{session.config.optimizer!r}), whose state cannot go on in another optimizer: set "
                          f"optimizer back to {optimizer!r} to resume, or use another filename_prefix to start anew")
    if other_data:
        warnings.warn(f"resuming '{path}' with a different dataset than it was trained on: the run goes on, but "
                      "will not match an uninterrupted run", stacklevel=2)
    finished = steps is not None and state.step >= state.run_start + steps  # nothing left: its result is returned
    if diff and finished:  # the changed settings take no effect: its LoRA's metadata must not claim them
        warnings.warn(f"'{path}' holds a finished run with other training settings ({'; '.join(diff)}): --resume "
                      "returns its result, trained with the settings it was trained with (its LoRA's metadata names "
                      "them); run without --resume, or delete the file, to train with the settings now",
                      stacklevel=2)
    elif diff:
        warnings.warn(f"resuming '{path}' with changed training settings ({'; '.join(diff)}): the run goes on, but "
                      "will not match an uninterrupted run", stacklevel=2)
    trained = _trained_config(info, session.config) if finished else session.config
    resumed = session.advanced(config=trained,
        step=state.step, lora_state=state.lora_state, optimizer_state=state.optimizer_state,
        losses=tuple(info["losses"]), stats=tuple(info["stats"]), saved=tuple(info["saved"]), interrupted=False,
        strategy=Strategy.from_dict(info["strategy"]),  # a node given a strategy input resolves it again to train on
        ema_state=state.ema_state,
        validation_losses=tuple((step, loss) for step, loss in info.get("validation", ())))
    return resumed, state


def resume_agreed(path: Path, session: Any, *, owner: StateOwner | None = None, steps: int | None = None,
                  same_run: bool = False, strategy: Any = None) -> tuple[Any, TrainingState] | None:
    """resume_session from `path` if it exists, the same on every rank under torchrun. Each rank reads `path` in its
    own --output-dir, which another machine may not share, see late or hold an older copy of: so rank 0 decides
    (whether to resume, and from which state), the others load that same state or every rank stops (one line each),
    never some ranks at step k and others at 0, whose collectives would hang or mix."""
    par = distributed.current()
    if not par.distributed:
        return resume_session(path, session, owner=owner, steps=steps, same_run=same_run, strategy=strategy) \
            if path.is_file() else None
    mine: list = [None]

    def decide() -> tuple[int, str] | None:  # rank 0: a refusal there is every rank's (on_main_rank)
        mine[0] = resume_session(path, session, owner=owner, steps=steps, same_run=same_run, strategy=strategy) \
            if path.is_file() else None
        return None if mine[0] is None else _identity(mine[0][1])

    chosen = distributed.on_main_rank(decide)
    if chosen is None:
        return None  # every rank starts this node anew
    return distributed.on_every_rank(lambda: mine[0] if par.is_main else _follow(path, session, owner, steps, chosen,
                                                                                 strategy))


def _identity(state: TrainingState) -> tuple[int, str]:
    """The state's step and a digest of its JSON part (its losses, owner, settings): another file differs."""
    return state.step, hashlib.sha256(json.dumps(state.info, sort_keys=True).encode()).hexdigest()


def _follow(path: Path, session: Any, owner: StateOwner | None, steps: int | None,
            chosen: tuple[int, str], strategy: Any = None) -> tuple[Any, TrainingState]:
    """A rank other than 0: the state rank 0 resumes from (`chosen`), read from its own `path`, or a ResumeError."""
    rank, step = distributed.current().rank, chosen[0]
    where = f"rank {rank} cannot resume step {step} as rank 0 does: its training state file '{path}'"
    fix = ("every rank reads the training state in its --output-dir: put that folder on a file system every machine "
           "shares (or copy rank 0's file to every machine), or run without --resume")
    if not path.is_file():
        raise ResumeError(f"{where} does not exist; {fix}")
    try:
        with warnings.catch_warnings():  # rank 0 warned of what changed: once, not once per rank
            warnings.simplefilter("ignore")
            resumed = resume_session(path, session, owner=owner, steps=steps, strategy=strategy)
    except ResumeError as e:
        raise ResumeError(f"{where} cannot be used ({e}); {fix}") from None
    if resumed is None or _identity(resumed[1]) != chosen:
        held = "another run's state" if resumed is None or resumed[1].step == step else f"step {resumed[1].step}"
        raise ResumeError(f"{where} is not rank 0's (it holds {held}); {fix}")
    return resumed


def _other_run(path: Path, saved: dict | None, owner: StateOwner, quiet: bool = False) -> bool:
    """True (with a warning unless quiet) if the state at `path` was written by this node in another run; raises if
    it was written by another node (a renamed or copied file; NotThisRun when quiet)."""
    if saved is not None and saved["node"] != owner.node:
        refusal = NotThisRun if quiet else ResumeError
        raise refusal(f"training state file '{path}' belongs to node {saved['node']}, not to this node {owner.node}: "
                      "it must not be resumed here; delete it (or give it back its own name)")
    if saved is not None and saved["input"] == owner.input:
        return False
    if quiet:
        return True
    was = "a session it does not name" if saved is None else \
        f"a session of step {saved['input_step']} with other LoRA weights"
    warnings.warn(f"training state file '{path}' was saved by another run of this node: it went on from {was}, not "
                  f"from the session of step {owner.input_step} this node gets now (a node before it trained "
                  "otherwise): it is ignored; this node trains from its input and replaces the file", stacklevel=3)
    return True


def _trained_config(info: dict, config: Any) -> Any:
    """The training settings a finished run's state was trained with (`config` where the file's cannot be read back:
    a state from another version)."""
    try:
        return type(config).from_dict({**config.to_dict(), **_CONFIG_BEFORE, **info["config"]})
    except (ValueError, TypeError):
        return config


def _changed_inputs(info: dict, session: Any, strategy: Any) -> list[str]:
    """What changed besides the settings, as resume's diff lists it: the bytes of the existing_lora file (its name
    can stay), and the parts of the node's strategy that change the numbers (_numeric_parts). An `auto` strategy's
    plan carries over while its request and device stay the same (training_run)."""
    out = []
    if "lora_file" in info and info["lora_file"] != lora_file_digest(session.lora):
        out.append("existing_lora: the same name, another file")
    if strategy is None:  # no strategy input: the node trains with its session's (the one before it, or the default)
        strategy = session.strategy
    if info.get("strategy") and isinstance(strategy, Strategy):
        out += plan_changes(info, strategy, label="")
    return out


def plan_changes(info: dict, chosen: Strategy, label: str = "auto strategy's ") -> list[str]:
    """What of `chosen` (by default an `auto` strategy's new plan for a resumed run) changes the numbers against the
    strategy the state was trained with, as resume's diff lists it (empty: the run goes on bit for bit)."""
    was, now = _numeric_parts(info.get("strategy") or {}), _numeric_parts(_as_saved(chosen.to_dict()))
    return [f"{label}{k}: {was[k]} -> {now[k]}" for k in now if k in was and was[k] != now[k]]


def _numeric_parts(strategy: dict) -> dict:
    """The parts of a strategy (as saved) that change a run's numbers: the precision; token chunks (a block's
    matmuls by chunks sum its weight gradients in another order); per-block compile (inductor's fused kernels round
    otherwise); optimizer offload (AdamW on the host: a few ulps from the device's on a GPU). Layer and activation
    offload and checkpointing move or recompute the same values: the same numbers. A part a state file predating it
    lacks is left out."""
    out = {}
    if "precision" in strategy:
        out["precision"] = strategy["precision"]
    if "token_chunks" in strategy.get("checkpointing", {}):
        out["token_chunks"] = strategy["checkpointing"]["token_chunks"]
    if "compiler" in strategy:
        out["compile"] = strategy["compiler"] if strategy["compiler"].get("scope", "off") != "off" else "off"
    if "enabled" in strategy.get("optimizer", {}):
        out["optimizer_offload"] = strategy["optimizer"]["enabled"]
    return out


def _as_saved(values: dict) -> dict:
    """`values` as they read back from the state file's JSON (tuples become lists), so equal settings compare equal."""
    return json.loads(json.dumps(values))




__all__ = ["STATE_SUFFIX", "ResumeError", "NotThisRun", "StateOwner", "TrainingState", "state_path", "session_digest",
           "save_state", "load_state", "resume_session", "resume_agreed", "plan_changes", "fingerprints",
           "model_fingerprint",
           "dataset_fingerprint"]

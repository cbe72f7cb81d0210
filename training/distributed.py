"""Data-parallel training under torchrun: one process per GPU, the same workflow on every rank.

`torchrun --nproc_per_node=N -m tightrope run WORKFLOW.json` starts N copies of the CLI; `launched()` (entered by
the CLI) reads torchrun's WORLD_SIZE / RANK / LOCAL_RANK, joins the process group (NCCL for CUDA tensors, gloo for
CPU ones) and tears it down at the end. Every rank runs every node, so the collectives line up; only rank 0 shows
progress and writes outputs (the other ranks' output folder is a private scratch folder, removed at exit). What a
rank could decide otherwise than the others (whether and from which state a node resumes, an `auto` plan) rank 0
decides and sends (`on_main_rank`); what each rank must do itself and may fail at, every rank learns of
(`on_every_rank`), so no rank goes on into collectives another one never joins.

The global batch is the workflow's `batch_size`, whatever the world size: every rank walks the same plan of global
batches (TrainingDataset.batches(..., shard=(rank, world))), loads only its contiguous part, and draws the noise and
timesteps of the *whole* global batch from the (seed, step) generator before keeping its part. So N processes see
exactly the samples, noise and timesteps one process would, and resuming with another world size changes nothing
as long as batch_size is the same. Each rank's loss is weighted by its share of the global batch, so summing the
LoRA gradients over ranks gives the gradient of the global-batch mean loss (parts may be unequal: a bucket's last
batch can be smaller than batch_size).

Gradients: one bucketed all-reduce of the LoRA gradients after the backward of the last micro-batch, not DDP. DDP
needs every forward to go through its wrapper's __call__ (the adapters call `forward_latent` / ComfyUI's
apply_model), hooks autograd per parameter (which has to agree with the memory runtime's patched block forwards,
checkpoint recomputation and per-block compile), and needs `no_sync()` for gradient accumulation. A LoRA's
gradients are a few MB to a few hundred MB, so overlapping their reduction with the backward saves little; one
flat all-reduce per step is simple and independent of how the forward was run.

Optional FSDP2 (`--fsdp`): sets the Strategy's sharding part, and `prepare_ranks` gives the memory runtime the
device mesh over the ranks; the runtime shards the blocks' frozen weights as its first step (memory/sharding.py).
The LoRA stays replicated and is reduced as above. See docs/distributed.md for when to shard and when to offload.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from ..memory.strategy import ShardingConfig, Strategy
from .rank_lost import collective
from .train_config import ConfigError

T = TypeVar("T")
BUCKET_BYTES = 64 << 20  # all-reduce / broadcast buffers are at most this big (one extra copy of them is needed)


class DistributedError(ConfigError):
    """The launch or the combination of options does not work across processes; the message says what to change."""


@dataclass(frozen=True)
class Parallel:
    """This process's place in the run. The default is a plain single-process run (ComfyUI, `tightrope run`)."""
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    fsdp: bool = False
    scratch_dir: Path | None = None   # non-main ranks' output folder (private, removed at exit)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def shard(self) -> tuple[int, int] | None:
        """(rank, world size) for TrainingDataset.batches, or None in a single process."""
        return (self.rank, self.world_size) if self.distributed else None


_SINGLE = Parallel()
_current: Parallel | None = None


def current() -> Parallel:
    """The run's Parallel: set by `launched()`; else derived from an already initialised process group; else a
    single process."""
    if _current is not None:
        return _current
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return Parallel(rank=torch.distributed.get_rank(), world_size=torch.distributed.get_world_size(),
                        local_rank=int(os.environ.get("LOCAL_RANK", 0)))
    return _SINGLE


def torchrun_env(environ: Mapping[str, str] | None = None) -> tuple[int, int, int] | None:
    """(rank, world size, local rank) from torchrun's environment, or None when not started by torchrun."""
    env = os.environ if environ is None else environ
    if "WORLD_SIZE" not in env and "RANK" not in env:
        return None
    try:
        world, rank = int(env["WORLD_SIZE"]), int(env["RANK"])
        local = int(env.get("LOCAL_RANK", rank))
    except (KeyError, ValueError):
        raise DistributedError(f"incomplete torchrun environment (WORLD_SIZE={env.get('WORLD_SIZE')!r}, "
                               f"RANK={env.get('RANK')!r}, LOCAL_RANK={env.get('LOCAL_RANK')!r}): start the run "
                               "with torchrun, or unset these variables for a single process") from None
    if world < 1 or not 0 <= rank < world:
        raise DistributedError(f"torchrun environment has RANK={rank} with WORLD_SIZE={world}: RANK must be "
                               "from 0 to WORLD_SIZE - 1")
    return rank, world, local


def backend() -> str:
    """NCCL for CUDA tensors and gloo for CPU ones (so a `device=cpu` Train node works on a GPU machine too)."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


@contextlib.contextmanager
def launched(*, fsdp: bool = False) -> Iterator[Parallel]:
    """The run's process group, from torchrun's environment: set up on entry, torn down on exit (also on errors).
    Without torchrun this is a single process (and --fsdp is refused: there is nothing to shard over)."""
    global _current
    env = torchrun_env()
    if env is None:
        if fsdp:
            raise DistributedError("--fsdp shards the base model over the processes torchrun starts: launch with "
                                   "`torchrun --nproc_per_node=N -m tightrope run ... --fsdp` (or drop --fsdp)")
        _current = Parallel()
        try:
            yield _current
        finally:
            _current = None
        return
    rank, world, local = env
    if not torch.distributed.is_available():
        raise DistributedError("this PyTorch build has no torch.distributed: install a build with it to use torchrun")
    if torch.cuda.is_available() and not torch.distributed.is_nccl_available() \
            and not torch.distributed.is_initialized():  # else init_process_group's RuntimeError, as a bug's traceback
        raise DistributedError("torchrun on CUDA GPUs needs NCCL, which this PyTorch build lacks (PyTorch for Windows "
                               "has none): train in one process (run without torchrun), or use torchrun on Linux")
    previous_device = None  # the process's current GPU, set back on exit (a ComfyUI or a script goes on using it)
    if torch.cuda.is_available():
        if local >= torch.cuda.device_count():
            raise DistributedError(f"LOCAL_RANK={local} but this machine has {torch.cuda.device_count()} GPU(s): "
                                   "use --nproc_per_node at most the number of GPUs")
        previous_device = torch.cuda.current_device()
        torch.cuda.set_device(local)
    created, scratch = not torch.distributed.is_initialized(), None
    try:
        if created:
            torch.distributed.init_process_group(backend=backend())
        else:
            _check_cpu_backend()
        scratch = None if rank == 0 else Path(tempfile.mkdtemp(prefix=f"tightrope-rank{rank}-"))
        _current = Parallel(rank=rank, world_size=world, local_rank=local, fsdp=fsdp, scratch_dir=scratch)
        yield _current
    finally:
        _current = None
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        if created and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        if previous_device is not None:
            torch.cuda.set_device(previous_device)


def _check_cpu_backend() -> None:
    """A process group made before tightrope must reduce host tensors too (optimizer offload's gradients, the ranks'
    agreement on the run): an NCCL-only group refuses them after the first step's backward."""
    config = torch.distributed.get_backend_config()
    if "cpu:" not in config:
        raise DistributedError(f"the process group initialised before tightrope has no backend for CPU tensors "
                               f"(backend {config!r}); tightrope reduces host tensors too: initialise it with "
                               f"backend='cpu:gloo,cuda:nccl', or leave it to tightrope (it makes that group under "
                               "torchrun)")


def local_device(device: torch.device) -> torch.device:
    """A bare 'cuda' becomes a GPU with its index, as its tensors report it: under torchrun this rank's GPU,
    cuda:LOCAL_RANK, else the current one."""
    par = current()
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", par.local_rank if par.distributed else torch.cuda.current_device())
    return device


def resolve_device(name: str = "auto") -> torch.device:
    """The device this process trains on, from `name` ('auto', 'cpu', 'cuda', 'cuda:1'); under torchrun, this
    rank's own GPU."""
    if not isinstance(name, str):  # a null in an API prompt reaches here: ComfyUI cannot tell it from a link
        raise ConfigError(f"device={name!r} is not a device: choose 'auto', 'cuda' or 'cpu'")
    if name == "auto":
        return local_device(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device={name!r} but CUDA is not available: choose 'auto' or 'cpu'")
    return local_device(torch.device(name))


# ------------------------------------------------------------------------------------------------------ data
def check_batch_size(batch_size: int, par: Parallel | None = None) -> None:
    par = par or current()
    if par.distributed and batch_size % par.world_size:
        world = par.world_size
        below, above = batch_size // world * world, (batch_size // world + 1) * world
        raise ConfigError(f"batch_size={batch_size} is not divisible by the world size {world}: batch_size is the "
                          f"global batch, split evenly over the {world} processes; use a multiple of {world} (e.g. "
                          f"{f'{below} or ' if below else ''}{above}) or start another number of processes")


def shard_bounds(n: int, rank: int, world: int) -> tuple[int, int]:
    """Rank `rank`'s contiguous part [lo, hi) of n items (sizes differ by at most one, like torch.tensor_split)."""
    base, extra = divmod(n, world)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


def global_batch_size(batch: Mapping) -> int:
    """How many samples the global batch of this (possibly sharded) batch has."""
    return batch["shard"][2] if "shard" in batch else batch["latents"].shape[0]


def this_rank_part(batch: Mapping, *global_tensors: torch.Tensor) -> tuple[list[torch.Tensor], float]:
    """This rank's rows of tensors drawn for the whole global batch (noise, timesteps), and the rank's weight:
    its share of the global batch. An empty part (a batch smaller than the world) trains on the first sample
    with weight 0, so every rank still runs the forward and backward its collectives expect."""
    if "shard" not in batch:
        return list(global_tensors), 1.0
    lo, hi, n = batch["shard"]
    rows = slice(lo, hi) if hi > lo else slice(0, 1)
    return [t[rows] for t in global_tensors], (hi - lo) / n


def on_main_rank(fn: Callable[[], T]) -> T:
    """fn() on rank 0 only (a file write), its result sent to every rank, so all ranks go on with the same value;
    if it fails there, every rank raises. A single process just calls fn."""
    par = current()
    if not par.distributed:
        return fn()
    box: list = [None]
    if par.is_main:
        try:
            box[0] = ("ok", fn())
        except BaseException as exc:
            box[0] = ("error", f"{type(exc).__name__}: {exc}")
            with collective("rank 0's report of its error", current().rank):
                torch.distributed.broadcast_object_list(box, src=0)
            raise
    with collective("an exchange of rank 0's decision", current().rank):
        torch.distributed.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "error":  # rank 0 reports its own error (a traceback there if it is a bug): one line here
        raise DistributedError(f"rank 0 failed ({value}), so rank {par.rank} stops too: see rank 0's output")
    return value


def from_every_rank(value: T) -> list[T]:
    """Every rank's `value` (small, picklable), in rank order, on every rank; [value] in a single process."""
    par = current()
    if not par.distributed:
        return [value]
    values: list = [None] * par.world_size
    with collective("an exchange of every rank's check", current().rank):
        torch.distributed.all_gather_object(values, value)
    return values


def on_every_rank(fn: Callable[[], T]) -> T:
    """fn() on every rank (a rank's own check or read); if it fails on any rank, every rank raises: the failing rank
    its own error, the others one line naming it. So no rank goes on into collectives a failed one never joins."""
    par = current()
    if not par.distributed:
        return fn()
    failure: BaseException | None = None
    try:
        value = fn()
    except BaseException as exc:
        failure = exc
    errors = from_every_rank(None if failure is None else f"{type(failure).__name__}: {failure}")
    if failure is not None:
        raise failure
    failed = [(rank, error) for rank, error in enumerate(errors) if error is not None]
    if failed:
        rank, error = failed[0]
        raise DistributedError(f"rank {rank} failed ({error}), so rank {par.rank} stops too: see rank {rank}'s "
                               "output")
    return value


# ------------------------------------------------------------------------------------------------------ gradients
def _buckets(tensors: Sequence[torch.Tensor], limit: int = BUCKET_BYTES) -> Iterator[list[int]]:
    """Indices of tensors grouped in order, each group on one device and dtype, at most `limit` bytes (or one)."""
    group: list[int] = []
    size = 0
    for i, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        if group and (size + nbytes > limit or (t.device, t.dtype) != (tensors[group[0]].device,
                                                                       tensors[group[0]].dtype)):
            yield group
            group, size = [], 0
        group.append(i)
        size += nbytes
    if group:
        yield group


@torch.no_grad()
def _flat_collective(tensors: Sequence[torch.Tensor], op) -> None:
    for group in _buckets(tensors):
        parts = [tensors[i] for i in group]
        flat = torch.cat([t.reshape(-1) for t in parts])
        op(flat)
        offset = 0
        for t in parts:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def all_reduce_gradients(params: Iterable[nn.Parameter], loss: float) -> float:
    """Sum the parameters' gradients over the ranks, in place, and return the summed loss. Each rank weighted its
    loss by its share of the global batch, so the sums are the gradient and loss of the global-batch mean. A
    single process returns at once. The loss travels in the first bucket (no extra collective)."""
    par = current()
    if not par.distributed:
        return loss
    params = list(params)
    if not params:
        return loss
    for p in params:
        if p.grad is None:  # every rank must send the same layout
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    carrier = torch.tensor([loss], dtype=grads[0].dtype, device=grads[0].device)
    with collective("the gradient all-reduce", current().rank):
        _flat_collective([carrier] + grads, lambda flat: torch.distributed.all_reduce(flat))
    return float(carrier.item())


def broadcast_parameters(params: Iterable[torch.Tensor], src: int = 0) -> None:
    """Make every rank's tensors equal to rank `src`'s (the LoRA at the start of a run)."""
    if current().distributed:
        with collective("the broadcast of rank 0's LoRA", current().rank):
            _flat_collective([p.data for p in params], lambda flat: torch.distributed.broadcast(flat, src))


# ------------------------------------------------------------------------------------------------------ resume
def resume_fields(batch_size: int) -> dict[str, int]:
    """What a resume-state file should record about the layout of the run."""
    return {"world_size": current().world_size, "global_batch_size": batch_size}


def check_resume(saved: Mapping, batch_size: int) -> None:
    """A run can resume with another world size (the data, noise and timesteps are functions of the global step and
    the global batch), but not with another global batch: its step would mean other samples."""
    saved_batch = saved.get("global_batch_size")
    if saved_batch is not None and int(saved_batch) != batch_size:
        raise ConfigError(f"cannot resume: the saved run used a global batch_size of {saved_batch} (world size "
                          f"{saved.get('world_size', '?')}), this one {batch_size} (world size "
                          f"{current().world_size}); the world size may change, the global batch may not: set "
                          f"batch_size={saved_batch} (it is split over the processes), or start a new run")
    check_batch_size(batch_size)


# ------------------------------------------------------------------------------------------------------ sharding
def launch_sharding() -> ShardingConfig:
    """The Strategy's sharding part as the launch asks for it: 'fsdp' under `--fsdp`, else off."""
    return ShardingConfig(mode="fsdp") if current().fsdp else ShardingConfig()


def prepare_ranks(module: nn.Module, strategy: Strategy, device: torch.device) -> tuple[Strategy, object]:
    """The strategy and device mesh this rank trains `module` with. Under --fsdp the strategy's sharding part is
    set (a strategy that also offloads layers is refused, naming both), and a sharding strategy gets the mesh over
    the ranks: the memory runtime shards a copy of the blocks as its first step (memory/sharding.py). Otherwise,
    with several ranks on one machine, the module's frozen host weights are first mapped from one shared copy per
    machine (memory/shared_host.py), and stay so after the run."""
    par = current()
    if par.fsdp:
        strategy = strategy.replace(sharding=launch_sharding())
    if strategy.sharding.active:
        if not torch.distributed.is_initialized():
            raise DistributedError(f"Strategy.shard={strategy.sharding.mode!r} shards the base model over the "
                                   "processes torchrun starts: launch with `torchrun --nproc_per_node=N -m tightrope "
                                   "run ... --fsdp`, or set shard='off'")
        from torch.distributed.device_mesh import init_device_mesh
        return strategy, init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    if par.distributed:
        from ..memory.shared_host import share_across_local_ranks
        share_across_local_ranks(module, par.local_rank)
    return strategy, None

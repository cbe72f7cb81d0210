"""A run's micro-batches, read and prepared on the host one ahead of the device.

Reading a micro-batch (its latents and text embeddings from the dataset's cache) and preparing it (noise, timesteps,
the noised latents: CPU work, drawn from the micro-batch's own seeded generator) takes the host milliseconds at
large resolutions. Done in turn, the GPU idled through it before every micro-batch. Here a worker thread reads and
prepares the next micro-batch while the current one trains: one ahead, so at most two are in host memory. What is
drawn depends only on (seed, step, micro-batch), never on the thread or the timing, so runs stay bit for bit
reproducible and resumable. An error reading a micro-batch is raised when that micro-batch's turn comes, as if it
had been read then.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from . import distributed
from .flow_loss import at_least_fp32, noised
from .timesteps import sample_timesteps


@dataclass
class HostInputs:
    """A micro-batch ready for the device: the model's inputs and the loss's targets, on the host, and its weight
    (its share of the step's images times this rank's part of it)."""
    x_t: torch.Tensor
    t: torch.Tensor
    context: torch.Tensor
    pooled: torch.Tensor
    latents: torch.Tensor
    noise: torch.Tensor
    mask: torch.Tensor | None  # (B, 1, h, w) loss weights on the latent grid (training/data/masks.py), if any
    weight: float
    seed: int  # the micro-batch's stream seed: its noise and timesteps came from it, its LoRA dropout does too


def step_batches(batches: Iterator, count: int) -> list[tuple[object, float]]:
    """The step's `count` micro-batches (the dataset's next PlannedBatches: a resumed run's start at its step), not
    read yet, each with its share of the step's images. A step trains as one batch of all their images would, every
    image weighing the same: a bucket's last batch can be smaller than batch_size, and dividing each micro-batch's
    mean loss by grad_accumulation gave its images more weight. Under torchrun these are shares of the global batches
    (each rank loads its part, `batch["shard"]`) and each rank weights its part by its share of that (this_rank_part),
    so the ranks sum to what one process computes. The step's loss is the same image-weighted mean."""
    step = [next(batches) for _ in range(count)]
    total = sum(planned.size for planned in step)
    return [(planned, planned.size / total) for planned in step]


def prepare(batch: dict, process_latents: Callable[[torch.Tensor], torch.Tensor], seed: int, share: float, *,
            timestep_sampling: str, timestep_shift: float,
            timestep_range: tuple[float, float]) -> HostInputs:
    """A read micro-batch made ready for the device: noise and timesteps of the global batch from the generator
    seeded with `seed` (this rank keeps its rows), and the noised latents. Tensors a node made under inference_mode
    cannot be saved for backward: the batch's are copied."""
    gen = torch.Generator().manual_seed(seed)
    latents, context, pooled = (batch[k].clone() for k in ("latents", "context", "pooled"))
    # ComfyUI models: VAE latents -> the model's latent space; in fp32 (a half-precision LATENT's scale and shift
    # were rounded to its dtype, so the same values trained otherwise held in fp32)
    latents = process_latents(at_least_fp32(latents))
    n = distributed.global_batch_size(batch)
    noise = torch.randn((n, *latents.shape[1:]), generator=gen)
    t = sample_timesteps(n, gen, kind=timestep_sampling, shift=timestep_shift, t_range=timestep_range)
    (noise, t), weight = distributed.this_rank_part(batch, noise, t)
    return HostInputs(noised(latents, noise, t), t, context, pooled, latents, noise, batch.get("mask"),
                      weight * share, seed)


class MicroBatches:
    """The micro-batches of steps [first, end) in order (`count` per step), each read and made ready by
    `make(batch, step, micro, share)` on a worker thread while the one before it trains. `take(step, micro)` returns
    the one asked for (waiting for it if need be) and starts on the next; `close()` (in a `finally`) waits for the
    worker and ends it, so no thread outlives the run (ComfyUI is a long-running process)."""

    def __init__(self, batches: Iterator, count: int, first: int, end: int,
                 make: Callable[[dict, int, int, float], HostInputs]):
        self._batches, self._count, self._end, self._make = batches, count, end, make
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tightrope-batches")
        self._step_plan: list[tuple[object, float]] = []
        self._next: tuple[int, int, Future] | None = None
        self._submit(first, 0)

    def _submit(self, step: int, micro: int) -> None:
        if step >= self._end:
            self._next = None
            return
        try:
            if micro == 0:  # the step's micro-batches and their shares, from the dataset's order, in turn
                self._step_plan = step_batches(self._batches, self._count)
            planned, share = self._step_plan[micro]
        except Exception as e:  # raised in its turn too, not while the micro-batch before it is still to train
            future = Future()
            future.set_exception(e)
        else:
            future = self._pool.submit(lambda: self._make(planned.load(), step, micro, share))
        self._next = (step, micro, future)

    def take(self, step: int, micro: int) -> HostInputs:
        if self._next is None or self._next[:2] != (step, micro):
            raise RuntimeError(f"micro-batch ({step}, {micro}) asked for out of order: next is "
                               f"{self._next[:2] if self._next else None}")
        future = self._next[2]
        self._next = None
        inputs = future.result()  # a failed read raises here, in its turn
        self._submit(*((step, micro + 1) if micro + 1 < self._count else (step + 1, 0)))
        return inputs

    def close(self) -> None:
        """Drop the micro-batch read ahead (an error reading it is not the run's: its turn never came)."""
        pending, self._next = self._next, None
        if pending is not None:
            pending[2].cancel()
        self._pool.shutdown(wait=True)

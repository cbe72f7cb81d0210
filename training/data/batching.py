"""The dataset's batches: deterministic epochs of single-bucket batches (TrainingDataset's batching half).

A bucket is a (latent shape, caption-embedding shape) pair: every batch stacks samples of one bucket. Text encoders
that pad (Flux's T5, SD3's CLIP + T5, Wan's UMT5) give every caption up to their padded length one shape, so buckets
are mostly the latent shapes (ComfyUI pads Flux's T5 to 256 tokens and does not cut a longer caption: it has a shape,
and a bucket, of its own);
those that do not (Lumina 2's Gemma, Qwen-Image's Qwen2.5-VL) give each caption its own token count, and training
sees each caption at its own length, as sampling does. Caption dropout then swaps in the empty caption, whose length
differs: a batch of such a bucket drops all its captions or none (decided by its first item's draw), so each item
is still dropped with the set probability.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from .image_folder import DatasetError
from .keys import epoch_stream_seed


@dataclass(frozen=True)
class PlannedBatch:
    """A batch not yet read: its global size (all ranks' samples), and the call that reads and stacks it."""
    size: int
    load: Callable[[], dict]


class EpochBatches:
    """Mixin over the dataset's `_buckets` ((latent shape, context shape) -> items), `_items`, `_samples`,
    `_text(i)`, `_empty_text`, `_text_shapes`, `caption_dropout` and `_stored(sample)` -> (latent, mask)."""

    def steps_per_epoch(self, batch_size: int) -> int:
        """Batches per epoch: each bucket gives ceil(items / batch_size), its last batch possibly smaller."""
        self._check_batch_size(batch_size)
        return sum(math.ceil(len(items) / batch_size) for items in self._buckets.values())

    def thin_batches(self, batch_size: int) -> str | None:
        """Why an epoch's batches average less than half of batch_size, or None: a batch holds one bucket's items,
        and a dataset of many aspect ratios (or caption lengths) in few images has many buckets of one or two."""
        n, steps = len(self), self.steps_per_epoch(batch_size)
        if batch_size < 2 or n < 2 * batch_size or 2 * n >= batch_size * steps:
            return None
        latent_shapes = {latent for latent, _ in self._buckets}
        by_caption = len(latent_shapes) < len(self._buckets)
        clips = any(len(shape) == 4 for shape in latent_shapes)  # (C, T, h, w): a clip's frames make a bucket too
        size = "image or clip size (frames and height x width)" if clips else "image size"
        what = f"{size} and caption length" if by_caption else size
        fix = "crop the images to a few aspect ratios" + (" and give every clip at least the frames set (a shorter "
                                                          "clip trains alone)" if clips else "")
        if by_caption:
            fix += " and keep captions under the text encoder's padded length (Flux: 256 T5 tokens)"
        return (f"batch_size={batch_size}: a batch holds images of one bucket (one {what}), and the {n} items fall "
                f"into {len(self._buckets)} buckets: an epoch has {steps} batches of {n / steps:.1f} items on "
                f"average, not {math.ceil(n / batch_size)} of {batch_size}: {fix} for full batches, or raise "
                "grad_accumulation for a larger effective batch")

    def _check_batch_size(self, batch_size: int) -> None:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if batch_size > len(self):
            raise DatasetError(f"batch_size={batch_size} is larger than the dataset ({len(self)} items after repeats): "
                               f"lower batch_size to at most {len(self)}, or add images or repeats")

    def largest_batch(self, batch_size: int) -> dict:
        """The batch with the most latent elements any epoch gives, the longest captions among equals
        (deterministic): what a memory probe must fit."""
        self._check_batch_size(batch_size)

        def size(kv):
            (latent_shape, context_shape), items = kv
            return min(batch_size, len(items)) * math.prod(latent_shape), context_shape[0]
        items = max(self._buckets.items(), key=size)[1]
        return self._collate([(item, False) for item in items[:batch_size]])

    def epoch_plan(self, batch_size: int, seed: int, epoch: int) -> list[list[tuple[int, bool]]]:
        """The epoch's batches as lists of (item, caption dropped); a pure function of its arguments."""
        self._check_batch_size(batch_size)
        g = torch.Generator().manual_seed(epoch_stream_seed(seed, "order", epoch))
        batches, shapes = [], []
        for (_, context_shape), items in self._buckets.items():  # sorted by shape, so the draw order is fixed
            shuffled = [items[i] for i in torch.randperm(len(items), generator=g).tolist()]
            batches += [shuffled[i:i + batch_size] for i in range(0, len(shuffled), batch_size)]
            shapes += [context_shape] * math.ceil(len(items) / batch_size)
        order = torch.randperm(len(batches), generator=g).tolist()

        # Dropout draws use their own stream, so changing the rate never changes the order.
        g = torch.Generator().manual_seed(epoch_stream_seed(seed, "caption_dropout", epoch))
        draws = iter(torch.rand(len(self), generator=g, dtype=torch.float64).tolist())
        empty = None if self._empty_text is None else self._text_shapes[self._empty_text][0]
        plan = []
        for i in order:
            dropped = [next(draws) < self.caption_dropout for _ in batches[i]]
            if empty is not None and shapes[i] != empty:  # the empty caption cannot be stacked with this bucket's
                dropped = dropped[:1] * len(dropped)
            plan.append(list(zip(batches[i], dropped)))
        return plan

    def batches(self, batch_size: int, seed: int, start_step: int = 0,
                shard: tuple[int, int] | None = None) -> Iterator[dict]:
        """Endless batches {"latents" (B,C,h,w), "context" (B,T,D), "pooled" (B,P), "captions"}, plus "mask"
        (B,1,h,w) for a dataset with loss masks; one bucket per batch. start_step resumes: step S is the same batch a
        run from step 0 would see at S.
        shard=(rank, world): each global batch is cut as training/distributed.py says and only this rank's part
        is loaded, with "shard": (lo, hi, global batch size) added; the plan is the unsharded one."""
        return (planned.load() for planned in self.planned_batches(batch_size, seed, start_step, shard))

    def planned_batches(self, batch_size: int, seed: int, start_step: int = 0,
                        shard: tuple[int, int] | None = None) -> Iterator[PlannedBatch]:
        """batches(), each read only when its load() is called: a step knows its micro-batches' sizes first, and
        holds one read micro-batch at a time."""
        if self.caption_dropout > 0 and self._empty_text is None:
            raise DatasetError("caption dropout needs the empty caption's encoding: build the dataset with "
                               "empty_context/empty_pooled, or set caption_dropout=0")
        steps = self.steps_per_epoch(batch_size)
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        epoch, offset = divmod(start_step, steps)
        while True:
            for batch in self.epoch_plan(batch_size, seed, epoch)[offset:]:
                yield PlannedBatch(len(batch), (lambda b=batch: self._collate(b)) if shard is None
                                   else (lambda b=batch: self._collate_part(b, *shard)))
            epoch, offset = epoch + 1, 0

    def _collate_part(self, batch: list[tuple[int, bool]], rank: int, world: int) -> dict:
        from ..distributed import shard_bounds
        lo, hi = shard_bounds(len(batch), rank, world)
        part = self._collate(batch[lo:hi] or batch[:1])  # an empty part: a stand-in sample, weighted 0 in training
        part["shard"] = (lo, hi, len(batch))
        return part

    def _collate(self, batch: list[tuple[int, bool]]) -> dict:
        latents, contexts, pooled, captions, masks = [], [], [], [], []
        for item, dropped in batch:
            sample = self._samples[self._items[item]]
            context, vec = self._text(self._empty_text if dropped else sample.text)
            latent, mask = self._stored(sample)
            latents.append(latent)
            if mask is not None:
                masks.append(mask)
            contexts.append(context)
            pooled.append(vec)
            captions.append("" if dropped else sample.caption)
        return {"latents": torch.stack(latents), "context": torch.stack(contexts),
                "pooled": torch.stack(pooled), "captions": captions} | ({"mask": torch.stack(masks)} if masks else {})

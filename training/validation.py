"""Validation loss: a held-out set scored with fixed noise and timesteps, so its curve moves only with the LoRA.

The set is a fraction of the dataset's images (drawn from the seed and left out of training) or a second dataset.
Each of its images is scored with its own caption and with noise and a timestep drawn from a stream of its own,
(seed, "validation", image): the same draws at every evaluation, independent of the training stream. Scoring never
changes training: no gradient is taken, the global RNG is forked, and the model is in eval mode (no LoRA dropout)
only while it is scored. It runs in the training's memory strategy: without gradients checkpointing is skipped and
nothing is saved for backward, while layer offload streams the blocks as in any forward. The evaluation is
bracketed as a step of its own, so its transfers and time never count in a training step's statistics.

When: at the node run's first and last step and every `validation_every` steps, each step once (a step already
in the session's history, from the node before or from a resumed state, is not scored again).
"""
from __future__ import annotations

import contextlib
import hashlib
import math
from typing import Any

import torch

from . import distributed
from .data.masks import masked_per_image
from .flow_loss import at_least_fp32, exact_summable, flow_matching_loss, noised
from .data.image_folder import DatasetError
from .timesteps import sample_timesteps
from .train_config import ConfigError, TrainConfig


def split_for_validation(session: Any) -> tuple[Any, Any | None]:
    """(the images to train on, the validation set or None) of a session; errors name the input and the fix."""
    cfg, dataset, second = session.config, session.dataset, session.validation_dataset
    if second is not None and cfg.validation_fraction > 0:
        raise ConfigError(f"validation_fraction={cfg.validation_fraction} and a validation_dataset are both given: "
                          "hold out part of the dataset or validate on the second dataset, not both (set "
                          "validation_fraction to 0 or disconnect validation_dataset)")
    if second is not None:
        return dataset, second
    if cfg.validation_fraction == 0:
        return dataset, None
    n = dataset.num_images
    held_out = math.floor(round(cfg.validation_fraction * n, 6))
    if held_out < 1:
        raise DatasetError(f"validation_fraction={cfg.validation_fraction} of {n} images holds out 0 images: raise it "
                           f"to at least {1 / n:.3g} (1 image), or connect a validation_dataset")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(_stream_seed(cfg.seed, "split"))).tolist()
    return dataset.subset(sorted(order[held_out:])), dataset.subset(sorted(order[:held_out]))


class Validation:
    """Scores the LoRA on a validation set. Under torchrun every rank scores every image (the same numbers), in
    batches no larger than a rank's part of a training batch."""

    def __init__(self, dataset: Any, config: TrainConfig, *, run_start: int, run_end: int,
                 recorded: tuple[tuple[int, float], ...] = ()):
        """run_start, run_end: the node run's first and last step; recorded: the session's validation history."""
        self.dataset, self.config = dataset, config
        self.run_start, self.run_end = run_start, run_end
        self.history: list[tuple[int, float]] = list(recorded[-1:])  # its last step is not scored again
        self._recorded = len(self.history)
        by_shape: dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]] = {}
        for i in range(dataset.num_images):  # captions of several token counts (Lumina 2, Qwen-Image) batch apart
            by_shape.setdefault((dataset.latent_shape(i), dataset.text_shape(i)), []).append(i)  # read no file
        size = -(-config.batch_size // distributed.current().world_size)  # a rank's part of a training batch
        self.batches = [images[k:k + size] for _, images in sorted(by_shape.items())
                        for k in range(0, len(images), size)]

    @property
    def scored(self) -> list[tuple[int, float]]:
        """The (step, loss) pairs scored in this run."""
        return self.history[self._recorded:]

    def due(self, step: int) -> bool:
        if self.history and self.history[-1][0] == step:
            return False
        return step % self.config.validation_every == 0 or step in (self.run_start, self.run_end)

    def score_if_due(self, step: int, adapter: Any, module: torch.nn.Module, runtime: Any) -> float | None:
        if not self.due(step):
            return None
        loss = self.loss(adapter, module, runtime)
        self.history.append((step, loss))
        return loss

    def loss(self, adapter: Any, module: torch.nn.Module, runtime: Any) -> float:
        """The mean per-image loss over the set (each image's loss is the mean over its elements, weighted by its loss
        mask where the dataset has masks, as in training)."""
        cuda = [runtime.device] if runtime.device.type == "cuda" else []
        total = 0.0
        with torch.no_grad(), torch.random.fork_rng(devices=cuda), _eval_mode(module):
            runtime.start_step()  # a step of its own: its transfers and time stay out of the training steps' stats
            try:
                for images in self.batches:  # summed on the device, read once: no wait for the GPU per batch
                    total = total + exact_summable(self._batch_losses(images, adapter, module, runtime)).sum()
                total = float(total)
            finally:
                runtime.end_step()
        return total / self.dataset.num_images

    def _batch_losses(self, images: list[int], adapter: Any, module: torch.nn.Module, runtime: Any) -> torch.Tensor:
        cfg = self.config
        latents = at_least_fp32(torch.stack([self.dataset.latent(i) for i in images]))  # as training's (prepare)
        texts = [self.dataset.text(i) for i in images]
        context, pooled = torch.stack([c for c, _ in texts]), torch.stack([p for _, p in texts])
        latents = adapter.process_latents(latents)  # ComfyUI models: VAE latents -> the model's latent space
        noise, t = [], []
        for i in images:  # fixed draws per image, whatever batch it lands in
            gen = torch.Generator().manual_seed(_stream_seed(cfg.seed, "validation", i))
            noise.append(torch.randn(latents.shape[1:], generator=gen))
            t.append(sample_timesteps(1, gen, kind=cfg.timestep_sampling, shift=cfg.timestep_shift,
                                      t_range=cfg.timestep_range))  # an expert's LoRA: scored where it trains
        noise, t = torch.stack(noise).to(latents.dtype), torch.cat(t)
        masks = [self.dataset.mask(i) for i in images]
        x_t, t, context, pooled, latents, noise, mask = runtime.inputs(  # the host does not wait for the GPU here
            noised(latents, noise, t), t, context, pooled, latents, noise,
            None if masks[0] is None else torch.stack(masks))
        with runtime.autocast():
            pred = adapter.predict(module, x_t, t, context, pooled, cfg.guidance, runtime.inputs)
        if mask is None:
            return flow_matching_loss(pred, latents, noise, kind=cfg.loss, huber_delta=cfg.huber_delta,
                                      reduction="none")
        elementwise = flow_matching_loss(pred, latents, noise, kind=cfg.loss, huber_delta=cfg.huber_delta,
                                         reduction="element")
        return masked_per_image(elementwise, mask)


@contextlib.contextmanager
def _eval_mode(module: torch.nn.Module):
    """Eval mode (no dropout) while scoring; every submodule's own mode is given back afterwards."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


def report_line(history: tuple[tuple[int, float], ...]) -> str | None:
    """The report's validation line: first, last and best validation loss, with their steps."""
    if not history:
        return None
    (s0, v0), (s1, v1) = history[0], history[-1]
    best = min(history, key=lambda p: p[1])
    return (f"validation loss: step {s0} {v0:.4f}, step {s1} {v1:.4f} (best {best[1]:.4f} at step {best[0]}, "
            f"{len(history)} evaluations)")


def _stream_seed(*parts: Any) -> int:
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
